"""Megatron-LM's hybrid layer pattern (``--hybrid-layer-pattern``), parsed as its
``hybrid_layer_allocation`` parses it; no torch here.

A pattern is ``main ('/' mtp)*`` and ``main`` is ``segment ('|' segment)*``. Each layer symbol is one
layer with its own pre-norm and residual: ``M`` Mamba-2, ``G`` gated delta net, ``K`` Kimi delta
attention (this build's symbol: Megatron-LM has no such layer), ``*`` attention, ``D`` DeepSeek sparse
attention, ``+`` latent attention, ``-`` MLP, ``E`` mixture of experts. ``|`` cuts the
main part into pipeline segments (virtual stages in a micro-batch's path); every part after a ``/`` is
one multi-token-prediction depth, all of them alike. Neither ``|`` nor ``/`` is a layer.
Which symbols this build can construct is the layer registry's business (``models.layers.registry``).
"""

from __future__ import annotations

from dataclasses import dataclass

SYMBOLS = {"M": "Mamba-2", "G": "gated delta net", "K": "Kimi delta attention", "*": "attention",
           "D": "DeepSeek sparse attention", "+": "latent attention", "-": "MLP", "E": "mixture of experts"}
PIPE, MTP = "|", "/"
ATTENTION_KINDS = ("*", "D", "+")  # one kind of attention per model


@dataclass(frozen=True)
class ParsedPattern:
    """A pattern's parts. ``layers``: the main part's symbols in order (``|`` left out), one layer each;
    ``segments``: the main part cut at ``|`` (one, uncut, without a ``|``); ``mtp``: the layers of one
    multi-token-prediction depth ('' without); ``depths``: how many depths."""

    text: str
    layers: str
    segments: tuple[str, ...]
    mtp: str
    depths: int

    @property
    def cut(self) -> bool:
        """Whether the pattern places the pipeline cuts itself (it has a ``|``)."""
        return len(self.segments) > 1

    @property
    def uncut(self) -> str:
        """The pattern without its pipeline cuts: the model it describes whatever the layout."""
        return self.text.replace(PIPE, "")


def parse_pattern(text: str, flag: str = "--hybrid-layer-pattern") -> ParsedPattern:
    """Parse ``text``; ValueError naming ``flag`` and what is wrong with it."""
    shown = f"{flag} {text!r}"
    stray = sorted({char for char in text if char not in SYMBOLS and char not in (PIPE, MTP)})
    if stray:
        valid = ", ".join(f"{symbol} ({name})" for symbol, name in SYMBOLS.items())
        raise ValueError(f"{shown}: {''.join(stray)!r} is not a layer symbol; the symbols are {valid}, "
                         f"with {PIPE} between pipeline segments and {MTP} before each "
                         "multi-token-prediction depth")
    main, *depths = text.split(MTP)
    if any(PIPE in depth for depth in depths):
        raise ValueError(f"{shown}: a multi-token-prediction depth (after {MTP}) holds no pipeline cut "
                         f"({PIPE}): its layers sit with the output layer on the last stage")
    if len(set(depths)) > 1:
        raise ValueError(f"{shown}: its multi-token-prediction depths {depths} differ; every depth after "
                         f"{MTP} has the same layers")
    mtp = depths[0] if depths else ""
    layers = main.replace(PIPE, "")
    if not layers:
        raise ValueError(f"{shown}: the main part (before any {MTP}) holds no layer")
    kinds = [kind for kind in ATTENTION_KINDS if kind in layers + mtp]
    if "*" in kinds and len(kinds) > 1:
        others = " and ".join(f"{k!r} ({SYMBOLS[k]})" for k in kinds[1:])
        raise ValueError(f"{shown}: '*' (attention) beside {others}: a model has one kind of attention")
    return ParsedPattern(text, layers, tuple(main.split(PIPE)), mtp, len(depths) if mtp else 0)
