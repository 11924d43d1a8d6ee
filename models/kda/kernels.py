"""The delta rule a Kimi delta attention layer calls, from its convolution's q and k (L2-normalised here)
and the inputs of its gates: flash-linear-attention's ``chunk_kda`` (what Kimi Linear's code calls; its own
L2 norm) where installed, the tensors on a GPU and in half precision (``pip install .[mamba]``), else the
PyTorch chunked form of ``models.gdn.delta_rule`` with a decay per channel, which keeps only its inputs
and redoes the rest in backward. ``DELTA_RULE_BACKEND`` forces a choice, as for gated delta nets.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from models.gdn.delta_rule import chunked_delta_rule
from models.gdn.kernels import delta_rule_backend, fla_rule, l2_normalised
from models.linear_mixing.recomputed import Recomputed
from parallel.comm import compile_boundary

# the reference's chunk: its pairwise decays are [chunk, chunk, dk] per chunk and head (exact, not lean)
CHUNK = 16


def kimi_gates(f, b, A_log, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """The log decay of every key channel, g = -exp(A_log[head]) softplus(f + dt_bias) (f [b, S, H, dk],
    dt_bias [H dk]), and beta = sigmoid(b) ([b, S, H]), in fp32."""
    heads, channels = f.shape[-2:]
    g = -torch.exp(A_log.float())[:, None] * F.softplus(f.float() + dt_bias.float().view(heads, channels))
    return g, torch.sigmoid(b.float())


def _fla(q, k, v, f, b, A_log, dt_bias, scale, documents):
    g, beta = kimi_gates(f, b, A_log, dt_bias)
    rule = importlib.import_module("fla.ops.kda").chunk_kda
    return fla_rule(rule, q, k, v, g, beta.to(v.dtype), scale, documents)


def _rule_of(q, k, v, f, b, A_log, dt_bias, scale, documents):
    return chunked_delta_rule(l2_normalised(q), l2_normalised(k), v, *kimi_gates(f, b, A_log, dt_bias), scale,
                              CHUNK, documents)


def _reference(q, k, v, f, b, A_log, dt_bias, scale, documents):
    return Recomputed.apply(_rule_of, (scale, documents), q, k, v, f, b, A_log, dt_bias)


BACKENDS = {"fla": _fla, "reference": _reference}


@compile_boundary  # a kernel launch, or the reference's own autograd function
def kimi_delta_rule(q, k, v, f, b, A_log, dt_bias, scale: float, documents=None) -> torch.Tensor:
    """o of Kimi delta attention's rule: q, k [b, S, H, dk] before their L2 norm, v [b, S, H, dv], the
    decay's input f [b, S, H, dk] and beta's b [b, S, H] (``kimi_gates`` makes g and beta), by the backend
    ``delta_rule_backend`` picks, in ``v``'s dtype."""
    return BACKENDS[delta_rule_backend(v.device, v.dtype)](q, k, v, f, b, A_log, dt_bias, scale,
                                                            documents).to(v.dtype)
