"""Mamba-2's state-space-dual scan, in PyTorch: the chunked form a layer runs and the token-by-token
recurrence it equals.

For head h of group g (the heads split evenly over the groups), with state S in R^{P x N}:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,        y_t = S_t C_t + D_h x_t

``x`` [b, S, H, P], ``dt`` [b, S, H] (positive: after softplus), ``A`` [H] (negative), ``B``, ``C``
[b, S, G, N], ``D`` [H] or None. ``documents`` [b, S] (each token's document): the state starts from zero
at each document's first token. Computed in fp32 (fp64 for fp64 inputs), returned in ``x``'s dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.linear_mixing.documents import segments


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def recurrent_scan(x, dt, A, B, C, D=None, documents=None) -> torch.Tensor:
    """The recurrence, one token at a time (the definition the chunked scan is tested against)."""
    b, length, heads, p = x.shape
    per_group = heads // B.shape[2]
    dtype = _compute_dtype(x)
    xf, dtf, Af = x.to(dtype), dt.to(dtype), A.to(dtype)
    Bh = B.to(dtype).repeat_interleave(per_group, dim=2)  # [b, S, H, N]
    Ch = C.to(dtype).repeat_interleave(per_group, dim=2)
    runs = segments(documents) if documents is not None else None
    state = x.new_zeros(b, heads, p, B.shape[-1], dtype=dtype)
    out = []
    for t in range(length):
        decay = torch.exp(dtf[:, t] * Af)  # [b, H]
        if runs is not None and t > 0:
            decay = decay * (runs[:, t] == runs[:, t - 1]).to(dtype)[:, None]
        state = (decay[..., None, None] * state
                 + (dtf[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :])
        y = torch.einsum("bhpn,bhn->bhp", state, Ch[:, t])
        out.append(y if D is None else y + D.to(dtype)[:, None] * xf[:, t])
    return torch.stack(out, dim=1).to(x.dtype)


def chunked_scan(x, dt, A, B, C, chunk: int, D=None, documents=None) -> torch.Tensor:
    """The recurrence in chunks of ``chunk`` tokens: within a chunk as one masked product (the dual,
    attention-like form), across chunks by carrying each chunk's end state; any length (a ragged tail
    is padded with dt = 0: no input, no decay, outputs dropped)."""
    b, length, heads, p = x.shape
    groups, n = B.shape[2], B.shape[3]
    per_group = heads // groups
    pad = -length % chunk
    dtype = _compute_dtype(x)
    chunks = (length + pad) // chunk
    # head-major chunks, [b, c, G, J, Q, ...] (J heads per group): the Q x Q products below are batched
    # matrix products over (b, c, G, J) with no copy of a Q x Q tensor
    xf = F.pad(x.to(dtype), (0, 0, 0, 0, 0, pad)).view(b, chunks, chunk, groups, per_group, p)
    xc = xf.permute(0, 1, 3, 4, 2, 5)  # [b, c, G, J, Q, P]
    dtc = F.pad(dt.to(dtype), (0, 0, 0, pad)).view(b, chunks, chunk, groups, per_group).permute(0, 1, 3, 4, 2)
    Bc, Cc = (F.pad(t.to(dtype), (0, 0, 0, 0, 0, pad)).view(b, chunks, chunk, groups, n).transpose(2, 3)
              for t in (B, C))  # [b, c, G, Q, N]
    a = dtc * A.to(dtype).view(groups, per_group, 1)  # dt A, [b, c, G, J, Q]
    cumulative = torch.cumsum(a, dim=-1)  # L_t
    runs = None
    if documents is not None:
        runs = F.pad(segments(documents), (0, pad), mode="replicate").view(b, chunks, 1, 1, chunk)

    # within each chunk: y_t = sum_{s <= t} (C_t . B_s) exp(L_t - L_s) dt_s x_s (the exponent a difference of
    # fp64 cumulative sums: in fp32 a long sum's rounding would swamp the small gaps that matter)
    precise = torch.cumsum(a.to(torch.float64), dim=-1)  # L_t in fp64: their differences keep the small gaps
    gaps = (precise[..., :, None] - precise[..., None, :]).to(dtype)  # L_t - L_s, [.., t, s]
    visible = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    if runs is not None:
        visible = visible & (runs[..., :, None] == runs[..., None, :])
    decay = torch.exp(gaps.masked_fill(~visible, float("-inf")))  # [b, c, G, J, t, s]
    scores = (Cc @ Bc.transpose(-1, -2)).unsqueeze(3)  # C_t . B_s per group, [b, c, G, 1, t, s]
    inputs = xc * dtc.unsqueeze(-1)  # dt_s x_s, [b, c, G, J, Q, P]
    y = (scores * decay) @ inputs  # [b, c, G, J, t, P]

    # each chunk's own contribution to its end state: sum_s exp(L_end - L_s) dt_s x_s B_s^T
    to_end = torch.exp(gaps[..., -1, :])  # [b, c, G, J, Q]
    if runs is not None:
        to_end = to_end * (runs == runs[..., -1:]).to(dtype)
    own = (inputs * to_end.unsqueeze(-1)).transpose(-1, -2) @ Bc.unsqueeze(3)  # [b, c, G, J, P, N]

    # across chunks: the state entering chunk c, S_in(c + 1) = exp(L_end(c)) S_in(c) + own(c)
    chunk_decay = torch.exp(cumulative[..., -1])  # [b, c, G, J]
    ends = None
    if runs is not None:  # a state crosses a chunk's end only within one document
        ends = F.pad(runs[:, :-1, ..., -1], (0, 0, 0, 0, 1, 0), value=-1)  # the previous chunk's last run
        chunk_decay = chunk_decay * (runs[..., -1] == ends).to(dtype)
    entering, state = [], own.new_zeros(b, groups, per_group, p, n)
    # each chunk's slices taken at once (one backward for all, not a zero-filled whole per slice)
    for decay_c, own_c in zip(chunk_decay.unbind(1), own.unbind(1)):
        entering.append(state)
        state = decay_c[..., None, None] * state + own_c
    entering = torch.stack(entering, dim=1)  # [b, c, G, J, P, N]

    # what the entering state gives each token: exp(L_t) C_t . S_in(c), within its first document
    from_start = torch.exp(cumulative)
    if runs is not None:
        from_start = from_start * (runs == ends.unsqueeze(-1)).to(dtype)
    y = y + (Cc.unsqueeze(3) @ entering.transpose(-1, -2)) * from_start.unsqueeze(-1)
    y = y.permute(0, 1, 4, 2, 3, 5).reshape(b, chunks * chunk, heads, p)[:, :length]
    if D is not None:
        y = y + D.to(dtype)[:, None] * x.to(dtype)
    return y.to(x.dtype)
