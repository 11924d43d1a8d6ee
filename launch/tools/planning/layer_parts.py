"""What each layer-registry entry (``models.layers.registry``) is made of, as the planner prices it: its
sublayers, each behind its own pre-norm. A test holds this table to the registry, so a new layer kind
cannot go unpriced."""

from __future__ import annotations

SUBLAYERS = {"*": ("attention",), "+": ("attention",), "-": ("mlp",), "E": ("moe",), "M": ("mamba",),
             "G": ("gdn",), "K": ("kda",),
             "*-": ("attention", "mlp"), "*E": ("attention", "moe"), "+-": ("attention", "mlp"),
             "+E": ("attention", "moe")}

# the --recompute-modules name under which "layernorm" keeps a sublayer's pre-norm output (its checkpoint's
# input): a dense MLP's or a MoE layer's with "mlp" (as measured), a Mamba-2 mixer's with "mamba"
RECOMPUTED_WHOLE = {"mlp": "mlp", "moe": "mlp", "mamba": "mamba"}
