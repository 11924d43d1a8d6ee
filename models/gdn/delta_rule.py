"""The gated delta rule, in PyTorch: the chunked (WY) form a layer runs and the token-by-token recurrence it
equals; the decay is a scalar per head (gated delta nets) or per key channel (Kimi delta attention).

For one value head, with state S in R^{K x V}, q and k L2-normalised (q scaled by ``scale``), D_t =
diag(exp(g_t)) (exp(g_t) I for a scalar decay):

    S_t = D_t S_{t-1} + beta_t k_t (v_t - (D_t S_{t-1})^T k_t)^T,        o_t = S_t^T q_t

``q``, ``k`` [b, S, H, K] (already repeated to the value heads), ``v`` [b, S, H, V], ``g`` [b, S, H] or
[b, S, H, K] (the log decay, <= 0), ``beta`` [b, S, H] (in [0, 1]). ``documents`` [b, S] (each token's
document): the state starts from zero at each document's first token. Computed and returned in fp32
(fp64 for fp64 inputs); ``models.gdn.kernels`` casts back.

In a chunk of C tokens from state S_0, with G_i the decays' cumulative sum: the writes u_i = beta_i (v_i -
exp(g_i) S_{i-1}^T k_i) solve the unit lower-triangular system (I + A) U = beta (V - exp(G) K S_0), A_ij =
beta_i exp(G_i - G_j) k_i . k_j (j < i); then O = exp(G) Q S_0 + (Q K^T * exp(G_i - G_j))_{j <= i} U and
the next state is exp(G_C) S_0 + (exp(G_C - G_j) k_j)^T U. With a decay per channel the products of two
tokens' vectors weigh each channel by its own exp(G_ic - G_jc) (a [C, C, K] tensor: exact, not lean).
The exponents are differences of fp64 cumulative sums (an fp32 sum of a chunk's decays loses the small
differences between its large terms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.linear_mixing.documents import segments


def _compute_dtype(v: torch.Tensor) -> torch.dtype:
    return torch.promote_types(v.dtype, torch.float32)


def _per_channel(g: torch.Tensor) -> torch.Tensor:
    """g as [b, S, H, K or 1]: a scalar decay is one channel broadcast over all."""
    return g if g.dim() == 4 else g[..., None]


def _weighed(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """(a_i . b_j) exp(G_i - G_j) over a chunk's token pairs: a, b [.., C, K], ``decay``
    [.., C, C, K or 1]."""
    if decay.shape[-1] == 1:
        return (a @ b.transpose(-1, -2)) * decay[..., 0]
    return torch.einsum("...ic,...jc,...ijc->...ij", a, b, decay)


def recurrent_delta_rule(q, k, v, g, beta, scale: float, documents=None) -> torch.Tensor:
    """The recurrence, one token at a time (the definition the chunked form is tested against)."""
    b, length, heads, _ = k.shape
    dtype = _compute_dtype(v)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, _per_channel(g), beta))
    runs = segments(documents) if documents is not None else None
    state = v.new_zeros(b, heads, k.shape[-1], v.shape[-1])
    out = []
    for t in range(length):
        decay = torch.exp(g[:, t])  # [b, H, K or 1]
        if runs is not None and t > 0:
            decay = decay * (runs[:, t] == runs[:, t - 1]).to(dtype)[:, None, None]
        state = decay[..., None] * state
        read = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * (v[:, t] - read))
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * scale))
    return torch.stack(out, dim=1)


def chunked_delta_rule(q, k, v, g, beta, scale: float, chunk: int = 64, documents=None) -> torch.Tensor:
    """The recurrence in chunks of ``chunk`` tokens (any length: a ragged tail is padded with beta = 0 and
    g = 0, which writes and decays nothing)."""
    b, length, heads, dk = k.shape
    dtype = _compute_dtype(v)
    pad = -length % chunk
    runs = segments(documents) if documents is not None else torch.zeros(b, length, dtype=torch.long,
                                                                           device=v.device)
    q, k, v, g, beta = (F.pad(t.to(dtype), (0, 0) * (t.dim() - 2) + (0, pad))
                        for t in (q, k, v, _per_channel(g), beta))
    runs = F.pad(runs, (0, pad), value=-1)
    n = (length + pad) // chunk
    # [b, H, n, C, .] / [b, H, n, C]
    q, k, v, g = (t.reshape(b, n, chunk, heads, -1).permute(0, 3, 1, 2, 4) for t in (q * scale, k, v, g))
    beta = beta.reshape(b, n, chunk, heads).permute(0, 3, 1, 2)
    runs = runs.reshape(b, 1, n, chunk)
    cumulative = g.double().cumsum(-2)  # G_i within each chunk, [b, H, n, C, K or 1]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    same = (runs[..., :, None] == runs[..., None, :]) & causal  # [b, 1, n, C, C]
    decay = torch.exp((cumulative[..., :, None, :] - cumulative[..., None, :, :]).to(dtype)
                      .masked_fill(~same[..., None], float("-inf")))  # exp(G_i - G_j), j <= i, one document
    to_start = torch.exp(cumulative.to(dtype))  # exp(G_i)
    to_end = torch.exp((cumulative[..., -1:, :] - cumulative).to(dtype))  # exp(G_C - G_j)
    eye = torch.eye(chunk, dtype=dtype, device=v.device)
    system = (beta[..., None] * _weighed(k, k, decay)).tril(-1) + eye
    solved = torch.linalg.solve_triangular(system, torch.cat([beta[..., None] * v,
                                                              beta[..., None] * to_start * k], -1),
                                           upper=False, unitriangular=True)
    fresh, carried = solved.split([v.shape[-1], dk], dim=-1)  # U = fresh - carried S_0
    scores = _weighed(q, k, decay)
    state = v.new_zeros(b, heads, dk, v.shape[-1])
    previous = runs[..., 0, :1].new_full((b, 1, 1), -1)  # the document that the carried state belongs to
    out = []
    # each chunk's slices taken at once (one backward for all, not a zero-filled whole per slice)
    chunks = zip(*(t.unbind(2) for t in (runs, fresh, carried, to_start, to_end, q, k, scores)))
    for run, fresh_c, carried_c, start_c, end_c, q_c, k_c, scores_c in chunks:
        kept = (run == previous).to(dtype)[..., None]  # [b, 1, C, 1]: tokens the state reaches
        writes = fresh_c - kept * (carried_c @ state)
        out.append(kept * ((start_c * q_c) @ state) + scores_c @ writes)
        last = run[..., -1:]
        tail = (run == last).to(dtype)[..., None]  # tokens of the chunk's last document
        state = (kept[:, :, -1:] * start_c[..., -1, :, None] * state
                 + (tail * end_c * k_c).transpose(-1, -2) @ writes)
        previous = last
    o = torch.stack(out, dim=2).permute(0, 2, 3, 1, 4).reshape(b, n * chunk, heads, -1)
    return o[:, :length].clone() if pad else o  # (not a view that keeps the padded tail alive)
