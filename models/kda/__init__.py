"""Kimi delta attention (``K`` in ``--hybrid-layer-pattern``): the gated delta rule with a decay per key
channel made by a low-rank projection, as Kimi Linear has it."""
