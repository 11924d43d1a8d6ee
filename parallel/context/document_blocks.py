"""Document masking at flash speed: FlexAttention's block masks made from each token's document.

Packed sequences (``--reset-attention-mask``) attend within their documents. The dense way builds a
[b, 1, S, S] mask and runs attention over every tile of it; ``DocumentBlocks`` instead describes the
mask to FlexAttention by its blocks (empty: another document or the future, skipped; full; partial,
masked inside), so a packed sequence costs about what its documents' own causal attention costs and no
[S, S] mask exists. One mask per window (global layers, sliding-window layers), made once per forward
and shared by the layers.

Where a rank holds whole sequences (no context parallelism) on a device in ``DEVICES``, without
soft-capping or attention dropout (FlexAttention has neither here); elsewhere the dense mask of
``local_attention`` stays: on the CPU FlexAttention has no backward.
"""

from __future__ import annotations

import functools

import torch

DEVICES = ("cuda",)


@functools.cache
def _kernel(device_type: str):
    """FlexAttention, compiled where it runs for speed (its eager form is a reference implementation)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if device_type == "cuda" else flex_attention


class DocumentBlocks:
    """The block masks of one batch's documents ([b, S]: each token's document), one per window (keys a
    query sees, itself included; None: the whole past), and runs FlexAttention on them. Owns those masks;
    never decides where they are used (``usable`` answers, the attention layer asks)."""

    def __init__(self, documents: torch.Tensor, windows: set[int | None]):
        from torch.nn.attention.flex_attention import create_block_mask

        batch, length = documents.shape
        self.masks = {}
        for window in windows:
            def visible(b, h, query, key, window=window):
                seen = (query >= key) & (documents[b, query] == documents[b, key])
                return seen if window is None else seen & (query - key < window)

            self.masks[window] = create_block_mask(visible, batch, None, length, length,
                                                   device=documents.device,
                                                   _compile=documents.device.type == "cuda")

    @staticmethod
    def usable(device: torch.device, softcap: float | None, dropout: float) -> bool:
        """Whether attention on ``device`` with these options can run through the block masks."""
        return device.type in DEVICES and softcap is None and dropout == 0.0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
               scale: float) -> torch.Tensor:
        """softmax(q k^T scale | documents, causal, window) v: q [b, H, s, d], k and v [b, G, s, d]."""
        return _kernel(q.device.type)(q, k, v, block_mask=self.masks[window], scale=scale,
                                      enable_gqa=q.shape[1] != k.shape[1])
