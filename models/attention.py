"""Causal self-attention with grouped query heads, split across the tensor-parallel group by head, and
over the context-parallel group by sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.config import GPTConfig
from models.norms import build_norm, build_split_norm
from models.rotary import apply_rotary
from parallel.comm import AxisGroup, compile_boundary
from parallel.param_meta import declare
from parallel.context import (ContextParallel, DocumentBlocks, ScoreOptions, attend, context_attention,
                              sequence_mask)
from parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, shard_parameter
from parallel.tensor.random import RNGTracker
from parallel.tensor.weight_init import WeightInit


@dataclass(frozen=True)
class LayerInputs:
    """What every layer reads besides its hidden state; nothing here needs a gradient. ``rotary``: the
    (cos, sin) tables of this rank's tokens; ``rotary_local``: those of the sliding-window layers where
    they have a base of their own (Gemma 3), else None; ``documents``: each token's document ([b, S], the
    whole sequence) when attention stays within documents; ``context``: the cp group when the hidden
    state holds this rank's share of each sequence (None when it holds all of it); ``document_blocks``:
    the documents' FlexAttention block masks where they can be used (whole sequences on a GPU)."""

    rotary: tuple[torch.Tensor, torch.Tensor] | None = None
    documents: torch.Tensor | None = None
    context: ContextParallel | None = None
    rotary_local: tuple[torch.Tensor, torch.Tensor] | None = None
    document_blocks: DocumentBlocks | None = None


class AttentionCore(nn.Module):
    """What every kind of attention of a block shares: the core softmax(q k^T scale) v over the keys a
    query sees (``scores``: its layer's window, scale and soft-capping; ``inputs``: documents, the cp
    group, FlexAttention's blocks), attention dropout from the per-rank stream, and the hook selective
    recompute runs the core through. Owns no weights; its subclasses own the projections and, with
    --softmax-type learnable, ``sinks``: this rank's heads' sink logits [heads / tp] (None otherwise;
    off-by-one sinks are zeros made here)."""

    def __init__(self, config: GPTConfig, layer: int, rng: RNGTracker):
        super().__init__()
        self.rng, self.layer = rng, layer
        self.dropout = config.attention_dropout
        self.scores = ScoreOptions(config.attention_scale, config.attention_window(layer),
                                   config.attn_logit_softcapping)
        self.core_runner = None  # how the core runs when it is recomputed (``recompute_core_with``)
        self.off_by_one = config.softmax_type == "off-by-one"
        self.register_parameter("sinks", None)  # a subclass sets it with --softmax-type learnable
        self.tracks_logits = False  # ``track_logits``: keep ``max_logits`` over the training forwards
        self.max_logits: torch.Tensor | None = None  # [heads / tp], until ``take_max_logits``

    def track_logits(self) -> None:
        """Keep the largest attention logit (q k^T scale, over the keys a query sees) of each of this rank's
        heads over the training forwards (QK-clip, --log-max-attention-logit): one more product of q and
        k per layer, without a gradient, a block of queries at a time."""
        self.tracks_logits = True

    def take_max_logits(self) -> torch.Tensor | None:
        """The largest logit per head since the last call (None if no training forward ran)."""
        found, self.max_logits = self.max_logits, None
        return found

    @compile_boundary  # it keeps a running maximum on the module
    @torch.no_grad()
    def _track(self, q: torch.Tensor, k: torch.Tensor, inputs: LayerInputs, block: int = 512) -> None:
        b, heads, s, d = q.shape
        groups = k.shape[1]
        mask = sequence_mask(s, self.scores.window, inputs.documents, q.device)
        if mask is None:
            mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=q.device).tril()
        grouped, found = q.reshape(b, groups, heads // groups, s, d), None
        for start in range(0, s, block):
            scores = torch.einsum("bgqsd,bgtd->bgqst", grouped[:, :, :, start:start + block], k).float()
            scores = (scores * self.scores.scale).masked_fill(~mask[:, :, start:start + block].unsqueeze(2),
                                                               float("-inf"))
            top = scores.amax(dim=(0, 3, 4)).reshape(heads)
            found = top if found is None else torch.maximum(found, top)
        self.max_logits = found if self.max_logits is None else torch.maximum(self.max_logits, found)

    def recompute_core_with(self, runner) -> None:
        """Run the attention core through ``runner(core, q, k, v, inputs)`` (selective recompute)."""
        self.core_runner = runner

    def attended(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 inputs: LayerInputs) -> torch.Tensor:
        """The core's output for q [b, heads, s, d], through the recompute runner when there is one."""
        if self.tracks_logits and self.training:
            self._track(q, k, inputs)
        if self.core_runner is not None:
            return self.core_runner(self.core, q, k, v, inputs)
        return self.core(q, k, v, inputs)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """softmax(q k^T scale, causal, within the layer's window) v, q [b, heads, s, d] and k, v
        [b, groups, s, d]: the part selective recompute redoes (under context parallelism its recompute
        exchanges keys and values again). Attention dropout draws from the per-tp (and per-cp) rank
        stream: each rank holds other heads (and tokens)."""
        dropout = self.dropout if self.training else 0.0
        sinks = q.new_zeros(q.shape[1], dtype=torch.float32) if self.off_by_one else self.sinks
        if inputs.context is not None:
            if sinks is not None:
                raise ValueError("--softmax-type off-by-one / learnable: attention sinks are not implemented "
                                 "under context parallelism (--context-parallel-size > 1)")
            return context_attention(q, k, v, inputs.context, self.layer, self.scores, dropout, self.rng,
                                     inputs.documents)
        blocks = inputs.document_blocks
        if blocks is not None and sinks is None and blocks.usable(q.device, self.scores.softcap, dropout):
            return blocks.attend(q, k, v, self.scores.window, self.scores.scale)
        mask = sequence_mask(q.shape[2], self.scores.window, inputs.documents, q.device)
        if dropout > 0:
            return self._attend_with_dropout(q, k, v, mask, dropout, sinks)
        return attend(q, k, v, self.scores, mask, sinks=sinks)

    @compile_boundary  # the per-rank random stream is swapped in around it
    def _attend_with_dropout(self, q, k, v, mask, dropout: float, sinks=None) -> torch.Tensor:
        with self.rng.fork():
            return attend(q, k, v, self.scores, mask, dropout, sinks)


class SelfAttention(AttentionCore):
    """Causal self-attention: a query heads of ``head_dim`` channels sharing G key/value groups.

    Owns the fused QKV projection (column-parallel; its rows are ordered group by group, each group
    holding its a/G query heads, with --attention-output-gate then their a/G gates, then its key, then its
    value head, so that a tp slice holds whole groups: Megatron's layout, and head by head q, k, v when G =
    a), the optional query and key norms
    (per head, or over the whole projection, split across tp like the heads), and the output projection
    (row-parallel), and with --softmax-type learnable its heads' sink logits (``sinks``, split by head as
    the queries are). Its layer's window, scale and soft-capping (``ScoreOptions``) decide which keys a
    query sees and how. It never holds other ranks' groups.
    """

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 rng: RNGTracker):
        super().__init__(config, layer, rng)
        h, std, d = config.hidden_size, config.matrix_init_std, config.head_dim  # (muP: / sqrt(m))
        heads, groups = config.num_attention_heads, config.query_groups
        self.head_dim = d
        self.groups_per_rank = groups // tp.size
        self.queries_per_group = heads // groups
        self.heads_per_rank = heads // tp.size
        self.rotary_interleaved = config.rotary_interleaved
        bias = not config.disable_bias_linear
        self.gated = config.attention_output_gate
        self.qkv = ColumnParallelLinear(h, config.attention_projection_rows, tp,
                                        WeightInit(seed, f"layers.{layer}.attention.qkv.weight", std),
                                        bias=bias or config.add_qkv_bias,
                                        sequence_parallel=sequence_parallel)
        query_rows = self.queries_per_group * d
        declare(self.qkv.weight, fused_rows=(query_rows, *(query_rows,) * self.gated, d, d))
        self.q_norm = self.k_norm = None
        if config.qk_layernorm and config.qk_layernorm_scope == "projection":  # a rank holds its heads' part
            self.q_norm = build_split_norm(config, heads * d, tp)
            self.k_norm = build_split_norm(config, groups * d, tp)
        elif config.qk_layernorm:  # one norm over head_dim shared by all heads: a tp rank sees its own heads
            self.q_norm, self.k_norm = (build_norm(config, d, partial_gradient=tp.size > 1),
                                        build_norm(config, d, partial_gradient=tp.size > 1))
        self.norm_per_head = config.qk_layernorm_scope == "head"
        self.proj = RowParallelLinear(heads * d, h, tp,
                                      WeightInit(seed, f"layers.{layer}.attention.proj.weight", std)
                                      .scaled_for_residual(config.residual_branches), bias=bias,
                                      sequence_parallel=sequence_parallel)
        if config.softmax_type == "learnable":  # each head's sink logit, drawn as Megatron draws it
            sink = WeightInit(seed, f"layers.{layer}.attention.sinks", config.init_method_std)  # (a vector)
            self.sinks = shard_parameter(lambda: sink.full((heads,)), 0, tp)

    def _normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [s, b, heads, d] and k [s, b, groups, d] through their norms, per head or over the projection."""
        if self.norm_per_head:
            return self.q_norm(q), self.k_norm(k)
        return self.q_norm(q.flatten(2)).view(q.shape), self.k_norm(k.flatten(2)).view(k.shape)

    def clip_factors(self, max_logits: torch.Tensor, threshold: float, alpha: float) -> dict:
        """Kimi K2's QK-clip as Megatron applies it to grouped queries: eta = min(threshold / the group's
        largest logit, 1), each group's query rows x eta^alpha and key row x eta^(1 - alpha) (values
        untouched): {the QKV weight: a factor per row}, or {} when no group is over ``threshold``."""
        top = max_logits.view(self.groups_per_rank, self.queries_per_group).amax(dim=1)
        if not bool((top > threshold).any()):
            return {}
        eta = torch.clamp(threshold / top, max=1.0).view(-1, 1, 1).cpu()
        factors = torch.ones(self.groups_per_rank, self.heads_in_group, self.head_dim)  # (gates untouched)
        factors[:, :self.queries_per_group] = eta.pow(alpha)
        factors[:, -2] = eta.pow(1 - alpha).view(-1, 1)
        return {self.qkv.weight: factors.reshape(-1)}

    @property
    def heads_in_group(self) -> int:
        """Head-sized row blocks of one group in the fused projection: queries, gates, key, value."""
        return self.queries_per_group * (2 if self.gated else 1) + 2

    def forward(self, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        qkv = self.qkv(x)  # [s, b, groups_per_rank * heads_in_group * d]
        s, b = qkv.shape[:2]
        grouped = qkv.view(s, b, self.groups_per_rank, self.heads_in_group, self.head_dim)
        q = grouped[:, :, :, :self.queries_per_group].reshape(s, b, self.heads_per_rank, self.head_dim)
        k, v = grouped[:, :, :, -2], grouped[:, :, :, -1]
        if self.q_norm is not None:
            q, k = self._normed(q, k)
        rotary = (inputs.rotary_local if self.scores.window is not None and inputs.rotary_local is not None
                  else inputs.rotary)
        if rotary is not None:
            q = apply_rotary(q, *rotary, self.rotary_interleaved)
            k = apply_rotary(k, *rotary, self.rotary_interleaved)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads or groups, s, d]
        context = self.attended(q, k, v, inputs).permute(2, 0, 1, 3)  # [s, b, heads, d]
        if self.gated:  # each head's output times sigmoid of its gate
            gate = grouped[:, :, :, self.queries_per_group:-2].reshape(context.shape)
            context = context * torch.sigmoid(gate)
        return self.proj(context.reshape(s, b, self.heads_per_rank * self.head_dim))
