"""Rotary position embeddings (RoPE): the first ``rotary_channels`` of each head turn by position."""

from __future__ import annotations

import torch

from models.config import GPTConfig
from models.rope_scaling import inverse_frequencies


class RotaryFrequencies:
    """The inverse frequencies and attention factor of a model's rotary positions, computed once per
    input length regime, device and kind (global, or the sliding-window layers' own base) and kept.

    Owns those small tensors only; never sees activations. The length matters to ``dynamic`` and
    ``longrope`` scaling alone, which pick their frequencies by the whole input's length as transformers
    does; for the other kinds every length shares one entry."""

    def __init__(self, config: GPTConfig):
        self.config = config
        self._computed: dict[tuple, tuple[torch.Tensor, float]] = {}

    def __call__(self, length: int, device: torch.device, local: bool = False) -> tuple[torch.Tensor, float]:
        regime = length if self.config.rope_scaling in ("dynamic", "longrope") and not local else None
        key = (regime, str(device), local)
        if key not in self._computed:
            self._computed[key] = inverse_frequencies(self.config, length, device, local)
        return self._computed[key]


def rotary_tables(config: GPTConfig, positions: torch.Tensor, dtype: torch.dtype = torch.float32,
                  frequencies: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles for ``positions`` [b, s] -> each [s, b, 1, rotary_channels], computed
    in fp32 and given in ``dtype`` (the activations', as Megatron and Hugging Face apply them).

    Channel pair (i, i + r/2) of the r rotated channels turns by position / base^(2i/r) (Megatron's and
    Hugging Face Llama's layout), or pair (2i, 2i + 1) with --rotary-interleaved (RoFormer's); the
    frequencies (``frequencies``, else those of a whole input of s tokens) scaled as
    ``--rope-scaling-type`` says (``models.rope_scaling``), yarn's and longrope's attention factor
    multiplying both tables as transformers does."""
    if frequencies is None:
        frequencies = inverse_frequencies(config, positions.shape[1], positions.device)
    inverse, attention_factor = frequencies
    angles = positions.t().float().unsqueeze(-1) * inverse  # [s, b, r/2]
    angles = (angles.repeat_interleave(2, dim=-1) if config.rotary_interleaved
              else torch.cat([angles, angles], dim=-1)).unsqueeze(2)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """Turn the first channels of ``x`` [s, b, heads, d] by the tables; the others pass through."""
    rotated = cos.shape[-1]
    turning, passing = (x, None) if rotated == x.shape[-1] else (x[..., :rotated], x[..., rotated:])
    if interleaved:
        even, odd = turning[..., 0::2], turning[..., 1::2]
        partner = torch.stack([-odd, even], dim=-1).flatten(-2)
    else:
        first, second = turning.chunk(2, dim=-1)
        partner = torch.cat([-second, first], dim=-1)
    turned = turning * cos + partner * sin
    return turned if passing is None else torch.cat([turned, passing], dim=-1)
