"""Activation checkpointing: keep a layer's input, drop what it computed, redo it in backward.

``RecomputePolicy`` decides per layer: keep everything, recompute the whole layer (``full``), or
recompute the modules Megatron's ``--recompute-modules`` names (``selective``): ``core_attn`` the attention
core, ``mlp`` the MLP (its input kept), ``moe`` a mixture-of-experts layer in its place (the same way: its
routing is a function of its input, so the recompute routes every token as the forward did),
``shared_experts`` a MoE layer's shared expert, ``mla_up_proj`` latent attention from its latents (the up
projections, rotary and the core they feed: only the latents are kept), ``layernorm`` the norms before
attention and the MLP and ``moe_act`` the experts' activation (their outputs, which the next linear keeps,
are dropped once it has run and rebuilt before its backward: Megatron's output-discarding checkpoint).
``apply_recompute`` installs it on a model's chunks through the model's runner hooks
(``LayerStack.recompute_layers_with``, ``TransformerBlock.recompute_selectively``), so model code stays a
plain GPT and this module knows none of its parts.

The recomputation is exact: the random state of the CPU, the GPU and the tensor-parallel tracker is
saved before the forward and restored for the recompute, so dropout draws the same masks. Modules run
through their ``__call__`` both times, so ZeRO-3 gathers their weights again for the recompute. With
``partition`` each tensor-parallel rank keeps only 1/tp of a replicated layer input (all-gathered
before the recompute), optionally on the CPU (``offload``); inputs that are already split (the
attention core's heads, sequence-parallel shards) are kept whole. What is kept, and the all-gather
that rebuilds it, live in slots of the ZeRO-R buffer pool: after the first iteration checkpointing
allocates nothing there (a CPU-kept input still gets a device copy for its recompute), and the slots
held are those of the checkpoints alive at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from parallel import comm
from parallel.buffer_pool import BufferPool
from parallel.comm import AxisGroup, compile_boundary
from parallel.saved_activations import drop_storage
from parallel.tensor.random import RNGTracker
from parallel.tensor.weight_grad import nested_backward, splitting


class CheckpointStore:
    """Where checkpointed inputs wait for their backward: slots of the buffer pool, holding all of an
    input or this tensor-parallel rank's 1/tp of it (``partition``), on the CPU when ``offload``.

    Owns nothing but the choice: the slots belong to the pool, each taken in forward and given back when
    the checkpoint's backward has run. A forward whose backward never runs keeps its slots, so
    ``checkpoint`` only stores under grad mode.
    """

    def __init__(self, pool: BufferPool, partition: AxisGroup | None = None, offload: bool = False):
        self.pool, self.offload = pool, offload
        self.partition = partition if partition is not None and partition.size > 1 else None

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """Copy what is stored of ``x`` into a slot (all of it, or this rank's padded 1/tp)."""
        flat, parts = x.detach().reshape(-1), self.partition.size if self.partition else 1
        length = -(-flat.numel() // parts)
        piece = (flat[self.partition.rank * length:(self.partition.rank + 1) * length] if self.partition
                 else flat)
        slot = self.pool.slots("activation-checkpoints", length, x.dtype,
                               torch.device("cpu") if self.offload else x.device).take()
        slot[:piece.numel()].copy_(piece, non_blocking=True)  # a pinned host slot: the copy runs behind the
        # compute, and backward's copy back is queued after it on the same stream
        slot[piece.numel():].zero_()
        return slot

    def restore(self, kept: torch.Tensor, like: tuple) -> tuple[torch.Tensor, list]:
        """The whole input again, as a leaf that requires grad, and the slots to give back after backward."""
        shape, dtype, device = like
        used = [(self.pool.slots("activation-checkpoints", kept.numel(), dtype, kept.device), kept)]
        kept_here = kept.to(device, non_blocking=True)
        if self.partition:
            whole_slots = self.pool.slots("activation-gathers",
                                          kept.numel() * self.partition.size, dtype, device)
            whole = whole_slots.take()
            comm.all_gather_into_tensor(whole, kept_here, self.partition)
            used.append((whole_slots, whole))
        else:
            whole = kept_here
        return whole[:shape.numel()].view(shape).requires_grad_(), used


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, tracker, store, count, *args):
        inputs, ctx.rest = args[:count], args[count:]
        ctx.run, ctx.tracker, ctx.store = run, tracker, store
        ctx.states = tracker.state_dict()
        ctx.like = [(x.shape, x.dtype, x.device) for x in inputs]
        with torch.no_grad():
            out = run(*inputs, *ctx.rest)
        ctx.save_for_backward(*(store.keep(x) for x in inputs))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        restored = [ctx.store.restore(kept, like) for kept, like in zip(ctx.saved_tensors, ctx.like)]
        # a split backward's weight pass reads the region's inputs after the slots serve other checkpoints
        inputs = [x.detach().clone().requires_grad_() if splitting() else x for x, _ in restored]
        current = ctx.tracker.state_dict()
        ctx.tracker.load_state_dict(ctx.states)  # the same dropout masks as the first forward
        with torch.enable_grad():
            out = ctx.run(*inputs, *ctx.rest)
        ctx.tracker.load_state_dict(current)
        grads = nested_backward(out, grad_out, inputs)
        for _, used in restored:  # the recompute's graph is gone: its slots can serve the next checkpoint
            for slots, buffer in used:
                slots.give_back(buffer)
        return (None,) * 4 + tuple(grads) + (None,) * len(ctx.rest)


_checkpoint = compile_boundary(_Checkpoint.apply)  # it keeps pool slots and random states


def checkpoint(run: Callable, inputs: tuple[torch.Tensor, ...], *rest, tracker: RNGTracker,
               store: CheckpointStore) -> torch.Tensor:
    """``run(*inputs, *rest)``, keeping only ``inputs`` (or this rank's 1/tp of each, see ``store``) for
    backward and recomputing the rest in backward. ``rest`` must not need gradients (e.g. rotary
    tables). Without grad mode nothing is kept: it is just ``run``."""
    if not torch.is_grad_enabled():
        return run(*inputs, *rest)
    return _checkpoint(run, tracker, store, len(inputs), *inputs, *rest)


# Megatron's --recompute-modules (which of them a model has: ``models.layers.registry.recomputable_modules``)
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "moe_act", "shared_experts", "mla_up_proj",
                     "mamba")


@dataclass(frozen=True)
class RecomputePolicy:
    """What to recompute. ``granularity``: None (keep all), "full" or "selective"; ``num_layers``: how
    many layers of each model chunk, and of each prediction depth's (all when None; megatron-core
    recomputes a depth whole under "uniform" and not under "block"); ``method``: "block" checkpoints each
    of the first ``num_layers`` layers, "uniform" checkpoints groups of ``num_layers`` consecutive layers
    as one.
    ``partition`` / ``offload``: keep 1/tp of each checkpointed input / keep it on the CPU. ``modules``:
    what selective recompute redoes (``RECOMPUTE_MODULES``)."""

    granularity: str | None = None
    num_layers: int | None = None
    method: str = "uniform"
    partition: bool = False
    offload: bool = False
    modules: tuple[str, ...] = ("core_attn",)  # selective: what is recomputed


def apply_recompute(chunks: nn.ModuleList, policy: RecomputePolicy, tp: AxisGroup,
                    pool: BufferPool | None = None) -> None:
    """Install ``policy`` on every model chunk (a ``GPTModel``, its prediction depths' layers as its own);
    checkpoints are kept in ``pool``'s slots (a pool of their own when None)."""
    if policy.granularity is None:
        return
    pool = pool or BufferPool()
    for chunk in chunks:
        if policy.granularity == "selective":  # q, k, v are already split by heads: nothing to partition
            store = CheckpointStore(pool, offload=policy.offload)
            for layer in chunk.layers_with_depths():
                layer.recompute_selectively(policy.modules, _selective_runner(chunk.rng, store),
                                            DroppedOutput())  # (each installs them where it has them)
        else:  # under sequence parallelism the layer input is already a 1/tp sequence shard
            partition = tp if policy.partition and not chunk.sequence_parallel else None
            store = CheckpointStore(pool, partition, policy.offload)
            for part in [chunk, *chunk.mtp]:  # (each prediction depth's layers run as the chunk's)
                part.recompute_layers_with(_full_runner(list(part.layers), chunk.rng, policy, store))


def _selective_runner(tracker: RNGTracker, store: CheckpointStore):
    def run(compute, *tensors):  # the attention core (q, k, v, inputs) or the MLP (x)
        inputs = tuple(t for t in tensors if isinstance(t, torch.Tensor))
        return checkpoint(compute, inputs, *tensors[len(inputs):], tracker=tracker, store=store)
    return run


class _RebuiltOutput(torch.autograd.Function):
    """y = fn(x) made without a graph; backward makes it again from x with one."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)  # fn itself keeps its input for backward
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            out = ctx.fn(leaf)
        return None, nested_backward(out, grad, [leaf])[0]


class DroppedOutput:
    """Megatron's output-discarding checkpoint of a cheap function ``fn`` (the norms of --recompute-modules
    layernorm, the experts' activation of moe_act): ``run`` gives ``fn(x)``; ``drop`` frees its storage
    once the layer that read it has run (that layer's linear keeps it for its weight gradient), and a
    hook on that layer's output puts the values back, into the same storage, before its backward reads
    them. Owns nothing between steps; its calls run eagerly under torch.compile."""

    @staticmethod
    @compile_boundary
    def run(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return _RebuiltOutput.apply(fn, x) if torch.is_grad_enabled() and x.requires_grad else fn(x)

    @staticmethod
    @compile_boundary
    def drop(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor,
             out: torch.Tensor) -> None:
        if not (torch.is_grad_enabled() and out.requires_grad):
            return
        nbytes = y.untyped_storage().nbytes()
        drop_storage(y)

        def rebuild(grad: torch.Tensor) -> None:
            with torch.no_grad():
                values = fn(x)
            y.untyped_storage().resize_(nbytes)
            y.untyped_storage().copy_(values.untyped_storage())  # no version bump: still the saved one
        out.register_hook(rebuild)


def _full_runner(layers: list[nn.Module], tracker: RNGTracker, policy: RecomputePolicy,
                 store: CheckpointStore):
    n = len(layers) if policy.num_layers is None else max(1, min(policy.num_layers, len(layers)))
    if policy.method == "uniform":  # groups of n consecutive layers, each group one checkpoint
        spans = [(layers[i:i + n], True) for i in range(0, len(layers), n)]
    else:  # block: the first n layers checkpointed one by one, the others keep their activations
        spans = [([layer], i < n) for i, layer in enumerate(layers)]

    def run(x, inputs):
        for span, recompute in spans:
            if recompute:
                x = checkpoint(_sequence(span), (x,), inputs, tracker=tracker, store=store)
            else:
                x = _sequence(span)(x, inputs)
        return x
    return run


def _sequence(layers: list[nn.Module]):
    def run(x, inputs):
        for layer in layers:
            x = layer(x, inputs)
        return x
    return run
