"""The scan a Mamba-2 mixer calls: a kept library's GPU kernel where one is installed and the tensors are
on a GPU, else the PyTorch chunked scan (``models.mamba.ssd_scan``), which keeps only its inputs for
backward and recomputes its chunks there (as the fused kernels do), so that its saved activations grow
with the sequence, not with the sequence times the chunk.

GPU kernels, tried in order (``pip install .[mamba]`` installs the second; the first needs nvcc to build):
- mamba-ssm's ``mamba_chunk_scan_combined`` (what megatron-core and transformers call), with ``seq_idx``
  for documents;
- flash-linear-attention's ``chunk_simple_gla``: the scalar per-head decay is Mamba-2's dual form (q = C,
  k = B, v = dt x, g = dt A, scale 1, B and C repeated over each group's heads; D x added here); it has no
  documents argument, so a run with document resets uses the reference.
``SCAN_BACKEND`` (``reference``, ``mamba_ssm``, ``fla``) forces a choice; tests set it.
"""

from __future__ import annotations

import importlib
import os

import torch

from models.linear_mixing.documents import segments
from models.linear_mixing.libraries import installed
from models.linear_mixing.recomputed import Recomputed
from models.mamba.ssd_scan import chunked_scan
from parallel.comm import compile_boundary


def _mamba_ssm(x, dt, A, B, C, chunk, D, documents):
    combined = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    seq_idx = (segments(documents) - 1).to(torch.int32) if documents is not None else None
    return combined.mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D=D, seq_idx=seq_idx)


def _fla(x, dt, A, B, C, chunk, D, documents):
    gla = importlib.import_module("fla.ops.simple_gla")
    per_group = x.shape[2] // B.shape[2]
    q, k = (t.repeat_interleave(per_group, dim=2) for t in (C, B))
    fp32 = torch.promote_types(dt.dtype, torch.float32)  # the decays' logs in fp32 at least
    y, _ = gla.chunk_simple_gla(q, k, x * dt[..., None].to(x.dtype), g=(dt * A).to(fp32), scale=1.0)
    return y if D is None else y + (D.to(fp32)[:, None] * x.to(fp32)).to(y.dtype)


def _scan_of(x, dt, A, B, C, D, chunk, documents):
    return chunked_scan(x, dt, A, B, C, chunk, D, documents)


def _reference(x, dt, A, B, C, chunk, D, documents):
    return Recomputed.apply(_scan_of, (chunk, documents), x, dt, A, B, C, D)


BACKENDS = {"mamba_ssm": ("mamba_ssm", _mamba_ssm), "fla": ("fla", _fla), "reference": (None, _reference)}


def scan_backend(device: torch.device, documents: bool) -> str:
    """The backend a scan on ``device`` uses: ``SCAN_BACKEND`` if set, else the first GPU kernel installed
    that can take the call (fla has no documents), else the reference."""
    forced = os.environ.get("SCAN_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"SCAN_BACKEND={forced}: choose from {', '.join(BACKENDS)}")
        return forced
    if device.type == "cuda":
        for name in ("mamba_ssm", "fla"):
            if installed(BACKENDS[name][0]) and not (name == "fla" and documents):
                return name
    return "reference"


@compile_boundary  # a kernel launch, or the reference's own autograd function
def ssd_scan(x, dt, A, B, C, chunk: int, D=None, documents=None) -> torch.Tensor:
    """y of the Mamba-2 recurrence (``models.mamba.ssd_scan`` for the shapes), by the backend
    ``scan_backend`` picks."""
    return BACKENDS[scan_backend(x.device, documents is not None)][1](x, dt, A, B, C, chunk, D, documents)
