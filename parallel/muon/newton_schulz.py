"""Newton-Schulz orthogonalization as Muon runs it: the coefficient sets Megatron-LM's Muon names, the
precisions it runs them in, and the update scales of its scale modes.

``newton_schulz`` takes one whole 2-D matrix and returns an approximation of its polar factor ``U V^T``
(singular values driven towards 1), in fp32. It never communicates and never holds state.
"""

from __future__ import annotations

import contextlib
import math

import torch

# (a, b, c) per iteration, as published: Keller Jordan's single set ("simple", torch.optim.Muon's default),
# the per-iteration quintic sets of modded-nanogpt ("quintic", Megatron's default), Polar Express
# (arXiv 2505.16932), CANS (Remez with an adaptive interval), AOL-preconditioned Turbo-Muon's, and
# DeepSeek-V4's eight simple steps then two that settle at 1
COEFFICIENT_SETS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
    "cans": ((8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)),
    "aol": ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)),
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
}
# the sets whose last one repeats past their end (the others start again from their first)
REPEATING_LAST = ("polar_express", "cans", "deepseekv4")
SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
# "torch": torch.optim.Muon's (bf16 from the start, normalised in bf16); Megatron's --muon-fp32-matmul-prec:
# "medium" (normalised in fp32, iterated in bf16), "high" (fp32 under TF32 matmuls), "highest" (fp32)
PRECISIONS = ("medium", "high", "highest", "torch")


def iteration_coefficients(kind, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of ``steps`` iterations of ``kind``, a name of ``COEFFICIENT_SETS`` or the sets
    themselves (torch.optim.Muon's ``ns_coefficients``), as emerging_optimizers (Megatron's Muon) takes
    them: past its end a set list starts again from its first, except ``REPEATING_LAST``'s."""
    if steps < 1:
        raise ValueError(f"--muon-num-ns-steps must be at least 1, got {steps}")
    if isinstance(kind, str):
        if kind not in COEFFICIENT_SETS:
            raise ValueError(f"--muon-coefficient-type {kind!r} is not one of {', '.join(COEFFICIENT_SETS)}")
        sets = list(COEFFICIENT_SETS[kind])
    else:
        sets = [tuple(float(v) for v in one) for one in kind]
        if not sets:
            raise ValueError("Muon needs at least one set of Newton-Schulz coefficients")
    if kind in REPEATING_LAST:
        return (sets + sets[-1:] * steps)[:steps]
    return (sets * (steps // len(sets) + 1))[:steps]


@contextlib.contextmanager
def _matmul_precision(precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def newton_schulz(x: torch.Tensor, coefficients: list[tuple[float, float, float]], eps: float = 1e-7,
                  precision: str = "medium") -> torch.Tensor:
    """The orthogonalized ``x`` (2-D, any dtype): divided by its Frobenius norm (at least ``eps``), then one
    quintic step ``X <- a X + (b A + c A^2) X``, ``A = X X^T``, per coefficient set, on the short side
    (a tall matrix is transposed and back). Returns fp32 of ``x``'s shape."""
    if x.ndim != 2:
        raise ValueError(f"Newton-Schulz takes a 2-D matrix, got shape {tuple(x.shape)}")
    tall = x.size(0) > x.size(1)
    if precision == "torch":
        y = x.bfloat16()
        y = y.T if tall else y
        y = y / y.norm().clamp(min=eps)
    else:
        y = x.float()
        y = y.T if tall else y
        y = y / y.norm().clamp(min=eps)
        if precision == "medium":
            y = y.bfloat16()
    with _matmul_precision("high") if precision == "high" else contextlib.nullcontext():
        for a, b, c in coefficients:
            gram = y @ y.T
            y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    y = y.float()
    return y.T if tall else y


def scale_factor(rows: int, columns: int, mode: str) -> float:
    """The factor on an orthogonalized ``rows`` x ``columns`` update (Megatron's --muon-scale-mode):
    spectral sqrt(max(rows, columns)) (x 0.2 is Moonlight's AdamW-matching RMS, torch's "match_rms_adamw"),
    shape_scaling sqrt(max(1, rows / columns)) (Keller Jordan's, torch's "original"), unit_rms_norm
    sqrt(rows / columns)."""
    if mode == "spectral":
        return math.sqrt(max(rows, columns))
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / columns))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / columns)
    raise ValueError(f"--muon-scale-mode {mode!r} is not one of {', '.join(SCALE_MODES)}")


def newton_schulz_flops(rows: int, columns: int, steps: int) -> int:
    """Multiply-adds x 2 of ``steps`` iterations on a ``rows`` x ``columns`` matrix (short side s, long l):
    per step X X^T (2 s^2 l), A A (2 s^3) and B X (2 s^2 l)."""
    short, long = min(rows, columns), max(rows, columns)
    return steps * (4 * short * short * long + 2 * short ** 3)
