"""The gated delta rule a gated delta net calls, from its convolution's q and k (L2-normalised and repeated
to the value heads here): flash-linear-attention's ``chunk_gated_delta_rule`` (what megatron-core and
transformers call; its own L2 norm) where it is installed and the tensors are on a GPU (``pip install
.[mamba]``), else the PyTorch chunked form (``models.gdn.delta_rule``), which keeps only its inputs for
backward (q and k as the convolution gave them) and redoes the norms, the repeat and its chunks there.
fla takes bf16 and fp16 only: an fp32 run on a GPU uses the reference. Documents go to the kernel as one
packed sequence cut at every document and batch row (its ``cu_seqlens``). ``DELTA_RULE_BACKEND``
(``reference``, ``fla``) forces a choice.
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.nn.functional as F

from models.gdn.delta_rule import chunked_delta_rule
from models.linear_mixing.documents import segments
from models.linear_mixing.libraries import installed
from models.linear_mixing.recomputed import Recomputed
from parallel.comm import compile_boundary

CHUNK = 64  # megatron-core's and the kernel's chunk


L2_EPSILON = 1e-6  # the query and key L2 norm's (fla's and transformers'); no flag


def l2_normalised(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, in fp32 at least."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + L2_EPSILON)


def gates(a, b, A_log, dt_bias, beta_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The log decay g = -exp(A_log) softplus(a + dt_bias) and the write strength beta = beta_scale x
    sigmoid(b) of each value head, in fp32."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    return g, beta * beta_scale if beta_scale != 1.0 else beta


def fla_rule(rule, q, k, v, g, beta, scale: float, documents) -> torch.Tensor:
    """o of fla's ``rule`` (``chunk_gated_delta_rule``, ``chunk_kda``) on [b, S, ...] tensors, its own L2
    norm of q and k; with ``documents`` one packed sequence cut at every document and batch row."""
    if documents is None:
        return rule(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=True)[0]
    rows, length = documents.shape
    starts = F.pad(segments(documents).diff(dim=1) != 0, (1, 0), value=True).reshape(-1)
    cuts = torch.cat([starts.nonzero().flatten(), starts.new_tensor([rows * length], dtype=torch.long)])
    packed = (t.reshape(1, rows * length, *t.shape[2:]) for t in (q, k, v, g, beta))
    o = rule(*packed, scale=scale, cu_seqlens=cuts.to(torch.int32), use_qk_l2norm_in_kernel=True)[0]
    return o.reshape(rows, length, *o.shape[2:])


def _fla(q, k, v, a, b, A_log, dt_bias, scale, documents, beta_scale):
    g, beta = gates(a, b, A_log, dt_bias, beta_scale)
    share = v.shape[2] // q.shape[2]
    q, k = (t.repeat_interleave(share, dim=2) for t in (q, k))
    rule = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    return fla_rule(rule, q, k, v, g, beta.to(v.dtype), scale, documents)


def _rule_of(q, k, v, a, b, A_log, dt_bias, scale, documents, beta_scale):
    share = v.shape[2] // q.shape[2]
    q, k = (l2_normalised(t).repeat_interleave(share, dim=2) for t in (q, k))
    return chunked_delta_rule(q, k, v, *gates(a, b, A_log, dt_bias, beta_scale), scale, CHUNK, documents)


def _reference(q, k, v, a, b, A_log, dt_bias, scale, documents, beta_scale):
    return Recomputed.apply(_rule_of, (scale, documents, beta_scale), q, k, v, a, b, A_log, dt_bias)


BACKENDS = {"fla": ("fla", _fla), "reference": (None, _reference)}


def delta_rule_backend(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """``DELTA_RULE_BACKEND`` if set, else fla on a GPU where it is installed and the tensors are in half
    precision, else the reference."""
    forced = os.environ.get("DELTA_RULE_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"DELTA_RULE_BACKEND={forced}: choose from {', '.join(BACKENDS)}")
        return forced
    half = dtype in (torch.bfloat16, torch.float16)
    return "fla" if device.type == "cuda" and half and installed("fla") else "reference"


@compile_boundary  # a kernel launch, or the reference's own autograd function
def gated_delta_rule(q, k, v, a, b, A_log, dt_bias, scale: float, documents=None,
                     beta_scale: float = 1.0) -> torch.Tensor:
    """o of the gated delta rule (``models.gdn.delta_rule`` for the shapes; here q and k [b, S, Hk, dk]
    before their L2 norm, each key head serving Hv / Hk value heads, and the gates' inputs a and b [b, S,
    Hv] with A_log and dt_bias [Hv], made into g and beta by ``gates``), by the backend
    ``delta_rule_backend`` picks, in ``v``'s dtype; ``beta_scale`` 2 lets beta reach 2
    (--linear-allow-neg-eigval)."""
    rule = BACKENDS[delta_rule_backend(v.device, v.dtype)][1]
    return rule(q, k, v, a, b, A_log, dt_bias, scale, documents, beta_scale).to(v.dtype)
