"""IsoFLOP sweeps: model sizes trained to fixed compute budgets (``mode: isoflop`` in a sweep file).

Each run trains ``budget / (flops_per_token x tokens_per_step)`` iterations, rounded, so that its
training FLOPs meet the budget; a size whose run would take fewer than ``min_iters`` (the FLOPs would
miss the budget by more than the rounding allows) or more than ``max_iters`` iterations is skipped and
said. Sizes are listed (``models``) or generated from a depth/width rule::

    sizes: {layers: [1, 2, 3, 4, 6], width_per_layer: 32, head_dim: 16}   # hidden = layers x 32

or, for hybrid models, from a ``--hybrid-layer-pattern`` repeated ``layers`` times, so that every size
keeps its proportions of Mamba-2, attention and MLP layers::

    sizes: {layers: [1, 2, 4], width_per_layer: 64, head_dim: 16, pattern: "M-M*-"}   # "M-M*-" x L
    common: {mamba_head_dim: 16, mamba_num_groups: 1, mamba_state_dim: 16}  # Mamba shapes that fit 64

The FLOPs are the project's own count (``FLOPS_FORMULA``), the same as the metrics' TFLOP/s.
"""

from __future__ import annotations

from models.counting import flops_per_token
from models.config import GPTConfig

FLOPS_FORMULA = ("training FLOPs = tokens x models.counting.flops_per_token = tokens x 3 x (2 x every matmul "
                 "weight, the output layer's included, + each layer's sequence mixing: 4 x seq_length x "
                 "heads x head_dim for attention's scores and weighted sum, a Mamba-2 layer's convolution "
                 "and scan)")


def generated_models(sizes: dict) -> dict[str, dict]:
    """{name: model flags} of a depth/width rule: hidden = layers x width_per_layer, heads of head_dim; with
    a ``pattern``, the model is the pattern repeated ``layers`` times."""
    width, head_dim, pattern = sizes.get("width_per_layer"), sizes.get("head_dim", 64), sizes.get("pattern")
    if not sizes.get("layers") or not width:
        raise ValueError("sizes: give layers: [L, ...] and width_per_layer: W (hidden = L x W)")
    models = {}
    for layers in sizes["layers"]:
        hidden = layers * width
        if hidden % head_dim:
            raise ValueError(f"sizes: hidden {hidden} ({layers} layers x {width}) is not a multiple of "
                             f"head_dim {head_dim}")
        shape = {"hidden_size": hidden, "num_attention_heads": hidden // head_dim}
        if pattern:
            models[f"{layers}p-{hidden}"] = {"hybrid_layer_pattern": pattern * layers, **shape}
        else:
            models[f"{layers}l-{hidden}"] = {"num_layers": layers, **shape}
    return models


def iterations_for(budget: float, config: GPTConfig, tokens_per_step: int) -> int:
    """The iterations whose training FLOPs come nearest ``budget``."""
    return max(round(budget / (flops_per_token(config) * tokens_per_step)), 1)


def plan_budget(budget: float, config: GPTConfig, tokens_per_step: int, min_iters: int,
                max_iters: int | None) -> tuple[int | None, str | None]:
    """(iterations, None) for a size that can meet ``budget``, else (None, why it is skipped)."""
    iters = iterations_for(budget, config, tokens_per_step)
    if iters < min_iters:
        return None, (f"{iters} iteration(s) < min_iters {min_iters} (the model is too large for this "
                      "budget; its FLOPs would miss it by more than rounding allows)")
    if max_iters is not None and iters > max_iters:
        return None, f"{iters} iterations > max_iters {max_iters} (the model is too small for this budget)"
    return iters, None
