"""How close a run must come to its reference, and the checks that every parity test shares.

The bounds follow from fp32 arithmetic, not from one machine: torch picks its kernels per CPU
(``ATEN_CPU_CAPABILITY`` default, avx2, avx512) and each rounds differently, so a bound must hold
for any summation order that a kernel may choose.

- ``TRAJECTORY_RTOL`` (1e-5, relative, at every iteration): two runs that add the same numbers in
  another order (another dp / tp / pp layout, another ZeRO stage: a reduce-scatter instead of an
  all-reduce, a gradient norm summed from shards, a re-cut checkpoint) start a few fp32 ulps
  (2^-24 = 6e-8) apart, and every optimizer step feeds the difference back into the weights. Over the
  10-20 iterations of the tests it grows to at most 9e-7 on avx2 and on default kernels, and reached
  1.2e-6 on an AVX-512 machine: 1e-5 is the bound the project states, with room above all three.
- ``ONE_STEP_RTOL`` (1e-6): one forward and backward, no optimizer step in between, in another
  order (tensor-parallel partial sums against the whole matmul). Each result is a handful of
  reductions of a few hundred terms, whose rounding differences stay near sqrt(n) ulps: at most
  1.7e-7 measured. Recompute and export meet it with no difference at all (they replay the same
  kernels), but keep this bound: a BLAS may block a matmul by the alignment of its buffers.
- ``FP8_LOSS_RTOL`` (5e-2, relative, at every iteration): a run whose linear products are fp8 (torchao,
  emulated) against its bf16 run. This is not a summation-order bound: e4m3 keeps 3 mantissa bits (an
  element rounds by up to 2^-4 = 6%), e5m2 gradients 2 bits (12.5%). The rounding is unbiased and averages
  over each product's terms and the loss's tokens, so the loss moves little at once, but every step feeds
  it back and the trajectory wanders from bf16's as bf16's own layouts wander from each other (bf16 pp2
  against dp2: 0.8% at worst over 100 iterations of the test's model; fp8: 1.7% at worst, 0.4-0.6% on
  average). 5e-2 stands 3x above; a wrong scale saturates or flushes to zero and misses it at once.
- Exact (``==``, ``torch.equal``), never through this module: only where both runs execute the same
  kernels on the same shapes and values in the same order, so that no rounding can differ: a
  resumed run against the straight one, offload against memory, one layout launched two ways.

``PARITY_MARGINS=FILE`` appends, per check, the worst observed error as a fraction of its bound,
one JSON line each: how near each test came to failing on this CPU.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch

TRAJECTORY_RTOL = 1e-5
ONE_STEP_RTOL = 1e-6
FP8_LOSS_RTOL = 5e-2


def _record(what: str, worst: float, rtol: float) -> None:
    path = os.environ.get("PARITY_MARGINS")
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps({"check": what, "worst": worst, "rtol": rtol,
                                     "capability": torch.backends.cpu.get_cpu_capability()}) + "\n")


def relative_error(got: float, want: float) -> float:
    return abs(got - want) / abs(want) if want else abs(got)


def assert_trajectory_close(got: Sequence[float], want: Sequence[float], what: str,
                            rtol: float = TRAJECTORY_RTOL) -> None:
    """``got[i]`` within ``rtol`` of ``want[i]`` (relative) at every iteration, and equally long."""
    assert len(got) == len(want), f"{what}: {len(got)} iterations vs {len(want)} in the reference"
    errors = [relative_error(a, b) for a, b in zip(got, want)]
    _record(what, max(errors, default=0.0) / rtol, rtol)
    for i, (a, b, error) in enumerate(zip(got, want, errors)):
        assert error <= rtol, (f"{what} at iteration {i + 1}: {a} vs reference {b} "
                               f"(relative {error:.2e} > {rtol:g})")


def assert_tensors_close(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], what: str,
                         rtol: float = TRAJECTORY_RTOL) -> None:
    """Each tensor within ``rtol`` of its reference, measured against the reference's largest entry
    (an entry near zero carries the rounding of the whole tensor, so an entry-wise relative bound
    would measure luck)."""
    assert len(got) == len(want), f"{what}: {len(got)} tensors vs {len(want)}"
    errors = []
    for a, b in zip(got, want):
        assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        scale = b.abs().max().item()
        errors.append((a - b).abs().max().item() / scale if scale else a.abs().max().item())
    _record(what, max(errors, default=0.0) / rtol, rtol)
    for index, error in enumerate(errors):
        assert error <= rtol, (f"{what}: tensor {index} differs by {error:.2e} of its largest entry "
                               f"(> {rtol:g})")


def assert_within(error: float, what: str, rtol: float) -> None:
    """An error the test measured itself (relative) is within ``rtol``."""
    _record(what, error / rtol, rtol)
    assert error <= rtol, f"{what}: relative error {error:.2e} > {rtol:g}"


def summarize(path: str) -> list[str]:
    """The worst fraction of its bound that each check reached, worst first, from a PARITY_MARGINS file."""
    worst: dict[str, dict] = {}
    with open(path) as handle:
        for line in handle:
            row = json.loads(line)
            if row["check"] not in worst or row["worst"] > worst[row["check"]]["worst"]:
                worst[row["check"]] = row
    rows = sorted(worst.values(), key=lambda row: -row["worst"])
    return [f"{row['worst']:7.3f} of rtol {row['rtol']:g} ({row['capability']}): {row['check']}"
            for row in rows]


if __name__ == "__main__":
    import sys

    print("\n".join(summarize(sys.argv[1])[:int(sys.argv[2]) if len(sys.argv) > 2 else None]))


# Dropout draws from per-rank streams (tp ranks and pipeline stages differ), so a run compared with
# another layout leaves it out, as Megatron's defaults (0.1) would otherwise put it in.
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
NO_DROPOUT_FLAGS = ["--hidden-dropout", "0", "--attention-dropout", "0"]
