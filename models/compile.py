"""``--compile``: each transformer layer compiled on its own (as torchtitan compiles per block), the
prediction depths' layers too, and the loss head (final norm, output layer, cross entropy).

Only a layer's ``forward`` is compiled, never its ``__call__``: module hooks (ZeRO-3's gathers and
frees, the pipeline's and recompute's runners around layers) stay eager, and the parameters stay the
module's own (their names, their storage that ZeRO-3 frees and gathers again). Inside a layer the
communication and what keeps Python state around it (the tensor-parallel collectives, context-parallel
attention, selective recompute's checkpoint) are ``parallel.comm.compile_boundary``s: a compiled region
ends before each and the next begins after it, so a layer at tp = 1 without cp is one graph, and with
collectives one graph per stretch of computation between them. ``CompileReport`` counts the graphs and
every graph break with its reason, so that a break anywhere else is seen (the tests require none).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch import nn


def compile_layers(chunks: nn.ModuleList, backend: str = "inductor") -> None:
    """Compile the forward of every transformer layer of ``chunks`` (``GPTModel``s; their prediction depths'
    too) and of the last chunk's loss head with ``backend`` (torch.compile's: inductor, aot_eager, ...).
    Compilation happens at the first call, per shape; the layers share their compiled code."""
    # a model's layers differ in what guards check (windowed or global attention, grad mode under full
    # recompute): room for each variant, so that no layer falls back to eager for want of a cache entry
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if backend == "inductor" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        # ATen's portable kernels asked for (ATEN_CPU_CAPABILITY=default): inductor's C++ made portable too
        # (it vectorized for this CPU while its headers, built for "default", had no vector types)
        from torch._inductor import config as inductor

        inductor.cpp.simdlen = 1
    for chunk in chunks:
        for layer in chunk.layers_with_depths():
            layer.forward = torch.compile(layer.forward, backend=backend)
        if chunk.post_process:
            chunk.head = torch.compile(chunk.head, backend=backend)


@dataclass(frozen=True)
class CompileReport:
    """What torch.compile made in this process so far: the distinct graphs, and each graph break's reason
    with its count. Owns a snapshot of dynamo's counters; never compiles."""

    graphs: int
    breaks: dict[str, int]

    @staticmethod
    def now() -> CompileReport:
        from torch._dynamo.utils import counters

        return CompileReport(int(counters["stats"]["unique_graphs"]), dict(counters["graph_break"]))

    def unexpected_breaks(self) -> dict[str, int]:
        """The breaks that no ``compile_boundary`` explains (a call torch.compile could not trace)."""
        return {reason: count for reason, count in self.breaks.items() if not _at_boundary(reason)}

    def describe(self) -> str:
        at_boundaries = sum(count for reason, count in self.breaks.items() if _at_boundary(reason))
        unexpected = collections.Counter(self.unexpected_breaks())
        return (f"{self.graphs} graphs, {at_boundaries} graph breaks at communication boundaries"
                + (f", {sum(unexpected.values())} elsewhere: "
                   + "; ".join(f"{_summary(reason)} (x{count})" for reason, count in unexpected.items())
                   if unexpected else ", none elsewhere"))


def _summary(reason: str) -> str:
    """A graph break's reason in one line: its title and explanation."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    explanation = next((line for line in lines if line.startswith("Explanation:")), "")
    return f"{lines[0]}: {explanation[len('Explanation:'):].strip()[:160]}" if explanation else lines[0][:200]


def _at_boundary(reason: str) -> bool:
    """Whether a graph break's reason is a call of a ``torch.compiler.disable``d function."""
    return "disable" in reason
