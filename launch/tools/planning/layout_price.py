"""What one layout of a GPT costs on its most loaded device: model-state and buffer bytes, and the
transfers of a step (``link_model``), as ``plan`` ranks them (all in ``launch.tools.planning``; the
activations are ``activation_price``'s). Nothing here searches layouts or prints."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from launch.tools.planning.activation_price import layer_elements
from launch.tools.planning.layer_parts import SUBLAYERS
from launch.tools.planning.layout import Layout
from launch.tools.planning.link_model import Transfer, all_to_all, ring, zero_transfers
from launch.tools.planning.muon_price import moments, muon_transfers, named_parameters, workspace_bytes
from models.config import GPTConfig
from models.counting import frozen_config, stage_model, stage_parameters, thawed_config
from parallel.param_meta import meta
from parallel.topology import Topology
from parallel.zero import gradient_bytes, optimizer_state_bytes
from parallel.zero.memory import expected_profile_state_bytes, parameter_profile
from parallel.zero.grad_sync import bucket_size_for


def _stage_parameters(config: GPTConfig, layout: Layout, stage: int) -> tuple:
    """The parameters of pipeline ``stage``'s tp slice, as ``models.pipeline_stage`` builds them (on meta)."""
    return stage_parameters(config, layout.tp, layout.pp, stage, layout.sequence_parallel,
                            list(layout.split) if layout.split else None, (layout.ep, layout.expert_tp),
                            layout.v, layout.chunks)


@dataclass(frozen=True)
class StageCount:
    """What a stage's tp slice holds, as the pricing reads it: ``parameter_profile`` of its dense and of its
    expert parameters, and their elements."""

    dense: tuple
    expert: tuple
    dense_elements: int
    expert_elements: int


_COUNTS: dict[tuple, StageCount] = {}


def stage_count(config: GPTConfig, layout: Layout, stage: int) -> StageCount:
    """``StageCount`` of ``stage``, kept per model and stage shape (a search prices a shape many times)."""
    key = (frozen_config(config), layout.tp, layout.pp, stage, layout.sequence_parallel, layout.split,
           layout.ep, layout.expert_tp, layout.v, layout.chunks, layout.optimizer)
    if key not in _COUNTS:
        if layout.optimizer == "adam":
            params, states = _stage_parameters(config, layout, stage), (lambda param: 2)
        else:  # which parameters Muon steps follows from their names
            named = named_parameters(config, layout, stage)
            params, states = [param for _, param in named], moments(layout, named)
        dense = [p for p in params if not meta(p).expert]
        expert = [p for p in params if meta(p).expert]
        if len(_COUNTS) > 4096:
            _COUNTS.clear()
        _COUNTS[key] = StageCount(parameter_profile(dense, states), parameter_profile(expert, states),
                                  sum(p.numel() for p in dense), sum(p.numel() for p in expert))
    return _COUNTS[key]


def distinct_stages(config: GPTConfig, layout: Layout) -> list[int]:
    """One stage of each different ``StageCount`` (middle stages of an even cut hold the same), counted for
    the first stage of each shape alone: its chunks' layers' registry entries (what a layer holds follows
    from its entry and the model) and which chunks hold the embedding and the loss."""
    key = (frozen_config(config), layout.tp, layout.pp, layout.sequence_parallel, layout.split, layout.ep,
           layout.expert_tp, layout.v, layout.chunks, layout.optimizer)
    if key not in _DISTINCT:
        entries, shapes = config.layer_types(), {}
        for stage in range(layout.pp):
            chunks = enumerate(layout.chunk_layers(stage, config.num_layers))
            shapes.setdefault(tuple((tuple(entries[i] for i in layers), layout.holds(stage, chunk))
                                    for chunk, layers in chunks), stage)
        seen: dict[StageCount, int] = {}
        for stage in shapes.values():
            seen.setdefault(stage_count(config, layout, stage), stage)
        _DISTINCT[key] = list(seen.values())
    return _DISTINCT[key]


_DISTINCT: dict[tuple, list[int]] = {}


def model_state_bytes(config: GPTConfig, layout: Layout, stage: int, compute_bytes: int,
                      persistence_threshold: int = 100_000, grad_bytes: int | None = None) -> float:
    """What ``parallel.zero`` holds on a rank of ``stage`` (offloaded optimizer states excluded): the dense
    parameters' states sharded over dp x cp, the experts' over expert dp."""
    count, total = stage_count(config, layout, stage), 0.0
    shards = ((count.dense, layout.zero.shard_size or layout.data_ranks),
              (count.expert, layout.expert_data_ranks))
    for profile, shard in shards:
        total += expected_profile_state_bytes(profile, layout.zero_stage, shard, compute_bytes,
                                              persistence_threshold, grad_bytes, layout.zero.hpz)
        if layout.offload_optimizer != "none":  # the fp32 masters and moments live elsewhere
            total -= sum(numel * count * optimizer_state_bytes(compute_bytes, moments)
                         for numel, _, moments, count in profile) / (shard if layout.zero_stage else 1)
    return total


def fullest_state_bytes(config: GPTConfig, layout: Layout, compute_bytes: int,
                        persistence_threshold: int = 100_000, grad_bytes: int | None = None) -> float:
    """The most ``model_state_bytes`` of any stage, kept per model and what of the layout it depends on
    (its stages' shapes, sharding and offload): a search prices each many times."""
    key = (frozen_config(config), compute_bytes, persistence_threshold, grad_bytes, layout.tp, layout.pp,
           layout.dp, layout.cp, layout.sequence_parallel, layout.split, layout.ep, layout.etp,
           layout.schedule, layout.vp, layout.optimizer, layout.zero_stage, layout.zero.hpz,
           layout.zero.shard_size, layout.offload_optimizer)
    if key not in _STATES:
        if len(_STATES) > 65536:
            _STATES.clear()
        _STATES[key] = max(model_state_bytes(config, layout, stage, compute_bytes, persistence_threshold,
                                             grad_bytes)
                           for stage in distinct_stages(config, layout))
    return _STATES[key]


_STATES: dict[tuple, float] = {}


def recompute_cost(config: GPTConfig, layout: Layout) -> float:
    """A step's compute with the layout's recompute over one without: full redoes the forward (a third of
    the step), selective's ``mlp`` the MLP's share of it (its weights' share of a block's)."""
    if layout.recompute == "full":
        return 4 / 3
    if layout.recompute != "selective" or "mlp" not in layout.recompute_modules:
        return 1.0
    h, f = config.hidden_size, config.ffn_size
    mlp = (3 if config.gated else 2) * h * f
    attention = h * config.attention_projection_rows + config.num_attention_heads * config.head_dim * h
    return 1 + mlp / (mlp + attention) / 3


def buffer_bytes(config: GPTConfig, layout: Layout, compute_bytes: int, bucket_size: int,
                 grad_bytes: int | None = None) -> float:
    """ZeRO-R staging (in the gradient dtype): two bucket slots at stage 2 (the bucket capped as the gradient
    sync caps it), two block slots at stage 3, which also gathers a block; full recompute rebuilds one
    layer's activations in backward; Muon's owners gather their matrices whole (``muon_price``)."""
    grad_bytes = gradient_bytes(compute_bytes) if grad_bytes is None else grad_bytes
    block, params = _block_and_stage(config, layout)
    slot = bucket_size_for(bucket_size, params, layout.data_ranks, 2) if layout.zero_stage == 2 else block
    staging = 2 * slot * grad_bytes if layout.zero_stage >= 2 else 0
    gathers = 3 * block * compute_bytes if layout.zero_stage == 3 else 0
    recompute = layer_elements(config, layout) * compute_bytes if layout.recompute == "full" else 0
    return staging + gathers + recompute + workspace_bytes(config, layout, 0)


def _block_and_stage(config: GPTConfig, layout: Layout) -> tuple[int, int]:
    """(the largest layer's dense parameters, the first pipeline stage's) on one tp rank (the dense
    optimizer's units; the experts are the expert optimizer's)."""
    layers, stage = _layers_and_stage(config, layout)
    return max(layers), stage


def _layers_and_stage(config: GPTConfig, layout: Layout) -> tuple[tuple[int, ...], int]:
    """(each layer's dense parameters, the first pipeline stage's) on one tp rank."""
    return _layers_and_stage_of(frozen_config(config), layout.tp, layout.pp, layout.sequence_parallel,
                                (layout.ep, layout.expert_tp), layout.split, layout.v, layout.chunks)


@functools.lru_cache(maxsize=1024)
def _layers_and_stage_of(frozen: tuple, tp: int, pp: int, sequence_parallel: bool,
                         experts: tuple[int, int], split: tuple[int, ...] | None, v: bool,
                         chunks: int) -> tuple[tuple[int, ...], int]:
    config = thawed_config(frozen)
    one = stage_model(config, tp, 1, 0, sequence_parallel=sequence_parallel, experts=experts)
    layers = tuple(sum(p.numel() for p in layer.parameters() if not meta(p).expert)
                   for layer in one[0].layers)
    first = stage_parameters(config, tp, pp, 0, sequence_parallel, list(split) if split else None, experts, v,
                             chunks)
    return layers, sum(p.numel() for p in first if not meta(p).expert)


def reused_elements(config: GPTConfig, layout: Layout, stage: int = 0) -> int:
    """Stage 3: the parameters of pipeline ``stage`` that stay gathered from the end of a micro-batch's
    forward to its backward (``parallel.zero.sharded_parameters`` keeps what its prefetcher would gather
    right back, within the default budget, ``parameter_unit.default_prefetch_budget``: the enclosing unit and
    two layers): the stage's own unit (embedding, head) and its last two layers."""
    per_layer = _layers_and_stage(config, layout)[0]
    held = [per_layer[index] for index in layout.stage_layers(stage, config.num_layers)]
    return stage_count(config, layout, stage).dense_elements - sum(held) + sum(held[-2:])


def stage_transfers(config: GPTConfig, layout: Layout, micro_batches: int, compute_bytes: int,
                    grad_bytes: int | None = None, gpus_per_node: int | None = None, backend: str = "nccl",
                    bucket_size: int | None = None) -> dict[int, tuple[Transfer, ...]]:
    """``transfers`` of one stage of each different ``StageCount`` (``distinct_stages``), kept per model and
    what of the layout they depend on (not its offload, nor what selective recompute redoes): a search
    prices each many times."""
    key = (frozen_config(config), micro_batches, compute_bytes, grad_bytes, gpus_per_node, backend,
           bucket_size, replace(layout, offload_optimizer="none", recompute_modules=(),
                                recompute="full" if layout.recompute == "full" else None))
    if key not in _SENT:
        if len(_SENT) > 65536:
            _SENT.clear()
        _SENT[key] = {stage: tuple(transfers(config, layout, micro_batches, compute_bytes, grad_bytes,
                                             gpus_per_node, backend, bucket_size, stage))
                      for stage in distinct_stages(config, layout)}
    return _SENT[key]


_SENT: dict[tuple, dict[int, tuple[Transfer, ...]]] = {}


def transfers(config: GPTConfig, layout: Layout, micro_batches: int, compute_bytes: int,
              grad_bytes: int | None = None, gpus_per_node: int | None = None, backend: str = "nccl",
              bucket_size: int | None = None, stage: int = 0) -> list[Transfer]:
    """What one rank of pipeline ``stage`` sends per step, collective by collective (ring model, as
    parallel.comm counts them): ZeRO's data-parallel transfers (``link_model.zero_transfers``: stage 0
    all-reduces the gradients once, stage 1 reduce-scatters once, stages 2-3 every micro-batch; stages 1-2
    all-gather the parameters once after the step, stage 3 in forward and in backward of every
    micro-batch, less in backward what stays gathered from the end of forward (``reused_elements``);
    ZeRO++ and shard groups change which groups and how many bytes), tensor parallelism's four all-reduces
    (or their sequence-parallel halves) of each layer's activations in forward and backward, the
    pipeline's activation and gradient sends (those two exposed: each is waited where it starts), Muon's
    exchange of matrix pieces with their owners (``muon_price.muon_transfers``). The
    data-parallel ones hide behind the passes as they do on ``backend``, a layer (stage 3) or a bucket of
    ``bucket_size`` elements (stages 0-2) a piece."""
    grad_bytes = gradient_bytes(compute_bytes) if grad_bytes is None else grad_bytes
    count = stage_count(config, layout, stage)
    psi, experts = count.dense_elements, count.expert_elements
    topology = layout.topology(gpus_per_node)
    t, m = layout.tp, micro_batches
    sbh = config.seq_length / layout.cp * layout.micro_batch_size * config.hidden_size * compute_bytes
    indices = layout.stage_layers(stage, config.num_layers)
    layers = len(indices)
    recompute = 1.5 if layout.recompute == "full" else 1.0  # the recomputed forward all-reduces again
    found = zero_transfers(topology, psi, layout.zero_stage, m, compute_bytes, grad_bytes,
                           layout.zero, gpus_per_node, backend, layers, bucket_size,
                           reused_elements(config, layout, stage) if layout.zero_stage == 3 else 0)
    if experts:  # the expert optimizer's, over expert dp; the tokens' trips to their experts and back
        found += zero_transfers(topology, experts, layout.zero_stage, m, compute_bytes, grad_bytes,
                                node_size=gpus_per_node, backend=backend, pieces=layers,
                                bucket_size=bucket_size, axis="edp")
        moe = sum(config.moe_layers(config.num_layers)[index] for index in indices)
        found.append(dispatch_transfer(config, layout, topology, compute_bytes, gpus_per_node, moe * m,
                                       recompute))
    entries = config.layer_types()
    parts = [part for index in indices for part in SUBLAYERS[entries[index]]]
    found.append(ring("all_reduce", "tp", topology.group_tuples("tp"), gpus_per_node,
                      2 * (t - 1) / t * sbh * recompute, 2 * len(parts) * m))  # each sublayer's, both ways
    forwards = 2 if layout.recompute == "full" else 1
    if layout.cp > 1 and "attention" in parts:  # ring attention's key/value blocks (and their gradients)
        forward, backward = context_bytes(config, layout, compute_bytes)
        found.append(ring("p2p", "cp", topology.group_tuples("cp"), gpus_per_node,
                          (forward * forwards + backward) * parts.count("attention") * m))
    for part, exchange in HEAD_EXCHANGES.items():  # Mamba's and gated delta nets' to head shards and back
        if layout.cp > 1 and part in parts:
            moved = exchange(config, layout, compute_bytes)
            found.append(ring("all_to_all", "cp", topology.group_tuples("cp"), gpus_per_node,
                              moved * (forwards + 1) * parts.count(part) * m))
    if layout.pp > 1:  # forward activations and backward gradients: a line, not a ring
        lines = topology.group_tuples("pp")
        crosses = gpus_per_node is not None and any(a // gpus_per_node != b // gpus_per_node
                                                    for g in lines for a, b in zip(g, g[1:]))
        found.append(Transfer("p2p", "pp", 2 * sbh * m, 2 * sbh * m if crosses else 0.0, 2 * m))
    return found + muon_transfers(config, layout, topology, gpus_per_node, stage)


def dispatch_transfer(config: GPTConfig, layout: Layout, topology: Topology, compute_bytes: int,
                      gpus_per_node: int | None, count: int, recompute: float = 1.0) -> Transfer:
    """What one rank sends over the etp x ep group for ``count`` MoE layer passes (a layer's forward and
    backward of one micro-batch each; ``recompute`` 1.5 where full recompute runs the forward again), the
    routing spread evenly (``parallel.experts.dispatch``): alltoall, each
    of its T tokens' k rows to the etp ranks of its expert's ep rank, 1 / ep of them its own, and the
    outputs back, both again in backward, 4 T k (etp ep - 1) / ep rows; allgather, (G - 1) T rows each way
    and pass with the routing weights (fp32) and choices (bytes): exposed, the layer waits for it."""
    group = layout.expert_tp * layout.ep
    tokens = config.seq_length / layout.cp * layout.micro_batch_size / (layout.tp if layout.sequence_parallel
                                                                        else 1)
    row, experts = config.hidden_size * compute_bytes, config.num_experts
    if layout.dispatcher == "alltoall":
        sent = 4 * tokens * config.moe_router_topk * (group - 1) / layout.ep * row \
            + (group - 1) * experts / layout.ep * 8
    else:
        sent = (group - 1) * tokens * (4 * row + 2 * experts * 4 + experts)
    return all_to_all("ep", topology.group_tuples("etp-ep"), gpus_per_node,
                      sent * recompute * group / max(group - 1, 1), count)


def context_bytes(config: GPTConfig, layout: Layout, compute_bytes: int,
                  comm_type: str = "p2p") -> tuple[float, float]:
    """Bytes one rank sends over the cp group for one layer and micro-batch, (forward, backward), as
    ``parallel.context`` sends them (KV: this rank's keys and values, 2 b (S/cp) (G/t) d elements):
    p2p passes cp - 1 blocks on in forward, cp - 1 again in backward and the fp32 dK/dV accumulators cp
    times; a2a sends (cp - 1)/cp of q, k, v and the output each way; allgather gathers K/V in forward, and
    in backward gathers them again (it keeps only its own) and reduce-scatters their fp32 gradients,
    (cp - 1) KV each."""
    n = layout.cp
    tokens = config.seq_length / n * layout.micro_batch_size
    heads, groups = config.num_attention_heads / layout.tp, config.query_groups / layout.tp
    kv = 2 * tokens * groups * config.head_dim
    if comm_type == "p2p":
        return (n - 1) * kv * compute_bytes, ((n - 1) * kv * compute_bytes + n * kv * 4)
    if comm_type == "a2a":
        moved = tokens * (2 * heads + 2 * groups) * config.head_dim * compute_bytes * (n - 1) / n
        return moved, moved
    return (n - 1) * kv * compute_bytes, (n - 1) * kv * (compute_bytes + 4)


def mamba_exchange_bytes(config: GPTConfig, layout: Layout, compute_bytes: int) -> float:
    """Bytes one rank sends over the cp group for one Mamba-2 layer's forward (its backward the same), as
    ``models.mamba.mixer`` sends them: (cp - 1) / cp of its tokens' x, B, C (repeated to each cp rank that
    takes a share of a group's heads) and dt to their head shards, then of y back."""
    n, t = layout.cp, layout.tp
    tokens = config.seq_length / n * layout.micro_batch_size
    groups = config.mamba_num_groups / t
    copies = max(1.0, n / groups)
    per_token = (2 * config.mamba_inner / t + 2 * groups * config.mamba_state_dim * copies
                 + config.mamba_heads / t)
    return tokens * per_token * compute_bytes * (n - 1) / n


def gated_delta_exchange_bytes(config: GPTConfig, layout: Layout, compute_bytes: int) -> float:
    """Bytes one rank sends over the cp group for one gated delta net's forward (its backward the same), as
    ``models.gdn.mixer`` sends them: (cp - 1) / cp of its tokens' q, k, v, b and a to their head shards,
    then of the output back."""
    n, t = layout.cp, layout.tp
    tokens = config.seq_length / n * layout.micro_batch_size
    per_token = (config.gdn_conv_channels + 2 * config.linear_num_value_heads + config.gdn_value_width) / t
    return tokens * per_token * compute_bytes * (n - 1) / n


def kimi_delta_exchange_bytes(config: GPTConfig, layout: Layout, compute_bytes: int) -> float:
    """Bytes one rank sends over the cp group for one Kimi delta attention's forward (its backward the
    same), as ``models.kda.mixer`` sends them: (cp - 1) / cp of its tokens' q, k, v, b and the decay's
    input to their head shards, then of the output back."""
    n, t = layout.cp, layout.tp
    tokens = config.seq_length / n * layout.micro_batch_size
    per_token = (config.kda_exchanged_width + config.gdn_value_width) / t
    return tokens * per_token * compute_bytes * (n - 1) / n


HEAD_EXCHANGES = {"mamba": mamba_exchange_bytes, "gdn": gated_delta_exchange_bytes,
                  "kda": kimi_delta_exchange_bytes}


def sent_by_axis(found: list[Transfer], crossing: bool = False) -> dict[str, float]:
    """Bytes a rank sends per step on each axis (dp: every data-parallel group, hpZ's, shard groups and
    the expert data-parallel groups included; ep: the MoE tokens' dispatch, where a layout has experts);
    with ``crossing``, those of the transfers that leave a node (on a rank whose ring
    neighbour is on another node: the most loaded)."""
    sent = {"dp": 0.0, "tp": 0.0, "pp": 0.0, "cp": 0.0}
    for transfer in found:
        if not crossing or transfer.leaving_node > 0:
            axis = transfer.axis if transfer.axis in sent or transfer.axis == "ep" else "dp"
            sent[axis] = sent.get(axis, 0.0) + transfer.per_rank * transfer.count
    return sent
