"""Tensor-parallel layers (Megatron-style), usable unchanged at tp = 1.

Activations are [sequence, batch, hidden]. With sequence parallelism, the activations outside the
parallel regions are split along the sequence (dim 0) across the tensor-parallel group; the
entry/exit collectives become all-gather / reduce-scatter instead of identity / all-reduce.

Each parameter's place in the layout (split over tp, partial under sequence parallelism, padded
rows, the recipe of its initial value) is declared with ``parallel.param_meta.declare``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel.comm import AxisGroup, compile_boundary
from parallel.param_meta import declare
from parallel.tensor.mappings import (all_gather_dim0, copy_to_tensor_parallel,
                                      gather_from_sequence_parallel, reduce_from_tensor_parallel,
                                      reduce_scatter_dim0, reduce_scatter_to_sequence_parallel)
from parallel.tensor.fp8 import Float8Matmul, Fp8Recipe, fp8_eligible
from parallel.tensor.weight_grad import WeightGradStore, weight_gradient
from parallel.tensor.weight_init import WeightInit


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} {total} is not divisible by the tensor-parallel size {parts}")
    return total // parts


def shard_parameter(make_full, dim: int, group: AxisGroup) -> nn.Parameter:
    """This rank's slice of the weight ``make_full()`` builds; ``init_fn`` rebuilds it on demand (a
    model constructed on the meta device is materialised from it, one ZeRO-3 unit at a time)."""
    def slice_of_full() -> torch.Tensor:
        return make_full().chunk(group.size, dim=dim)[group.rank].contiguous()

    return declare(nn.Parameter(slice_of_full()), init_fn=slice_of_full, tensor_parallel=group.size > 1,
                   partition_dim=dim)


def with_init(param: nn.Parameter, init_fn) -> nn.Parameter:
    """Declare the recipe of ``param``'s initial value (used when it was built on the meta device)."""
    return declare(param, init_fn=init_fn)


def mark_sequence_parallel(param: nn.Parameter, enabled: bool) -> nn.Parameter:
    """Declare a replicated parameter whose gradient is partial under sequence parallelism."""
    return declare(param, sequence_parallel=enabled)


class _Linear(torch.autograd.Function):
    """Y = X A^T + b, where X is all-gathered over ``group`` first under sequence parallelism (saving only
    this rank's piece: backward gathers it again, so the saved input of a column-parallel layer stays at
    1/tp, as the Korthikanti et al. activation formula assumes). Inside a split backward's input pass
    (``store``, ``parallel.tensor.weight_grad``) the weight's gradient is left to the store's weight pass.
    ``weight`` is the parameter itself (stacked ones are flattened here), so a deferred gradient reaches it;
    ``anchor``: the store's (it makes the input pass run this backward whatever it is asked for).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, store, anchor):
        ctx.group, ctx.store, ctx.has_bias = group, store, bias is not None
        ctx.save_for_backward(x, weight)
        ctx.weight = weight
        full = x if group is None else all_gather_dim0(x, group)
        return F.linear(full, weight.flatten(0, -2), bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group = ctx.group
        grad_full = grad_out.matmul(weight.flatten(0, -2))
        grad_x = grad_full if group is None else reduce_scatter_dim0(grad_full, group)
        shape = weight.shape  # ZeRO-3 may have freed the weight by the time a deferred product runs

        def weight_grad() -> torch.Tensor:
            full = x if group is None else all_gather_dim0(x, group)
            return grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(
                full.reshape(-1, full.shape[-1])).view(shape)

        grad_weight = weight_gradient(ctx.store, ctx.weight, weight_grad, x, grad_out)
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None, None


_linear_function = compile_boundary(_Linear.apply)  # it communicates, or keeps state for a split backward


def _linear(x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None, group: AxisGroup | None,
            store: WeightGradStore | None) -> torch.Tensor:
    return _linear_function(x, weight, bias, group, store, None if store is None else store.anchor)


class LinearWeights(nn.Module):
    """A linear map's ``weight`` (and ``bias``), named as torch's linear layers name them; its owner (the
    experts, the router, latent attention's projections) multiplies, never it."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None):
        super().__init__()
        self.weight, self.bias = weight, bias


def replicated_linear(init: WeightInit, rows: int, columns: int, sequence_parallel: bool,
                      bias: bool = False) -> LinearWeights:
    """A linear map held whole by every tp rank (a low-rank down projection whose output the ranks' heads
    share): its gradient partial under sequence parallelism (each rank's tokens), declared so."""
    weight = declare(with_init(nn.Parameter(init.full((rows, columns))), lambda: init.full((rows, columns))),
                     sequence_parallel=sequence_parallel)
    bias_vector = declare(with_init(nn.Parameter(torch.zeros(rows)), lambda: torch.zeros(rows)),
                          sequence_parallel=sequence_parallel) if bias else None
    return LinearWeights(weight, bias_vector)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its output dim: each rank computes out/tp columns of Y.

    Owns its weight slice [out/tp, in] and bias slice. Its output stays split (the next layer is
    row-parallel); it never gathers the full output. ``stacked = k`` holds k matrices of the same
    shape side by side (weight [k, out/tp, in], split along ``out`` each): a rank's output is its
    slice of each in turn, e.g. SwiGLU's gate and up, so that every tp computes the same numbers.
    ``fp8`` (``parallel.tensor.fp8``), when set, computes the product in fp8; under sequence parallelism it
    then keeps the gathered input for backward (torchao's product saves its own operands). ``weight_grads``
    (``defer_weight_gradients``), when set, lets a split backward leave the weight's gradient for later.
    """

    fp8: Float8Matmul | None = None
    weight_grads: WeightGradStore | None = None

    def __init__(self, in_features: int, out_features: int, group: AxisGroup, init: WeightInit, *,
                 bias: bool = True, sequence_parallel: bool = False, dtype: torch.dtype = torch.float32,
                 stacked: int = 1):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        _divide(out_features, group.size, f"{init.name}: output features")
        shape, dim = (((out_features, in_features), 0) if stacked == 1
                      else ((stacked, out_features, in_features), 1))
        self.weight = shard_parameter(lambda: init.full(shape, dtype), dim, group)
        self.bias = (shard_parameter(lambda: torch.zeros(shape[:-1], dtype=dtype), dim, group) if bias
                     else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.flatten(0, -2)  # a view: [stacked * out/tp, in]
        bias = None if self.bias is None else self.bias.flatten()
        split = self.sequence_parallel and self.group.size > 1
        if self.fp8 is not None:
            gathered = (gather_from_sequence_parallel(x, self.group) if split
                        else copy_to_tensor_parallel(x, self.group))
            out = self.fp8(gathered, weight)
            return out if bias is None else out + bias
        if split or self.weight_grads is not None:
            return _linear(x if split else copy_to_tensor_parallel(x, self.group), self.weight, bias,
                           self.group if split else None, self.weight_grads)
        return F.linear(copy_to_tensor_parallel(x, self.group), weight, bias)

    def deferred_weights(self) -> list[nn.Parameter]:
        """The weight, whose gradient a split backward defers (``weight_grads``), unless multiplied in fp8."""
        return [self.weight] if self.fp8 is None else []


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its input dim: each rank takes in/tp features of X.

    Owns its weight slice [out, in/tp] and the full (replicated) bias, added once after the partial
    products are summed. It never sees the full input. ``fp8``, when set, computes the partial product in
    fp8 (``parallel.tensor.fp8``); ``weight_grads``, as the column-parallel layer's.
    """

    fp8: Float8Matmul | None = None
    weight_grads: WeightGradStore | None = None

    def __init__(self, in_features: int, out_features: int, group: AxisGroup, init: WeightInit, *,
                 bias: bool = True, sequence_parallel: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        _divide(in_features, group.size, f"{init.name}: input features")
        self.weight = shard_parameter(lambda: init.full((out_features, in_features), dtype), 1, group)
        self.bias = (mark_sequence_parallel(with_init(nn.Parameter(torch.zeros(out_features, dtype=dtype)),
                                                      lambda: torch.zeros(out_features, dtype=dtype)),
                                            sequence_parallel) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            partial = self.fp8(x, self.weight)
        else:
            partial = deferring_linear(x, self.weight, None, self.weight_grads)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel(partial, self.group)
        else:
            out = reduce_from_tensor_parallel(partial, self.group)
        return out if self.bias is None else out + self.bias

    def deferred_weights(self) -> list[nn.Parameter]:
        """The weight, whose gradient a split backward defers (``weight_grads``), unless multiplied in fp8."""
        return [self.weight] if self.fp8 is None else []


def vocab_parallel_table(vocab_size: int, padded_vocab_size: int, hidden_size: int, group: AxisGroup,
                         init: WeightInit, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    """Rows [start, end) of a (padded) [vocabulary, hidden] table split by vocabulary range. Rows at or
    beyond ``vocab_size`` (padding) start at zero, so that the real rows' numbers do not depend on the
    padding, i.e. on tp."""
    _divide(padded_vocab_size, group.size, "padded vocabulary size")

    def table() -> torch.Tensor:
        full = torch.zeros(padded_vocab_size, hidden_size, dtype=dtype)
        full[:vocab_size] = init.full((vocab_size, hidden_size), dtype)
        return full
    # rows beyond are padding, sized by tp (checkpoints drop them)
    return declare(shard_parameter(table, 0, group), unpadded_rows=vocab_size)


class _Lookup(torch.autograd.Function):
    """``F.embedding(rows, table)`` with the positions ``outside`` (None: none) zeroed, whose table gradient
    (torch's own dense embedding backward) a split backward's input pass leaves to the store (``store``,
    ``parallel.tensor.weight_grad``): until then it keeps the output's gradient, not a table-sized one."""

    @staticmethod
    def forward(ctx, rows, table, outside, store, anchor):
        ctx.save_for_backward(rows, outside)
        ctx.table, ctx.store, ctx.shape = table, store, table.shape
        out = F.embedding(rows, table)
        return out if outside is None else out.masked_fill(outside.unsqueeze(-1), 0.0)

    @staticmethod
    def backward(ctx, grad):
        rows, outside = ctx.saved_tensors
        grad = grad if outside is None else grad.masked_fill(outside.unsqueeze(-1), 0.0)
        count = ctx.shape[0]

        def table_grad() -> torch.Tensor:
            return torch.ops.aten.embedding_dense_backward(grad, rows, count, -1, False)

        return None, weight_gradient(ctx.store, ctx.table, table_grad, grad, rows), None, None, None


_lookup = compile_boundary(_Lookup.apply)  # it keeps Python state for a split backward


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose table is split by vocabulary range across the tensor-parallel group.

    Owns rows [start, end) of the (padded) table (``vocab_parallel_table``). Each rank looks up the
    tokens in its range, zeros the rest, and the partial embeddings are summed over the group. It never
    holds another rank's rows. ``weight_grads``, when set, lets a split backward defer the table's gradient.
    """

    weight_grads: WeightGradStore | None = None

    def __init__(self, vocab_size: int, padded_vocab_size: int, hidden_size: int, group: AxisGroup,
                 init: WeightInit, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.group = group
        self.weight = vocab_parallel_table(vocab_size, padded_vocab_size, hidden_size, group, init, dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(tokens, self.weight, self.group, self.weight_grads)

    def deferred_weights(self) -> list[nn.Parameter]:
        """The table, whose gradient a split backward defers (``weight_grads``)."""
        return [self.weight]


def vocab_parallel_lookup(tokens: torch.Tensor, weight_shard: torch.Tensor, group: AxisGroup,
                          store: WeightGradStore | None = None) -> torch.Tensor:
    """The embeddings of ``tokens`` from a table split by vocabulary range over ``group`` (this rank's rows
    ``weight_shard``): each rank looks up its range, zeros the rest, and the parts are summed over the
    group. ``store``: a split backward defers the table's gradient there."""
    if group.size == 1:
        rows, outside = tokens, None
    else:
        start = group.rank * weight_shard.shape[0]
        outside = (tokens < start) | (tokens >= start + weight_shard.shape[0])
        rows = (tokens - start).masked_fill(outside, 0)
    if store is not None:
        out = _lookup(rows, weight_shard, outside, store, store.anchor)
    else:
        out = F.embedding(rows, weight_shard)
        out = out if outside is None else out.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tensor_parallel(out, group)


class VocabParallelOutput(nn.Module):
    """The output layer: hidden -> this rank's vocabulary slice of the logits, with a weight of its own
    (an untied model's, or a last pipeline stage's copy of the tied embedding). Owns rows [start, end)
    of the [vocabulary, hidden] table; the full logits never exist. ``weight_grads``, as the column-parallel
    layer's."""

    weight_grads: WeightGradStore | None = None

    def __init__(self, vocab_size: int, padded_vocab_size: int, hidden_size: int, group: AxisGroup,
                 init: WeightInit, *, sequence_parallel: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = vocab_parallel_table(vocab_size, padded_vocab_size, hidden_size, group, init, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(hidden, self.weight, self.group, self.sequence_parallel,
                                     self.weight_grads)

    def deferred_weights(self) -> list[nn.Parameter]:
        """The weight, whose gradient a split backward defers (``weight_grads``)."""
        return [self.weight]


def vocab_parallel_logits(hidden: torch.Tensor, weight_shard: torch.Tensor, group: AxisGroup,
                          sequence_parallel: bool = False, weight_grads: WeightGradStore | None = None
                          ) -> torch.Tensor:
    """Logits of this rank's vocabulary range, [s, b, vocab/tp]; the full logits never exist."""
    split = sequence_parallel and group.size > 1
    if split or weight_grads is not None:
        return _linear(hidden if split else copy_to_tensor_parallel(hidden, group), weight_shard, None,
                       group if split else None, weight_grads)
    return F.linear(copy_to_tensor_parallel(hidden, group), weight_shard)


def defer_weight_gradients(module: nn.Module, store: WeightGradStore) -> set[nn.Parameter]:
    """Give ``store`` to every layer inside ``module`` that can defer its weights' products (one that has
    ``deferred_weights``: the tensor-parallel linear layers, the output layer, the experts, latent
    attention's projections); return those weights, whose gradients a split backward defers."""
    deferring = set()
    for layer in module.modules():
        if hasattr(layer, "deferred_weights"):
            layer.weight_grads = store
            deferring.update(layer.deferred_weights())
    return deferring


def deferring_linear(x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None,
                     weight_grads: WeightGradStore | None) -> torch.Tensor:
    """``F.linear``, whose weight's gradient a split backward defers to ``weight_grads`` when given."""
    if weight_grads is None:
        return F.linear(x, weight, bias)
    return _linear(x, weight, bias, None, weight_grads)


def use_fp8(module: nn.Module, recipe: Fp8Recipe) -> tuple[int, int]:
    """Set an fp8 product (``parallel.tensor.fp8``) on every tensor-parallel linear layer inside ``module``
    whose local weight torch can multiply in fp8; return (layers in fp8, layers left in their dtype)."""
    converted = skipped = 0
    for layer in module.modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            out_features, in_features = layer.weight.flatten(0, -2).shape
            if fp8_eligible(in_features, out_features):
                layer.fp8 = Float8Matmul(in_features, out_features, recipe)
                converted += 1
            else:
                skipped += 1
    return converted, skipped
