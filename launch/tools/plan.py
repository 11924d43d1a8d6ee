"""Memory planner: which layouts of a GPT fit a cluster, best first, with bytes per device.

    python -m launch.plan [model flags as for pretrain] --world-size 64 --gpus-per-node 8 \\
        --memory-per-device 80GiB [--zero-stage S] [--tensor-model-parallel-size T] \\
        [--pipeline-model-parallel-size P] [--json]

For every layout (tp, pp, dp, ZeRO stage, recompute, micro-batch size, optimizer offload) it predicts,
for the most loaded device (the first pipeline stage for activations, the heaviest stage for model
states):

- model states: the parameters of that rank's slice, from the model itself (built on the meta device
  as training builds it), kept whole or sharded as ``parallel.zero`` keeps them (stage 3 keeps
  parameters up to the persistence threshold, and those whose gradients a model-parallel reduction
  needs, whole), priced by ``zero.expected_parameter_state_bytes``;
- activations: saved bytes per micro-batch by our layer's accounting (``layer_elements``: Korthikanti
  et al.'s for a fused attention that keeps no s^2 matrix, following the architecture: sbh(4 + 12/t)
  elements per GPT-3 layer, 16 sbh/t with sequence parallelism; sbh (or sbh/t) with full recompute of
  each layer, i.e. --recompute-num-layers 1), times
  the micro-batches 1F1B keeps alive, plus the last stage's logits and loss; with full recompute also
  the transient of rebuilding one layer in backward;
- gradients are fp32 main gradients for 16-bit parameters (4 bytes each, staging and reductions
  included), unless --grad-reduce-in-bf16 keeps them in bf16;
- buffers: the ZeRO-R staging arenas (two buckets per dtype from stage 2) and stage-3 gathers;
- communication per step and axis by the ring model of ``parallel.comm``, and the part that crosses
  nodes of ``--gpus-per-node`` ranks.

Layouts that fit are ranked by a step-time proxy: recompute cost x offload cost / (1 - pipeline bubble),
then the bytes sent to another node (``parallel.comm``'s ring model over the layout's groups).
``--json`` prints the list as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

from models.config import GPTConfig
from models.counting import num_parameters, stage_model
from parallel.zero import expected_parameter_state_bytes, gradient_bytes, optimizer_state_bytes
from parallel.topology import Topology
from parallel.zero.grad_sync import staged_bucket_size
from launch.tools.link_model import (Device, Links, Transfer, ZeroCommOptions,
                                     parse_bandwidth, ring, step_seconds,
                               zero_transfers, zero_variants)
from models.counting import flops_per_token
from pretrain.config.arguments import ConfigError, parse_config

UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20,
         "GiB": 2**30, "TiB": 2**40}


def parse_bytes(text: str) -> int:
    """'80GiB', '40 GB', '1024' -> bytes."""
    stripped = text.replace(" ", "")
    for unit in sorted(UNITS, key=len, reverse=True):
        if stripped.endswith(unit):
            return int(float(stripped[:-len(unit)]) * UNITS[unit])
    return int(float(stripped))


@dataclass(frozen=True)
class Layout:
    """One way to run the model: parallel sizes, ZeRO stage, recompute, micro-batch size, optimizer
    offload (none or cpu), sequence parallelism. A value, never checked against a model by itself."""

    tp: int
    pp: int
    dp: int
    zero_stage: int
    recompute: str | None = None
    micro_batch_size: int = 1
    offload_optimizer: str = "none"
    sequence_parallel: bool = False
    layers_per_stage: tuple[int, ...] | None = None  # --pipeline-layers-per-stage (else even)
    zero: ZeroCommOptions = ZeroCommOptions()  # ZeRO++ / MiCS

    def layers_on(self, stage: int, num_layers: int) -> int:
        return self.layers_per_stage[stage] if self.layers_per_stage else num_layers // self.pp


@dataclass
class Plan:
    """A layout and what it costs per device (bytes) and per step (bytes sent per axis), with its rank
    among layouts (``score``, lower is faster). Predictions only: it never measures anything."""

    layout: Layout
    model_state_bytes: float
    # kept for backward at the peak (what the trainer's saved_activation_bytes measures)
    activation_bytes: float
    buffer_bytes: float  # ZeRO-R staging and gathers, and the recompute of one layer
    comm_bytes: dict[str, float] = field(default_factory=dict)
    comm_bytes_inter_node: dict[str, float] = field(default_factory=dict)  # of those, to another node
    score: float = 0.0
    transfers: list[Transfer] = field(default_factory=list, repr=False)  # what the link model times
    step_seconds: float | None = None  # predicted by the link model (``links`` given)

    @property
    def total_bytes(self) -> float:
        return self.model_state_bytes + self.activation_bytes + self.buffer_bytes


def _stage_parameters(config: GPTConfig, layout: Layout, stage: int) -> list:
    """The parameters of pipeline ``stage``'s tp slice, as ``models.pipeline_stage`` builds them (on meta)."""
    return list(stage_model(config, layout.tp, layout.pp, stage, sequence_parallel=layout.sequence_parallel,
                            layers_per_stage=list(layout.layers_per_stage or []) or None).parameters())


def model_state_bytes(config: GPTConfig, layout: Layout, stage: int, compute_bytes: int,
                      persistence_threshold: int = 100_000, grad_bytes: int | None = None) -> float:
    """What ``parallel.zero`` holds on a rank of ``stage`` (offloaded optimizer states excluded)."""
    params = _stage_parameters(config, layout, stage)
    shard = layout.zero.shard_size or layout.dp
    total = expected_parameter_state_bytes(params, layout.zero_stage, shard, compute_bytes,
                                           persistence_threshold,
                                           grad_bytes, layout.zero.hpz)
    if layout.offload_optimizer != "none":  # the fp32 masters and moments live elsewhere
        total -= sum(p.numel() for p in params) * optimizer_state_bytes(compute_bytes) / (
            shard if layout.zero_stage else 1)
    return total


def alive_micro_batches(pp: int, stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations 1F1B keeps on ``stage`` at its peak."""
    return min(micro_batches, pp - stage)


def activation_bytes(config: GPTConfig, layout: Layout, stage: int, micro_batches: int,
                     compute_bytes: int) -> float:
    """Peak bytes saved for backward on a rank of ``stage`` (see the module docstring)."""
    s, b, h, t = config.seq_length, layout.micro_batch_size, config.hidden_size, layout.tp
    sbh = s * b * h
    split = t if layout.sequence_parallel else 1
    per_layer = sbh / split if layout.recompute == "full" else layer_elements(config, layout)
    saved = per_layer * layout.layers_on(stage, config.num_layers) * compute_bytes
    # final norm input and output; the loss's saved logits over this rank's vocabulary
    if stage == layout.pp - 1:
        # (16-bit logits under bf16 / fp16, from which backward recomputes the softmax; the fp32 softmax in
        # fp32)
        saved += 2 * sbh / split * compute_bytes + s * b * config.padded_vocab_size(t) / t * compute_bytes
    return saved * alive_micro_batches(layout.pp, stage, micro_batches)


def layer_elements(config: GPTConfig, layout: Layout) -> float:
    """Elements one transformer layer keeps for backward per micro-batch without recompute, as our layer
    saves them (selective recompute gains nothing here: the fused attention keeps no s^2 matrix), per
    token, t = tp, a query heads and G key/value groups of d channels:

    - each of the two norms: its input and its output (which the next linear keeps), 2h (split by t
      under sequence parallelism);
    - the QKV output, (a + 2G) d / t (attention reads keys and values as views of it), and the
      attention output, a d / t;
    - queries and keys made anew on the way: the queries' copy when groups share keys (a d / t, kept
      unless rotary positions consume it), the query/key norms' outputs and the rotary outputs,
      (a + G) d / t each, and the rotary cos and sin tables (2 x rotated channels, not split);
    - the MLP: fc1's output and the activation's (2 f / t); SwiGLU keeps gate and up, silu(gate) and
      the product, 4 f / t.
    GPT-3's layer (LayerNorm, GELU, learned positions): 4 + 12 / t (x sbh)."""
    t, h, f = layout.tp, config.hidden_size, config.ffn_size
    heads, groups, d = config.num_attention_heads / t, config.query_groups / t, config.head_dim
    split = t if layout.sequence_parallel else 1
    norms = 2 * 2 * h / split
    attention = (heads + 2 * groups) * d + heads * d
    rotary, normed = config.position_embedding == "rope", config.qk_layernorm
    query_copy = heads * d if groups < heads else 0
    if normed:  # the norms keep their inputs (the query copy; keys are views) and make new queries and keys
        attention += query_copy + (0 if rotary else (heads + groups) * d)
    elif not rotary:
        attention += query_copy  # attention itself keeps the copied queries
    if rotary:  # rotation keeps only its tables; attention keeps the rotated queries and keys
        attention += (heads + groups) * d + 2 * config.rotary_channels
    mlp = (4 if config.activation == "swiglu" else 2) * f / t
    return config.seq_length * layout.micro_batch_size * (norms + attention + mlp)


def buffer_bytes(config: GPTConfig, layout: Layout, compute_bytes: int, bucket_size: int,
                 grad_bytes: int | None = None) -> float:
    """ZeRO-R staging (in the gradient dtype): two bucket slots at stage 2 (the bucket capped as the gradient
    sync caps it), two block slots at stage 3, which also gathers a block; full recompute rebuilds one
    layer's activations in backward."""
    grad_bytes = gradient_bytes(compute_bytes) if grad_bytes is None else grad_bytes
    chunks = stage_model(config, layout.tp, layout.pp, 0, sequence_parallel=layout.sequence_parallel)
    block = sum(p.numel() for p in chunks[0].layers[0].parameters())
    params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    slot = staged_bucket_size(bucket_size, params, layout.dp) if layout.zero_stage == 2 else block
    staging = 2 * slot * grad_bytes if layout.zero_stage >= 2 else 0
    gathers = 3 * block * compute_bytes if layout.zero_stage == 3 else 0
    recompute = layer_elements(config, layout) * compute_bytes if layout.recompute == "full" else 0
    return staging + gathers + recompute


def transfers(config: GPTConfig, layout: Layout, micro_batches: int, compute_bytes: int,
              grad_bytes: int | None = None, gpus_per_node: int | None = None, backend: str = "nccl",
              bucket_size: int | None = None) -> list[Transfer]:
    """What one rank of the first pipeline stage sends per step, collective by collective (ring model, as
    parallel.comm counts them): ZeRO's data-parallel transfers (``launch.tools.link_model.zero_transfers``:
    stage 0 all-reduces the gradients once, stage 1 reduce-scatters once, stages 2-3 every micro-batch; stages
    1-2 all-gather the parameters once after the step, stage 3 in forward and in backward of every
    micro-batch; ZeRO++ and shard groups change which groups and how many bytes), tensor parallelism's four
    all-reduces (or their sequence-parallel halves) of each layer's activations in forward and backward, the
    pipeline's activation and gradient sends (those two exposed: each is waited where it starts). The
    data-parallel ones hide behind the passes as they do on ``backend``, a layer (stage 3) or a bucket of
    ``bucket_size`` elements (stages 0-2) a piece."""
    grad_bytes = gradient_bytes(compute_bytes) if grad_bytes is None else grad_bytes
    psi = sum(p.numel() for p in _stage_parameters(config, layout, 0))
    topology = Topology(layout.tp * layout.pp * layout.dp, layout.tp, layout.pp, gpus_per_node)
    node = (lambda rank: rank // gpus_per_node) if gpus_per_node else (lambda rank: 0)
    t, m = layout.tp, micro_batches
    sbh = config.seq_length * layout.micro_batch_size * config.hidden_size * compute_bytes
    layers = layout.layers_on(0, config.num_layers)
    recompute = 1.5 if layout.recompute == "full" else 1.0  # the recomputed forward all-reduces again
    found = zero_transfers(topology, psi, layout.zero_stage, m, compute_bytes, grad_bytes,
                           layout.zero, gpus_per_node,
                           backend, layers, bucket_size)
    found.append(ring("all_reduce", "tp", topology.groups("tp"), node, 2 * (t - 1) / t * sbh * recompute,
                      4 * layers * m))
    if layout.pp > 1:  # forward activations and backward gradients: a line, not a ring
        found.append(Transfer("p2p", "pp", 2 * sbh * m,
                              2 * sbh * m if any(node(a) != node(b) for g in topology.groups("pp")
                                                  for a, b in zip(g, g[1:])) else 0.0, 2 * m))
    return found


def sent_by_axis(found: list[Transfer], crossing: bool = False) -> dict[str, float]:
    """Bytes a rank sends per step on each axis (dp: every data-parallel group, hpZ's and shard groups
    included); with ``crossing``, those of the transfers that leave a node (on a rank whose ring
    neighbour is on another node: the most loaded)."""
    sent = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    for transfer in found:
        if not crossing or transfer.leaving_node > 0:
            sent[transfer.axis if transfer.axis in sent else "dp"] += transfer.per_rank * transfer.count
    return sent


def plan_layout(config: GPTConfig, layout: Layout, global_batch_size: int, compute_bytes: int,
                bucket_size: int = 20_000_000, persistence_threshold: int = 100_000,
                grad_bytes: int | None = None, gpus_per_node: int | None = None, links: Links | None = None,
                device: Device = Device()) -> Plan:
    """What ``layout`` costs; with ``links``, its step time by the link model's overlap model: the compute
    (the model's FLOPs per token at the ``device``'s FLOP/s, over the pipeline bubble and recompute; a
    third of it forward, a quarter with full recompute; ZeRO++'s quantize passes at its quantize rate)
    with the communication that hides behind it on its backend."""
    micro_batches = global_batch_size // (layout.micro_batch_size * layout.dp)
    states = max(model_state_bytes(config, layout, stage, compute_bytes, persistence_threshold, grad_bytes)
                 for stage in range(layout.pp))
    activations = max(activation_bytes(config, layout, stage, micro_batches, compute_bytes)
                      for stage in range(layout.pp))
    found = transfers(config, layout, micro_batches, compute_bytes, grad_bytes, gpus_per_node, device.backend,
                      bucket_size)
    plan = Plan(layout, states, activations,
                buffer_bytes(config, layout, compute_bytes, bucket_size, grad_bytes),
                sent_by_axis(found), sent_by_axis(found, crossing=True), transfers=found)
    bubble = (layout.pp - 1) / (micro_batches + layout.pp - 1)
    recompute_cost = {"full": 4 / 3, "selective": 1.0, None: 1.0}[layout.recompute]
    offload_cost = {"none": 1.0, "cpu": 1.3}[layout.offload_optimizer]
    plan.score = recompute_cost * offload_cost / (1 - bubble)
    if links is not None:
        world = layout.tp * layout.pp * layout.dp
        compute = flops_per_token(config) * global_batch_size * config.seq_length / world / device.flops
        plan.step_seconds = step_seconds(found, links, compute * plan.score, micro_batches,
                                         device.quantize_rate,
                                         1 / 4 if layout.recompute == "full" else 1 / 3)
        plan.score = plan.step_seconds
    return plan


def candidate_layouts(config: GPTConfig, world_size: int, gpus_per_node: int, global_batch_size: int,
                      zero_stage: int | None, tp: int | None, pp: int | None,
                      layers_per_stage: tuple[int, ...] | None = None,
                      zero_plus_plus: bool = False) -> list[Layout]:
    """Every layout of the world worth comparing; with ``zero_plus_plus`` (a link model decides) also
    ZeRO-2 with quantized gradients and ZeRO-3 with hpZ, qwZ, qgZ or shard groups of a node's dp ranks."""
    layouts = []
    for t in ([tp] if tp else [d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0]):
        try:
            config.validate(t)
        except ValueError:  # tp must divide the heads, groups and widths
            continue
        for p in ([pp] if pp else [d for d in range(1, config.num_layers + 1) if config.num_layers % d == 0]):
            if world_size % (t * p):
                continue
            dp = world_size // (t * p)
            for micro in (1, 2, 4, 8):
                if global_batch_size % (micro * dp) or global_batch_size // (micro * dp) < p:
                    continue
                for stage in ([zero_stage] if zero_stage is not None else [0, 1, 2, 3]):
                    for recompute in (None, "selective", "full"):
                        for offload in ("none", "cpu") if stage else ("none",):
                            for options in zero_variants(stage, Topology(world_size, t, p, gpus_per_node), gpus_per_node)\
                                    if zero_plus_plus else [ZeroCommOptions()]:
                                layouts.append(Layout(t, p, dp, stage, recompute, micro, offload,
                                                      sequence_parallel=t > 1,
                                                      layers_per_stage=layers_per_stage
                                                      if layers_per_stage and p == len(layers_per_stage) else None,
                                                      zero=options))
    return layouts


def plan(config: GPTConfig, world_size: int, gpus_per_node: int, memory_per_device: float,
         global_batch_size: int,
         compute_bytes: int = 2, zero_stage: int | None = None, tp: int | None = None, pp: int | None = None,
         bucket_size: int = 20_000_000, persistence_threshold: int = 100_000,
         grad_bytes: int | None = None, layers_per_stage: tuple[int, ...] | None = None,
         links: Links | None = None, device: Device = Device()) -> list[Plan]:
    """The layouts that fit ``memory_per_device``, best first (with ``links``: by predicted step time,
    ZeRO++ and shard groups among the candidates)."""
    plans = [plan_layout(config, layout, global_batch_size, compute_bytes, bucket_size, persistence_threshold,
                         grad_bytes, gpus_per_node, links, device)
             for layout in candidate_layouts(config, world_size, gpus_per_node,
                                             global_batch_size, zero_stage, tp, pp,
                                             layers_per_stage, zero_plus_plus=links is not None)]
    fitting = [p for p in plans if p.total_bytes <= memory_per_device]
    return sorted(fitting, key=lambda p: (p.score, sum(p.comm_bytes_inter_node.values()), p.total_bytes))


def zero_advice(plans: list[Plan]) -> str | None:
    """Which ZeRO stage and ZeRO++ options the link model prefers, among layouts that fit (ranked by
    predicted step time): whether ZeRO-2 beats ZeRO-3, and what to turn on at stage 3."""
    two, three = (next((p for p in plans if p.layout.zero_stage == stage), None) for stage in (2, 3))
    plain3 = next((p for p in plans if p.layout.zero_stage == 3 and p.layout.zero == ZeroCommOptions()), None)
    if two is None or three is None:
        return None
    options = f" with {three.layout.zero.label()}" if three.layout.zero != ZeroCommOptions() else ""
    versus = f", plain ZeRO-3 {plain3.step_seconds:.3f} s" if plain3 is not None and plain3 is not three else ""
    if two.step_seconds < three.step_seconds:
        return (f"on these links ZeRO-2 beats ZeRO-3: {two.step_seconds:.3f} s a step "
                f"({two.layout.zero.label()}) "
                f"against {three.step_seconds:.3f} s for the best ZeRO-3{options}{versus}")
    return (f"on these links ZeRO-3{options} is fastest: {three.step_seconds:.3f} s a step against "
            f"{two.step_seconds:.3f} s for the best ZeRO-2{versus}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--memory-per-device", default="80GiB", help="e.g. 80GiB, 40GB")
    parser.add_argument("--top", type=int, default=10, help="layouts to print")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--inter-node-bandwidth", help="a node's link to the others, e.g. 400Gbit, 50GB/s: "
                        "rank layouts by predicted step time (launch.tools.link_model), ZeRO++ and shard "
                        "groups included")
    parser.add_argument("--intra-node-bandwidth", default="200GB/s", help="between two ranks of a node")
    parser.add_argument("--link-latency", type=float, default=10e-6, help="seconds per message step")
    parser.add_argument("--device-flops", type=float, default=Device.flops,
                        help="model FLOP/s one device sustains (e.g. 40%% of a bf16 peak)")
    parser.add_argument("--quantize-rate", type=float, default=Device.quantize_rate,
                        help="elements a device quantizes or dequantizes per second (ZeRO++'s passes)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                        help="collective backend: how much communication hides behind compute")
    args, model_flags = parser.parse_known_args(argv)
    try:
        config = parse_config(model_flags)
    except ConfigError as error:
        sys.exit(f"error: {error}")
    if config.model.vocab_size is None:
        config.model.vocab_size = config.data.default_corpus_vocab_size
    train, zero = config.training, config.zero
    parallel = config.parallel
    fixed = {"zero_stage": zero.zero_stage if "--zero-stage" in model_flags else None,
             "tp": parallel.tensor_model_parallel_size if "--tensor-model-parallel-size" in model_flags else None,
             "pp": parallel.pipeline_model_parallel_size if "--pipeline-model-parallel-size" in model_flags else None}
    compute_bytes = 2 if train.bf16 or train.fp16 else 4
    links = Links(parse_bandwidth(args.intra_node_bandwidth), parse_bandwidth(args.inter_node_bandwidth),
                  args.link_latency) if args.inter_node_bandwidth else None
    plans = plan(config.model, args.world_size, args.gpus_per_node, parse_bytes(args.memory_per_device),
                 train.global_batch_size, compute_bytes, **fixed, bucket_size=zero.zero_bucket_size,
                 persistence_threshold=zero.zero_persistence_threshold,
                 grad_bytes=gradient_bytes(compute_bytes, not zero.grad_reduce_in_bf16),
                 layers_per_stage=tuple(parallel.pipeline_layers_per_stage or ()) or None, links=links,
                 device=Device(args.device_flops, args.quantize_rate, args.backend))
    advice = zero_advice(plans) if links is not None else None
    plans = plans[:args.top]
    if args.json:
        print(json.dumps([{**asdict(p.layout), "model_state_bytes": p.model_state_bytes,
                           "activation_bytes": p.activation_bytes, "buffer_bytes": p.buffer_bytes,
                           "total_bytes": p.total_bytes, "comm_bytes_per_step": p.comm_bytes,
                           "comm_bytes_inter_node_per_step": p.comm_bytes_inter_node, "score": p.score,
                           "step_seconds": p.step_seconds} for p in plans], indent=1))
        return
    params = num_parameters(config.model)
    print(f"GPT of {params / 1e9:.2f}B parameters on {args.world_size} devices ({args.gpus_per_node} "
          "per node, "
          f"{args.memory_per_device} each): {len(plans)} best layouts that fit")
    print(f"{'tp':>3} {'pp':>3} {'dp':>4} {'zero':>4} {'recompute':>9} {'mbs':>3} {'offload':>7} | "
          f"{'states GiB':>10} {'activ GiB':>9} {'buffers GiB':>11} {'total GiB':>9} | comm GiB/step dp / "
          "tp / pp "
          "(to another node)" + (" | ZeRO++ / MiCS | step s" if links else ""))
    for p in plans:
        layout, gib = p.layout, 2**30
        print(f"{layout.tp:>3} {layout.pp:>3} {layout.dp:>4} {layout.zero_stage:>4} "
              f"{str(layout.recompute):>9} "
              f"{layout.micro_batch_size:>3} {layout.offload_optimizer:>7} | "
              f"{p.model_state_bytes / gib:>10.2f} "
              f"{p.activation_bytes / gib:>9.2f} {p.buffer_bytes / gib:>11.2f} {p.total_bytes / gib:>9.2f} | "
              + " / ".join(f"{p.comm_bytes[axis] / gib:.2f} ({p.comm_bytes_inter_node[axis] / gib:.2f})"
                           for axis in ("dp", "tp", "pp"))
              + (f" | {layout.zero.label():>14} | {p.step_seconds:.3f}" if links else ""))
    if advice:
        print(advice)
    if not plans:
        print("nothing fits: add devices, or allow more memory per device")


if __name__ == "__main__":
    main()
