"""Memory planner: which layouts of a GPT fit a cluster, best first, with bytes per device.

    python -m launch.plan [model flags as for pretrain] --world-size 64 --gpus-per-node 8 \\
        --memory-per-device 80GiB [--zero-stage S] [--tensor-model-parallel-size T] \\
        [--pipeline-model-parallel-size P] [--context-parallel-size C] [--json]

For every layout (tp, pp, cp, dp, ZeRO stage, recompute, micro-batch size, optimizer offload) it predicts,
for the most loaded device (the fullest pipeline stage for activations and for model states, the one that
sends most for communication):

- model states: the parameters of that rank's slice, from the model itself (built on the meta device
  as training builds it), kept whole or sharded as ``parallel.zero`` keeps them (stage 3 keeps
  parameters up to the persistence threshold, and those whose gradients a model-parallel reduction
  needs, whole), priced by ``zero.expected_parameter_state_bytes`` with each parameter's optimizer states
  (--optimizer: Adam's two moments; Muon's one momentum on the layers' matrices, SGD's one);
- activations: saved bytes per micro-batch by our layer's accounting (``layer_elements``: Korthikanti
  et al.'s for a fused attention that keeps no s^2 matrix, following the architecture: sbh(4 + 12/t)
  elements per GPT-3 layer, 16 sbh/t with sequence parallelism; sbh (or sbh/t) with full recompute of
  each layer, i.e. --recompute-num-layers 1), times
  the micro-batches the pipeline schedule keeps alive (and, for a zero-bubble schedule, what the weight
  passes it defers keep: ``schedule_price``), plus the loss stage's logits and loss; with full recompute
  also
  the transient of rebuilding one layer in backward; a context-parallel rank keeps those of its S / cp
  tokens (cp is tried for every divisor that cuts the sequence into 2 x cp chunks);
- gradients are fp32 main gradients for 16-bit parameters (4 bytes each, staging and reductions
  included), unless --grad-reduce-in-bf16 keeps them in bf16;
- buffers: the ZeRO-R staging arenas (two buckets per dtype from stage 2) and stage-3 gathers; under Muon
  the owners' whole matrices and the iteration's temporaries (``muon_price``), whose Newton-Schulz FLOPs
  join the step time (they are not in the model's FLOPs, nor in MFU) and whose exchange joins the bytes;
- communication per step and axis by the ring model of ``parallel.comm``, and the part that crosses
  nodes of ``--gpus-per-node`` ranks, on a rank of each stage (shown: the stage that sends most; the link
  model's step time is the slowest stage's); cp's ring attention blocks as ``layout_price.context_bytes``
  counts them (exposed in the link model: how much of them hides behind attention is not modelled).

A layout over ``--memory-per-device`` is dropped before its time is priced.

Layouts that fit are ranked by a step-time proxy: recompute cost x offload cost / (1 - pipeline bubble),
the bubble of the layout's schedule (1F1B, ZB-H1 or ZBV) laid out with its layers' costs
(``schedule_price``), then the bytes sent to another node (``parallel.comm``'s ring model over the layout's
groups).
``--json`` prints the list as JSON. The command line is ``launch.tools.planning.plan_command``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from models.config import GPTConfig
from parallel.topology import Topology
from launch.tools.planning.link_model import (Device, Links, Transfer, ZeroCommOptions, step_seconds,
                                              zero_variants)
from launch.tools.planning.devices import DeviceProfile, compute_seconds
from models.counting import flops_per_token, forward_flops_parts, frozen_config, num_parameters, thawed_config
from launch.tools.planning.activation_price import stage_activation_bytes
from launch.tools.planning.layout import Layout
from launch.tools.planning.muon_price import newton_schulz_flops
from launch.tools.planning.layout_price import (buffer_bytes, fullest_state_bytes, recompute_cost,
                                                sent_by_axis, stage_transfers)
from launch.tools.planning.schedule_price import pipeline_time, stage_costs
from parallel.pipeline.layer_split import SplitRequest, first_last_counts, per_rank_split
from parallel.pipeline.partition import validate_partition
from parallel.pipeline.schedules import V_SCHEDULES, validate_schedule

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
    bubble: float = 0.0  # the fraction of a step the busiest stage waits (``schedule_price``)
    imbalance: float = 1.0  # the busiest stage's work over a stage's mean (an uneven cut, the head)
    comm_stage: int = 0  # the pipeline stage whose rank's transfers are shown: the one sending the most
    transfers: list[Transfer] = field(default_factory=list, repr=False)  # comm_stage's (the link model's)
    step_seconds: float | None = None  # predicted by the link model (``links`` given)

    @property
    def total_bytes(self) -> float:
        return self.model_state_bytes + self.activation_bytes + self.buffer_bytes


def plan_layout(config: GPTConfig, layout: Layout, global_batch_size: int, compute_bytes: int,
                bucket_size: int = 20_000_000, persistence_threshold: int = 100_000,
                grad_bytes: int | None = None, gpus_per_node: int | None = None, links: Links | None = None,
                device: Device = Device(), memory_per_device: float = math.inf) -> Plan:
    """What ``layout`` costs; with ``links``, its step time by the link model's overlap model: the compute
    (the model's FLOPs per token at the ``device``'s FLOP/s, over the pipeline bubble and recompute; a
    third of it forward, a quarter with full recompute; ZeRO++'s quantize passes at its quantize rate)
    with the communication that hides behind it on its backend, on the slowest stage. A layout whose bytes
    exceed ``memory_per_device`` is priced no further: its plan holds its bytes alone (a search drops it)."""
    micro_batches = global_batch_size // (layout.micro_batch_size * layout.dp)
    states = fullest_state_bytes(config, layout, compute_bytes, persistence_threshold, grad_bytes)
    plan = Plan(layout, states, max(stage_activation_bytes(config, layout, micro_batches, compute_bytes)),
                buffer_bytes(config, layout, compute_bytes, bucket_size, grad_bytes))
    if plan.total_bytes > memory_per_device:
        return plan
    sent = stage_transfers(config, layout, micro_batches, compute_bytes, grad_bytes, gpus_per_node,
                           device.backend, bucket_size)
    plan.comm_stage = max(sent, key=lambda stage: sum(t.per_rank * t.count for t in sent[stage]))
    found = plan.transfers = list(sent[plan.comm_stage])
    plan.comm_bytes, plan.comm_bytes_inter_node = sent_by_axis(found), sent_by_axis(found, crossing=True)
    bubble, imbalance = pipeline_time(layout.schedule, layout.pp, micro_batches,
                                      stage_costs(config, layout.recompute, layout.pp, layout.chunks,
                                                  layout.split))
    plan.bubble, plan.imbalance = bubble, imbalance
    offload_cost = {"none": 1.0, "cpu": 1.3}[layout.offload_optimizer]
    plan.score = recompute_cost(config, layout) * offload_cost * imbalance / (1 - bubble)
    if links is not None:
        if device.profile is not None:  # the achieved rates of the layout's shapes, recompute included
            compute = _profiled_compute(config, layout, micro_batches, device.profile) * offload_cost \
                / (1 - bubble)
        else:
            world = layout.tp * layout.pp * layout.dp * layout.cp
            compute = flops_per_token(config) * global_batch_size * config.seq_length / world / device.flops \
                * plan.score
        forward_share = 1 / 4 if layout.recompute == "full" else 1 / 3
        plan.step_seconds = max(  # the slowest stage's, each with its own transfers and Muon's FLOPs
            step_seconds(each, links, compute + newton_schulz_flops(config, layout, stage) / device.flops,
                         micro_batches, device.quantize_rate, forward_share)
            for stage, each in sent.items())
        plan.score = plan.step_seconds
    return plan


def _profiled_compute(config: GPTConfig, layout: Layout, micro_batches: int, profile: DeviceProfile) -> float:
    """The busiest pipeline stage's compute in a step at ``profile``'s rates (``devices.compute_seconds``),
    kept per model and what of the layout it depends on (a search prices each many times)."""
    shard = layout.data_ranks if layout.zero_stage >= 1 else 1
    key = (frozen_config(config), layout.tp, layout.cp, layout.micro_batch_size, layout.pp, layout.chunks,
           layout.split, layout.v, micro_batches, layout.recompute, layout.recompute_modules, shard, profile)
    if key not in _COMPUTE:
        if len(_COMPUTE) > 65536:
            _COMPUTE.clear()
        parameters = num_parameters(config) / (layout.tp * layout.pp * shard)
        entries = config.layer_types()
        kinds = {(tuple(sorted(entries[i] for i in layout.stage_layers(stage, config.num_layers))),
                  any(layout.holds(stage, chunk)[1] for chunk in range(layout.chunks)))
                 for stage in range(layout.pp)}  # stages that differ: their layers, the head
        _COMPUTE[key] = max(compute_seconds(config, layout.tp, layout.cp, layout.micro_batch_size, held,
                                            micro_batches, layout.recompute, layout.recompute_modules, last,
                                            parameters, profile)
                            for held, last in kinds)
    return _COMPUTE[key]


_COMPUTE: dict[tuple, float] = {}


def _context_sizes(config: GPTConfig, model_parallel: int, world_size: int, cp: int | None) -> list[int]:
    """The cp sizes worth trying: those that cut the sequence into 2 x cp chunks and fit the world."""
    if cp:
        return [cp]
    sizes, size = [], 1
    while world_size % (model_parallel * size) == 0 and config.seq_length % (2 * size) == 0:
        sizes.append(size)
        size *= 2
    return sizes or [1]


def candidate_layouts(config: GPTConfig, world_size: int, gpus_per_node: int, global_batch_size: int | None,
                      zero_stage: int | None, tp: int | None, pp: int | None,
                      request: SplitRequest = SplitRequest(),
                      zero_plus_plus: bool = False, cp: int | None = None,
                      micro_batch_size: int = 1, ep: int | None = None,
                      etp: int | None = None, schedule: str | None = None,
                      vp: int | None = None, optimizer: str = "adam") -> list[Layout]:
    """Every layout of the world worth comparing; with ``zero_plus_plus`` (a link model decides) also
    ZeRO-2 with quantized gradients and ZeRO-3 with hpZ, qwZ, qgZ or shard groups of a node's dp ranks.
    Without ``global_batch_size`` each layout's is Megatron's default, ``micro_batch_size`` x dp. With
    experts, every expert-parallel size that divides the experts and the expert grid (etp: tp unless
    given) and no ZeRO++ (the expert optimizer has none). A pipeline runs each schedule it can, or
    ``schedule``, with the layers cut as ``request`` says, or evenly and as ``balanced_split`` proposes
    (``_splits``). ValueError (one line) where the flags given leave no layout."""
    layouts, refusals = [], []
    for t in ([tp] if tp else [d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0]):
        try:
            config.validate(t)
        except ValueError:  # tp must divide the heads, groups and widths
            continue
        for p in ([pp] if pp else range(1, config.num_layers + 1)):
            if world_size % (t * p):
                continue
            cuts = _splits(config, p, request, schedule, vp, strict=pp is not None, refusals=refusals)
            if not cuts:
                continue
            for c in _context_sizes(config, t * p, world_size, cp):
                try:
                    config.validate_sequence_layers(t, c)
                except ValueError:  # a Mamba-2 mixer's heads and groups over tp x cp
                    continue
                d = world_size // (t * p * c)
                for e in _expert_sizes(config, t * c * d, etp or t, ep):
                    grid = Layout(t, p, d, 0, sequence_parallel=t > 1, cp=c, ep=e,
                                  etp=etp if config.num_experts else None, optimizer=optimizer)
                    layouts += _layouts_of(grid, cuts, gpus_per_node, global_batch_size, zero_stage,
                                           zero_plus_plus and not config.num_experts, micro_batch_size,
                                           refusals)
    if not layouts and refusals:
        raise ValueError(f"no layout of {world_size} devices runs as asked: at the last tried, "
                         f"{refusals[-1]}")
    return layouts


def _runs(schedule: str, micro_batches: int, pp: int, chunks: int, refusals: list[str]) -> bool:
    """Whether ``schedule`` runs ``micro_batches`` a step (pretrain refuses the others; why joins
    ``refusals``)."""
    try:
        validate_schedule(schedule, micro_batches, pp, chunks)
    except ValueError as error:
        refusals.append(str(error))
        return False
    return True


def _splits(config: GPTConfig, pp: int, request: SplitRequest, schedule: str | None, vp: int | None,
            strict: bool, refusals: list[str]) -> list[tuple[str, int, tuple[int, ...] | None]]:
    """(schedule, chunks per stage, split) of each way to run ``pp`` stages: ``schedule`` or each the
    planner compares (interleaved where ``vp`` is given), each with ``request``'s cut, or the even one and
    ``balanced_split``'s where it differs. A cut that cannot be made is left out, or with ``strict`` (the
    pipeline size was given) raises its ValueError; else its message joins ``refusals``."""
    if pp == 1 and not request.given():
        return [("1f1b", 1, None)]
    if request.layout:  # its virtual stages say how many chunks
        try:
            vp = request.chunks(pp, config.num_layers)
        except ValueError as error:
            if strict:
                raise
            refusals.append(str(error))
            return []
    kinds = [schedule] if schedule else ["interleaved"] if vp and vp > 1 else ["1f1b", "zb-h1", "zbv"]
    first_refusal = len(refusals)
    if pp == 1:
        kinds = ["1f1b"]
    found = []
    for kind in kinds:
        chunks = 2 if kind in V_SCHEDULES else (vp or 1) if kind == "interleaved" else 1
        if request.given():
            try:
                split = request.split(config.num_layers, pp, chunks, kind in V_SCHEDULES)
                found.append((kind, chunks, split))
            except ValueError as error:
                if strict and (schedule or len(kinds) == 1):
                    raise
                refusals.append(str(error))
            continue
        balanced = balanced_split(config, pp, chunks, kind in V_SCHEDULES)
        try:
            validate_partition(config.num_layers, pp, chunks)
            found.append((kind, chunks, None))
        except ValueError as error:
            if balanced is None:
                refusals.append(f"{kind}: {error}" if chunks > 1 else str(error))
        if balanced is not None:
            found.append((kind, chunks, balanced))
    if strict and not found:
        raise ValueError(refusals[first_refusal])
    return found


def balanced_split(config: GPTConfig, pp: int, chunks: int, v: bool) -> tuple[int, ...] | None:
    """The first / last stage counts (Megatron's ``--decoder-first/last-pipeline-num-layers``, the other
    stages even, every stage's count cut into its ``chunks``) whose busiest stage does the least work, the
    output layer counted on the stage that holds it; None where that is the even cut or none exists."""
    return _balanced_split(frozen_config(config), pp, chunks, v)


@functools.lru_cache(maxsize=256)
def _balanced_split(frozen: tuple, pp: int, chunks: int, v: bool) -> tuple[int, ...] | None:
    config = thawed_config(frozen)
    layers, head = forward_flops_parts(config)
    cost = [matmul + attention for matmul, attention in layers]
    loss_rank = 0 if v else pp - 1
    best, best_cost = None, None
    for first in range(1, config.num_layers):
        for last in range(1, config.num_layers - first + 1):
            try:
                counts = first_last_counts(config.num_layers, pp, first, last)
            except ValueError:
                continue
            if any(count % chunks for count in counts):
                continue
            starts = [sum(counts[:stage]) for stage in range(pp)]
            work = [sum(cost[i] for i in range(start, start + count)) for start, count in zip(starts, counts)]
            work[loss_rank] += sum(head)
            if best_cost is None or max(work) < best_cost:
                best, best_cost = counts, max(work)
    if best is None or len(set(best)) == 1:
        return None
    return per_rank_split(config.num_layers, pp, chunks, best, "the proposed split", v)


def _expert_sizes(config: GPTConfig, ranks: int, etp: int, ep: int | None) -> list[int]:
    """The ep sizes worth trying on a stage's ``ranks``: those that divide the experts and, with etp, the
    ranks (one, without experts)."""
    if not config.num_experts:
        return [1]
    experts = config.num_experts
    return [e for e in ([ep] if ep else range(1, experts + 1))  # a grid that cannot hold ep is skipped
            if experts % e == 0 and ranks % (e * etp) == 0]


def _layouts_of(grid: Layout, cuts: list[tuple[str, int, tuple[int, ...] | None]], gpus_per_node: int,
                global_batch_size: int | None, zero_stage: int | None, zero_plus_plus: bool,
                micro_batch_size: int, refusals: list[str]) -> list[Layout]:
    """The layouts of one tp x pp x cp x dp (x ep) ``grid``: micro-batch sizes, ZeRO stages and options,
    recompute, offload, each with every cut of ``cuts`` whose schedule runs its micro-batches (``_runs``)."""
    layouts, dp = [], grid.dp
    for micro in (1, 2, 4, 8) if global_batch_size is not None else (micro_batch_size,):
        batch = global_batch_size if global_batch_size is not None else micro * dp
        if batch % (micro * dp):
            continue
        for stage in ([zero_stage] if zero_stage is not None else [0, 1, 2, 3]):
            variants = (zero_variants(stage, Topology(grid.tp * grid.pp * grid.cp * dp, grid.tp, grid.pp,
                                                      grid.cp, gpus_per_node=gpus_per_node), gpus_per_node)
                        if zero_plus_plus else [ZeroCommOptions()])
            # selective as it buys memory (the attention core's recompute buys none with a fused kernel)
            for recompute, modules in ((None, ()), ("selective", ("mlp", "layernorm")), ("full", ())):
                for offload in ("none", "cpu") if stage else ("none",):
                    for options in variants:
                        layouts += [replace(grid, zero_stage=stage, recompute=recompute,
                                            micro_batch_size=micro, offload_optimizer=offload,
                                            recompute_modules=modules, zero=options, schedule=kind, vp=chunks,
                                            split=split)
                                    for kind, chunks, split in cuts
                                    if _runs(kind, batch // (micro * dp), grid.pp, chunks, refusals)]
    return layouts


def plan(config: GPTConfig, world_size: int, gpus_per_node: int, memory_per_device: float,
         global_batch_size: int | None,
         compute_bytes: int = 2, zero_stage: int | None = None, tp: int | None = None, pp: int | None = None,
         bucket_size: int = 20_000_000, persistence_threshold: int = 100_000,
         grad_bytes: int | None = None, request: SplitRequest = SplitRequest(),
         links: Links | None = None, device: Device = Device(), cp: int | None = None,
         micro_batch_size: int = 1, progress: Callable[[int, int], None] | None = None,
         ep: int | None = None, etp: int | None = None, schedule: str | None = None,
         vp: int | None = None, optimizer: str = "adam") -> list[Plan]:
    """The layouts that fit ``memory_per_device``, best first (with ``links``: by predicted step time,
    ZeRO++ and shard groups among the candidates). ``global_batch_size`` None: Megatron's default,
    ``micro_batch_size`` x dp, in each layout. ``progress(done, total)`` is called before the first layout
    is priced and after each."""
    layouts = candidate_layouts(config, world_size, gpus_per_node, global_batch_size, zero_stage, tp, pp,
                                request, zero_plus_plus=links is not None, cp=cp,
                                micro_batch_size=micro_batch_size, ep=ep, etp=etp, schedule=schedule, vp=vp,
                                optimizer=optimizer)
    plans = []
    for done, layout in enumerate(layouts):
        if progress is not None:
            progress(done, len(layouts))
        plans.append(plan_layout(config, layout, global_batch_size or layout.micro_batch_size * layout.dp,
                                 compute_bytes, bucket_size, persistence_threshold, grad_bytes, gpus_per_node,
                                 links, device, memory_per_device))
    if progress is not None:
        progress(len(layouts), len(layouts))
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
    versus = (f", plain ZeRO-3 {plain3.step_seconds:.3f} s" if plain3 is not None and plain3 is not three
              else "")
    if two.step_seconds < three.step_seconds:
        return (f"on these links ZeRO-2 beats ZeRO-3: {two.step_seconds:.3f} s a step "
                f"({two.layout.zero.label()}) "
                f"against {three.step_seconds:.3f} s for the best ZeRO-3{options}{versus}")
    return (f"on these links ZeRO-3{options} is fastest: {three.step_seconds:.3f} s a step against "
            f"{two.step_seconds:.3f} s for the best ZeRO-2{versus}")
