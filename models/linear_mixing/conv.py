"""The linear-time mixers' short causal convolution (Mamba-2's, and the delta nets' on q, k, v): each
channel convolved with its own K taps over the past K - 1 tokens and itself, plus a bias, then SiLU; with
``documents``, taps never reach into an earlier document (megatron-core's ``seq_idx``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.linear_mixing.documents import segments
from models.linear_mixing.recomputed import Recomputed
from parallel.comm import compile_boundary


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(causal depthwise conv): ``x`` [b, S, channels], ``weight`` [channels, 1, K] (tap K - 1 is the
    token itself), ``bias`` [channels]; ``documents`` [b, S] or None."""
    taps = weight.shape[-1]
    if documents is None:
        out = F.conv1d(x.transpose(1, 2), weight, bias, padding=taps - 1, groups=x.shape[-1])
        return F.silu(out[..., :x.shape[1]].transpose(1, 2))
    runs = segments(documents)
    out = x * weight[:, 0, -1]
    for back in range(1, taps):  # the token ``back`` places earlier, where it is in the same document
        shifted = F.pad(x, (0, 0, back, 0))[:, :x.shape[1]]
        same = F.pad(runs, (back, 0), value=-1)[:, :x.shape[1]] == runs
        out = out + shifted * same[..., None].to(x.dtype) * weight[:, 0, -1 - back]
    return F.silu(out if bias is None else out + bias)


@compile_boundary  # its backward calls autograd itself, which dynamo does not trace
def recomputed_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           documents: torch.Tensor | None = None) -> torch.Tensor:
    """``causal_conv`` keeping only its input for backward (SiLU's input and output remade there)."""
    return Recomputed.apply(causal_conv, (documents,), x, weight, bias)
