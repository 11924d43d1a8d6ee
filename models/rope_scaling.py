"""Rotary frequency scaling for contexts longer than a model was first trained on.

The kinds are transformers' ``rope_type`` values, computed from the config and the length of the whole
input (``models.rotary.RotaryFrequencies`` keeps them; never per forward):
- ``linear``: every frequency divided by the factor (position interpolation).
- ``dynamic``: NTK scaling of the base at the input's length against
  ``--rope-original-max-position-embeddings`` (as transformers does for a model's first input of that
  length; below the original length it changes nothing).
- ``yarn``: interpolation for the low frequencies, extrapolation for the high ones, a linear ramp
  between the correction dims of ``beta_fast`` / ``beta_slow``, and an attention factor that scales
  cos and sin.
- ``llama3``: Llama 3.1's piecewise rule (low / high frequency factors at the original length).
- ``longrope``: a factor per frequency (Phi-3), the long ones when the input is longer than the
  original length, else the short ones, and its attention factor.

The sliding-window layers of a model with ``--rotary-base-local`` (Gemma 3) turn by plain frequencies of
that base.
"""

from __future__ import annotations

import math

import torch

from models.config import GPTConfig

def _plain(base: float, rotated: int, device=None) -> torch.Tensor:
    """1 / base^(2i / r) for the r / 2 channel pairs."""
    return 1.0 / (base ** (torch.arange(0, rotated, 2, dtype=torch.int64, device=device).float() / rotated))


def _yarn(config: GPTConfig, rotated: int, device) -> tuple[torch.Tensor, float]:
    factor, original = config.rope_scaling_factor, config.rope_original_max_position_embeddings
    base = config.rotary_base

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention = config.rope_attention_factor
    if attention is None:
        attention = (mscale(factor, config.rope_mscale) / mscale(factor, config.rope_mscale_all_dim)
                     if config.rope_mscale and config.rope_mscale_all_dim else mscale(factor))

    def correction_dim(rotations: float) -> float:
        return rotated * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(config.rope_beta_fast), correction_dim(config.rope_beta_slow)
    if config.rope_yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotated - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(rotated // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    powers = base ** (torch.arange(0, rotated, 2, device=device).float() / rotated)
    extrapolated = 1 - ramp
    inverse = (1.0 / (factor * powers)) * (1 - extrapolated) + (1.0 / powers) * extrapolated
    return inverse, float(attention)


def _llama3(config: GPTConfig, inverse: torch.Tensor) -> torch.Tensor:
    factor, original = config.rope_scaling_factor, config.rope_original_max_position_embeddings
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    wavelength = 2 * math.pi / inverse
    scaled = torch.where(wavelength > original / low, inverse / factor, inverse)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < original / high) * ~(wavelength > original / low)
    return torch.where(medium, smoothed, scaled)


def _longrope(config: GPTConfig, rotated: int, length: int, device) -> tuple[torch.Tensor, float]:
    original = config.rope_original_max_position_embeddings
    factor = config.rope_scaling_factor
    attention = config.rope_attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = config.rope_long_factor if length > original else config.rope_short_factor
    shape = torch.arange(0, rotated, 2, dtype=torch.int64, device=device).float() / rotated
    factors = torch.tensor(factors, dtype=torch.float32, device=device)
    return 1.0 / (factors * config.rotary_base ** shape), float(attention)


def inverse_frequencies(config: GPTConfig, length: int, device=None,
                        local: bool = False) -> tuple[torch.Tensor, float]:
    """(the r / 2 inverse frequencies, the factor cos and sin are scaled by) of ``config``'s rotary
    positions for an input of ``length`` tokens, scaled as ``config.rope_scaling`` says; ``local``: those
    of the sliding-window layers' own base."""
    rotated, kind = config.rotary_channels, config.rope_scaling
    if local:
        return _plain(config.rotary_base_local, rotated, device), 1.0
    if kind == "none":
        return _plain(config.rotary_base, rotated, device), 1.0
    if kind == "linear":
        return _plain(config.rotary_base, rotated, device) / config.rope_scaling_factor, 1.0
    if kind == "dynamic":
        original, factor = config.rope_original_max_position_embeddings, config.rope_scaling_factor
        length = max(length, original)
        base = config.rotary_base * ((factor * length / original) - (factor - 1)) ** (rotated / (rotated - 2))
        return _plain(base, rotated, device), 1.0
    if kind == "yarn":
        return _yarn(config, rotated, device)
    if kind == "llama3":
        return _llama3(config, _plain(config.rotary_base, rotated, device)), 1.0
    return _longrope(config, rotated, length, device)
