"""A chunked kernel's check against its recurrence: each fp32 result against the fp64 value of the same
inputs. fp32 rounding alone moves the recurrence itself up to ~5e-7 of scale from that value (the delta
rule's and the SSD scan's gradients, measured), so a bound between two fp32 evaluations would test
rounding on the CPU at hand, not the algebra."""

import torch


def with_gradients(out: torch.Tensor, inputs, upstream: torch.Tensor) -> list[torch.Tensor]:
    """[``out``, its gradient with respect to each of ``inputs``] for the upstream gradient ``upstream``
    (taken in ``out``'s dtype, so that one draw serves the fp32 and the fp64 evaluation)."""
    return [out, *torch.autograd.grad(out, inputs, upstream.to(out.dtype))]


def assert_near(got, truth, tolerance: float, names, label: str) -> None:
    """Each tensor of ``got`` within ``tolerance`` of its ``truth``'s largest magnitude (an all-zero
    truth, such as one token's decay gradient, must be met exactly)."""
    for name, mine, theirs in zip(names, got, truth):
        scale = theirs.abs().max().clamp_min(1e-30)
        error = ((mine.double() - theirs.double()).abs().max() / scale).item()
        assert error <= tolerance, (label, name, mine.dtype, error)
