"""A backward split in two (the zero-bubble pipeline schedules): the input-gradient pass (B), which the
previous pipeline stage waits for, and the weight-gradient pass (W), which can run later.

B runs autograd for the chunk's input and for every parameter whose layer does not defer (norms,
biases, routers), without accumulating anything: those gradients are kept. The layers given the store
(``parallel.tensor.layers.defer_weight_gradients``: tensor-parallel linears, the output layer, the
embedding, the experts, latent attention's projections) compute only their input's gradient in B and
leave the product for their weight's gradient (its operands: their input and output gradient) to the
store. W computes the products and hands every gradient of the
micro-batch to autograd's accumulation, one parameter at a time in the order a whole backward would
produce them: the gradient hooks (ZeRO's buckets) therefore see a micro-batch's gradients arrive
together, in W, and start their reductions when W ends, exactly as after a whole backward.

A backward that runs inside another (a recomputed region's, ``parallel.recompute``) goes through
``nested_backward``: inside an input pass its parameters' gradients go to the store too.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


_running: WeightGradStore | None = None  # the store whose input pass runs now (one per process)


def splitting() -> bool:
    """Whether a split backward's input pass is running (its nested backwards defer too)."""
    return _running is not None


def nested_backward(out: torch.Tensor, grad: torch.Tensor,
                    inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Backward from ``out`` (with ``grad``) inside another backward, to ``inputs`` (leaves made for the
    region): their gradients. The region's parameters' gradients accumulate, or, inside an input pass,
    go to its store."""
    if _running is None:
        torch.autograd.backward(out, grad)
        return [x.grad for x in inputs]
    return _running.nested_pass(out, grad, inputs)


def weight_gradient(store: WeightGradStore | None, param: nn.Parameter, compute: Callable[[], torch.Tensor],
                    *operands: torch.Tensor) -> torch.Tensor | None:
    """For a layer's backward: ``param``'s gradient ``compute()`` now, or, inside ``store``'s input pass,
    None and the product left to its weight pass (keeping ``operands`` until then)."""
    if store is not None and store.splitting:
        store.defer(param, compute, *operands)
        return None
    return compute()


def _parameters_under(root: torch.Tensor) -> list[torch.Tensor]:
    """The leaves that require grad in ``root``'s graph, in the order a backward reaches them."""
    seen, leaves, stack = set(), [], [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad
            leaves.append(node.variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Autograd's accumulation of ``grad`` into ``param`` (its hooks run). A parameter whose owner has freed
    its values since B (ZeRO-3 between gathers: an empty tensor) is given a stand-in of its shape without
    storage for the call, and its freed state back unless a hook changed it."""
    if param.shape == grad.shape:
        torch.autograd.backward(param, grad)
        return
    freed = param.data
    stand_in = grad.new_zeros(()).expand(grad.shape)
    param.data = stand_in
    try:
        torch.autograd.backward(param, grad)
    finally:
        if param.data.data_ptr() == stand_in.data_ptr() and param.shape == grad.shape:
            param.data = freed


class WeightGradStore:
    """Owns the weight-gradient work a split backward left for later, per (chunk, micro-batch): deferred
    products and the other parameters' gradients, and which weights defer (``deferring``, given by the
    layers). Never accumulates a gradient outside ``weight_pass``; a layer's backward defers to it only
    inside ``input_pass``."""

    def __init__(self):
        self.deferring: set[nn.Parameter] = set()
        # every deferring layer's autograd function takes it as an input, and the input pass asks for its
        # gradient (always none): autograd then runs each of them, even one that leads to nothing else asked
        # for (the first stage's embedding, whose input is tokens)
        self.anchor = torch.zeros((), requires_grad=True)
        self._key: tuple[int, int] | None = None
        self._work: dict[tuple[int, int], list[tuple[nn.Parameter, torch.Tensor | Callable]]] = {}
        self._order: dict[tuple[int, int], dict[nn.Parameter, int]] = {}
        self._operands: dict[tuple[int, int], list[torch.Tensor]] = {}

    @property
    def splitting(self) -> bool:
        return self._key is not None

    def defer(self, param: nn.Parameter, compute: Callable[[], torch.Tensor],
              *operands: torch.Tensor) -> None:
        """From a layer's backward inside ``input_pass``: ``compute()`` is ``param``'s gradient, for W, made
        from ``operands`` (what it keeps alive until then)."""
        self._work[self._key].append((param, compute))
        self._operands[self._key].extend(operands)

    def held_storages(self, key: tuple[int, int]) -> dict[int, int]:
        """The storages (address: bytes) micro-batch ``key`` holds until its W: the deferred products'
        operands and the other parameters' gradients."""
        tensors = self._operands[key] + [g for _, g in self._work[key] if isinstance(g, torch.Tensor)]
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    def input_pass(self, key: tuple[int, int], root: torch.Tensor, grad: torch.Tensor | None,
                   hidden: torch.Tensor | None, parameters: list[nn.Parameter]) -> torch.Tensor | None:
        """B of micro-batch ``key``: backward from ``root`` (with ``grad``) to ``hidden`` (None on the first
        stage) and to the ``parameters`` that do not defer; returns ``hidden``'s gradient. ``parameters``:
        the chunk's, in the order W hands their gradients on."""
        global _running
        self._key, self._work[key], self._operands[key] = key, [], []
        self._order[key] = {p: i for i, p in enumerate(parameters)}
        _running = self
        try:
            grads = self._gradients(root, grad, [] if hidden is None else [hidden],
                                    [p for p in parameters if p.requires_grad])
        finally:
            self._key, _running = None, None
        return None if hidden is None else grads[0]

    def nested_pass(self, out: torch.Tensor, grad: torch.Tensor,
                    inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """``nested_backward`` inside this store's input pass."""
        wanted = [x for x in inputs if x.requires_grad]
        chosen = {id(x) for x in wanted}
        grads = self._gradients(out, grad, wanted, [p for p in _parameters_under(out) if id(p) not in chosen])
        found = dict(zip(map(id, wanted), grads))
        return [found.get(id(x)) for x in inputs]

    def _gradients(self, root: torch.Tensor, grad: torch.Tensor | None, wanted: list[torch.Tensor],
                   parameters: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        """Autograd to ``wanted`` and the ``parameters`` that do not defer, the latter's gradients kept for
        W; returns ``wanted``'s (deferring layers hand their products to ``defer`` meanwhile)."""
        computed = [p for p in parameters if p not in self.deferring and p is not self.anchor]
        grads = torch.autograd.grad(root, wanted + computed + [self.anchor], grad, allow_unused=True)
        self._work[self._key] += [(p, g) for p, g in zip(computed, grads[len(wanted):-1]) if g is not None]
        return grads[:len(wanted)]

    def weight_pass(self, key: tuple[int, int]) -> None:
        """W of micro-batch ``key``: each parameter's gradient (a deferred product computed now, summed
        where a parameter has more than one part) accumulated by autograd, which runs its hooks."""
        order, parts = self._order.pop(key), {}
        del self._operands[key]
        for param, grad in self._work.pop(key):
            value = grad() if callable(grad) else grad
            parts[param] = value if param not in parts else parts[param] + value
        for param in sorted(parts, key=lambda p: order.get(p, len(order))):
            _accumulate(param, parts.pop(param))

    def pending(self) -> int:
        """Micro-batches whose W has not run (none once a step ends)."""
        return len(self._work)
