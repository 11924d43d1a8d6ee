"""MXFP4 expert weights of gpt-oss checkpoints, dequantized the way transformers does it.

A quantized weight ``W`` is stored as two uint8 tensors: ``W_blocks`` [E, rows, G, 16], each byte two FP4
(E2M1) values with the low nibble first, and ``W_scales`` [E, rows, G], one E8M0 exponent (bias 127) per
block of 32 values. Unpacked, a row holds G * 32 values; transformers then swaps the last two dims, so the
result is [E, G * 32, rows]: ``gate_up_proj_blocks`` [E, 2 * inter, hidden / 32, 16] gives GptOssExperts'
``gate_up_proj`` [E, hidden, 2 * inter] and ``down_proj_blocks`` [E, hidden, inter / 32, 16] its
``down_proj`` [E, inter, hidden]. Each value is E2M1 * 2 ** (scale - 127) worked out exactly (in fp64)
and rounded once to the dtype asked for (inf past its range), which is what transformers'
``convert_moe_packed_tensors`` returns (torch.ldexp) bit for bit. Like it, a scale byte of 255 (E8M0's NaN)
is read as 2 ** 128, not as NaN.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

QUANTIZED_SUFFIXES = ("_blocks", "_scales")

# FP4 E2M1 by its 4-bit code: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is
# subnormal (0 or 0.5).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _label(name: str | None, suffix: str) -> str:
    return f"{name}{suffix}" if name else f"MXFP4 {suffix.lstrip('_')}"


def _scale_factors(scales: torch.Tensor) -> torch.Tensor:
    """2 ** (s - 127) in fp64 for each E8M0 byte s, exact: built as the fp64 exponent field, bias 1023."""
    return ((scales.to(torch.int64) + (1023 - 127)) << 52).view(torch.float64)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                     name: str | None = None) -> torch.Tensor:
    """The weight [E, G * 32, rows] of MXFP4 ``blocks`` [E, rows, G, 16] and ``scales`` [E, rows, G] (both
    uint8), in ``dtype``: transformers' layout (the unpacked [E, rows, G * 32] with its last two dims
    swapped). ``name`` (the dequantized tensor's name) labels the errors; the tensors are validated as
    untrusted input: ValueError for a wrong dtype, rank, block width or a scales shape that does not match."""
    for tensor, suffix in ((blocks, "_blocks"), (scales, "_scales")):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{_label(name, suffix)} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.dtype != torch.uint8:
            raise ValueError(f"{_label(name, suffix)} has dtype {tensor.dtype}; MXFP4 stores torch.uint8")
    if dtype not in _DTYPES:
        raise ValueError(f"cannot dequantize {name or 'MXFP4 weight'} to {dtype}; use one of "
                         f"{', '.join(str(d) for d in _DTYPES)}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16:
        raise ValueError(f"{_label(name, '_blocks')} has shape {tuple(blocks.shape)}; MXFP4 expert "
                         "blocks are [experts, rows, groups, 16] (16 bytes = 32 FP4 values per group)")
    if scales.shape != blocks.shape[:-1]:
        raise ValueError(f"{_label(name, '_scales')} has shape {tuple(scales.shape)}; its blocks "
                         f"{tuple(blocks.shape)} need {tuple(blocks.shape[:-1])} (a scale per 16-byte group)")

    experts, rows, groups, _ = blocks.shape
    device = blocks.device
    nibbles = torch.tensor(_E2M1, dtype=torch.float64, device=device)
    pairs = torch.stack((nibbles.repeat(16), nibbles.repeat_interleave(16)), dim=-1)  # byte -> (low, high)
    factors = _scale_factors(scales.to(device))
    out = torch.empty(experts, groups * 32, rows, dtype=dtype, device=device)
    for e in range(experts):  # one expert at a time bounds the temporaries
        values = pairs.index_select(0, blocks[e].reshape(-1).int()).view(rows, groups, 32)
        values.mul_(factors[e].unsqueeze(-1))  # exact: 2 significant bits, exponents -128..130
        out[e].copy_(values.view(rows, groups * 32).t())  # the only rounding, to dtype
    return out


def quantized_pairs(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Each MXFP4 weight among a checkpoint's tensor ``names``: its dequantized name (``X`` for ``X_blocks``)
    -> (``X_blocks``, ``X_scales``). ValueError names the key for a ``_blocks`` without its ``_scales`` (or
    the reverse), and for an ``X`` stored both plain and quantized."""
    present = set(names)
    pairs: dict[str, tuple[str, str]] = {}
    for key in sorted(present):
        for suffix, other in (QUANTIZED_SUFFIXES, QUANTIZED_SUFFIXES[::-1]):
            if not key.endswith(suffix):
                continue
            base = key[: -len(suffix)]
            if not base or base.endswith("."):
                raise ValueError(f"checkpoint tensor {key!r} has an MXFP4 suffix but no weight name")
            if base + other not in present:
                raise ValueError(f"checkpoint tensor {key!r} has no {base + other!r}: MXFP4 weights need "
                                 "both their blocks and their scales")
            if base in present:
                raise ValueError(f"checkpoint holds {base!r} both plain and as MXFP4 {key!r}")
            pairs[base] = (base + QUANTIZED_SUFFIXES[0], base + QUANTIZED_SUFFIXES[1])
    return pairs
