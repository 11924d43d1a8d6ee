"""Activation checkpointing: keep a layer's input, drop what it computed, redo it in backward.

``RecomputePolicy`` decides per layer: keep everything, recompute the whole layer (``full``), or
recompute only the attention core (``selective``). ``apply_recompute`` installs it on a model's
chunks through the model's two runner hooks (``GPTModel.layer_runner``, ``SelfAttention.core_runner``),
so model code stays a plain GPT.

The recomputation is exact: the random state of the CPU, the GPU and the tensor-parallel tracker is
saved before the forward and restored for the recompute, so dropout draws the same masks. Modules run
through their ``__call__`` both times, so ZeRO-3 gathers their weights again for the recompute. With
``partition`` each tensor-parallel rank keeps only 1/tp of a replicated layer input (all-gathered
before the recompute), optionally on the CPU (``offload``); inputs that are already split (the
attention core's heads, sequence-parallel shards) are kept whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from parallel import comm
from parallel.comm import AxisGroup
from parallel.tensor.random import RNGTracker


def _keep(x: torch.Tensor, group: AxisGroup | None, offload: bool) -> torch.Tensor:
    """What is stored of an input: all of it, or this rank's 1/tp of it; on the CPU if offloading."""
    kept = x.detach()
    if group is not None and group.size > 1:
        flat = torch.nn.functional.pad(kept.reshape(-1), (0, -kept.numel() % group.size))
        kept = flat.chunk(group.size)[group.rank].clone()
    return kept.to("cpu") if offload else kept


def _restore(kept: torch.Tensor, like: tuple, group: AxisGroup | None) -> torch.Tensor:
    shape, dtype, device = like
    kept = kept.to(device)
    if group is not None and group.size > 1:
        whole = torch.empty(kept.numel() * group.size, dtype=dtype, device=device)
        comm.all_gather_into_tensor(whole, kept.contiguous(), group)
        kept = whole[:shape.numel()]
    return kept.view(shape).requires_grad_()


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, tracker, group, offload, count, *args):
        inputs, ctx.rest = args[:count], args[count:]
        ctx.run, ctx.tracker, ctx.group = run, tracker, group
        ctx.states = tracker.get_states()
        ctx.like = [(x.shape, x.dtype, x.device) for x in inputs]
        with torch.no_grad():
            out = run(*inputs, *ctx.rest)
        ctx.save_for_backward(*(_keep(x, group, offload) for x in inputs))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        inputs = [_restore(kept, like, ctx.group) for kept, like in zip(ctx.saved_tensors, ctx.like)]
        current = ctx.tracker.get_states()
        ctx.tracker.set_states(ctx.states)  # the same dropout masks as the first forward
        with torch.enable_grad():
            out = ctx.run(*inputs, *ctx.rest)
        ctx.tracker.set_states(current)
        torch.autograd.backward(out, grad_out)
        return (None,) * 5 + tuple(x.grad for x in inputs) + (None,) * len(ctx.rest)


def checkpoint(run: Callable, inputs: tuple[torch.Tensor, ...], *rest, tracker: RNGTracker,
               partition: AxisGroup | None = None, offload: bool = False) -> torch.Tensor:
    """``run(*inputs, *rest)``, keeping only ``inputs`` (or this rank's 1/tp of each) for backward and
    recomputing the rest in backward. ``rest`` must not need gradients (e.g. rotary tables)."""
    return _Checkpoint.apply(run, tracker, partition, offload, len(inputs), *inputs, *rest)


@dataclass(frozen=True)
class RecomputePolicy:
    """What to recompute. ``granularity``: None (keep all), "full" or "selective"; ``num_layers``: how
    many layers of each model chunk (all when None); ``method``: "block" checkpoints each of the first
    ``num_layers`` layers, "uniform" checkpoints groups of ``num_layers`` consecutive layers as one.
    ``partition`` / ``offload``: keep 1/tp of each checkpointed input / keep it on the CPU."""

    granularity: str | None = None
    num_layers: int | None = None
    method: str = "uniform"
    partition: bool = False
    offload: bool = False


def apply_recompute(chunks: nn.ModuleList, policy: RecomputePolicy, tp: AxisGroup) -> None:
    """Install ``policy`` on every model chunk (a ``GPTModel``)."""
    if policy.granularity is None:
        return
    for chunk in chunks:
        if policy.granularity == "selective":  # q, k, v are already split by heads: nothing to partition
            for layer in chunk.layers:
                layer.attention.core_runner = _selective_runner(chunk.rng, policy.offload)
        else:  # under sequence parallelism the layer input is already a 1/tp sequence shard
            partition = tp if policy.partition and not chunk.sequence_parallel else None
            chunk.layer_runner = _full_runner(chunk, policy, partition)


def _selective_runner(tracker: RNGTracker, offload: bool):
    def run(core, q, k, v):
        return checkpoint(core, (q, k, v), tracker=tracker, offload=offload)
    return run


def _full_runner(chunk: nn.Module, policy: RecomputePolicy, partition: AxisGroup | None):
    layers = list(chunk.layers)
    n = len(layers) if policy.num_layers is None else max(1, min(policy.num_layers, len(layers)))
    if policy.method == "uniform":  # groups of n consecutive layers, each group one checkpoint
        spans = [(layers[i:i + n], True) for i in range(0, len(layers), n)]
    else:  # block: the first n layers checkpointed one by one, the others keep their activations
        spans = [([layer], i < n) for i, layer in enumerate(layers)]

    def run(x, rotary):
        for span, recompute in spans:
            if recompute:
                x = checkpoint(_sequence(span), (x,), rotary, tracker=chunk.rng, partition=partition,
                               offload=policy.offload)
            else:
                x = _sequence(span)(x, rotary)
        return x
    return run


def _sequence(layers: list[nn.Module]):
    def run(x, rotary):
        for layer in layers:
            x = layer(x, rotary)
        return x
    return run
