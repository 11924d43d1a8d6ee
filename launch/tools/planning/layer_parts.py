"""What each layer-registry entry (``models.layers.registry``) is made of, as the planner prices it: its
sublayers, each behind its own pre-norm. A test holds this table to the registry, so a new layer kind
cannot go unpriced."""

from __future__ import annotations

SUBLAYERS = {"*": ("attention",), "+": ("attention",), "-": ("mlp",), "E": ("moe",), "M": ("mamba",),
             "*-": ("attention", "mlp"), "*E": ("attention", "moe"), "+-": ("attention", "mlp"),
             "+E": ("attention", "moe")}

# the --recompute-modules name that recomputes a sublayer whole (its checkpoint keeps its pre-norm's output)
RECOMPUTED_WHOLE = {"mlp": "mlp", "mamba": "mamba"}
