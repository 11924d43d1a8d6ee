"""GPT: pre-LN transformer blocks assembled from tensor-parallel layers.

Activations are [sequence, batch, hidden]. The model part a rank builds is chosen by
``layer_indices`` (global block indices, so weights are named and initialised the same whatever the
pipeline split) and by ``pre_process`` (token/position embedding) / ``post_process`` (final norm,
tied output layer and loss). The only parallel decisions here are which layers to use.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from models.config import GPTConfig
from parallel.comm import AxisGroup
from parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                    mark_sequence_parallel, vocab_parallel_logits, with_init)
from parallel.tensor.mappings import scatter_to_sequence_parallel
from parallel.tensor.random import RNGTracker, model_parallel_tracker
from parallel.tensor.weight_init import WeightInit


def _norm(config: GPTConfig, sequence_parallel: bool) -> nn.Module:
    cls = nn.LayerNorm if config.normalization == "LayerNorm" else nn.RMSNorm
    norm = cls(config.hidden_size, eps=config.layernorm_epsilon)
    size = config.hidden_size
    with_init(norm.weight, lambda: torch.ones(size))
    if getattr(norm, "bias", None) is not None:
        with_init(norm.bias, lambda: torch.zeros(size))
    for param in norm.parameters():
        mark_sequence_parallel(param, sequence_parallel)
    return norm


def _dropout(p: float) -> nn.Module:
    """Dropout, or nothing at p = 0 (so no mask is made or kept for backward)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


def rotary_tables(config: GPTConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles for ``positions`` [b, s] -> each [s, b, 1, head_dim]."""
    head_dim = config.hidden_size // config.num_attention_heads
    inverse = config.rotary_base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
                                     / head_dim)
    angles = positions.t().float().unsqueeze(-1) * inverse  # [s, b, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(2)
    return angles.cos(), angles.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-second, first], dim=-1) * sin).to(x.dtype)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention; heads split across the tensor-parallel group.

    Owns the fused QKV projection (column-parallel, output ordered head by head so that a tp slice
    holds whole heads) and the output projection (row-parallel). It never holds other ranks' heads.
    """

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 rng: RNGTracker):
        super().__init__()
        h, std = config.hidden_size, config.init_method_std
        self.rng = rng
        self.heads_per_rank = config.num_attention_heads // tp.size
        self.head_dim = h // config.num_attention_heads
        self.dropout = config.attention_dropout
        self.core_runner = None  # set by activation checkpointing to recompute the core (selective)
        self.qkv = ColumnParallelLinear(h, 3 * h, tp, WeightInit(seed, f"layers.{layer}.attention.qkv.weight", std),
                                        sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(h, h, tp, WeightInit(seed, f"layers.{layer}.attention.proj.weight", std)
                                      .scaled_for_residual(config.num_layers), sequence_parallel=sequence_parallel)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), causal) v on [b, heads, s, d]: the part selective recompute redoes.
        Attention dropout draws from the per-tp-rank stream: each rank holds different heads."""
        dropout = self.dropout if self.training else 0.0
        with self.rng.fork() if dropout > 0 else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        qkv = self.qkv(x)  # [s, b, heads_per_rank * 3 * d]
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, self.heads_per_rank, 3, self.head_dim).unbind(dim=3)
        if rotary is not None:
            q, k = _apply_rotary(q, *rotary), _apply_rotary(k, *rotary)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        context = self.core_runner(self.core, q, k, v) if self.core_runner else self.core(q, k, v)
        return self.proj(context.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim))


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> GELU -> h (row-parallel). Never holds the full ffn activation."""

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool):
        super().__init__()
        h, f, std = config.hidden_size, config.ffn_size, config.init_method_std
        self.fc1 = ColumnParallelLinear(h, f, tp, WeightInit(seed, f"layers.{layer}.mlp.fc1.weight", std),
                                        sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(f, h, tp, WeightInit(seed, f"layers.{layer}.mlp.fc2.weight", std)
                                     .scaled_for_residual(config.num_layers), sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)), with dropout on both residual branches.

    Residual dropout draws from the default stream (equal on all tp ranks, whose activations are
    replicas), or from the per-tp-rank stream under sequence parallelism (each rank holds other tokens).
    """

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 rng: RNGTracker | None = None):
        super().__init__()
        self.layer = layer
        self.rng = rng or model_parallel_tracker(seed, tp.rank)
        self.attention_norm = _norm(config, sequence_parallel)
        self.attention = SelfAttention(config, layer, tp, seed, sequence_parallel, self.rng)
        self.mlp_norm = _norm(config, sequence_parallel)
        self.mlp = MLP(config, layer, tp, seed, sequence_parallel)
        self.dropout = _dropout(config.hidden_dropout)
        self.fork_for_dropout = sequence_parallel and tp.size > 1 and config.hidden_dropout > 0

    def _residual_dropout(self, x: torch.Tensor) -> torch.Tensor:
        with self.rng.fork() if self.fork_for_dropout else contextlib.nullcontext():
            return self.dropout(x)

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        x = x + self._residual_dropout(self.attention(self.attention_norm(x), rotary))
        return x + self._residual_dropout(self.mlp(self.mlp_norm(x)))


class GPTModel(nn.Module):
    """One rank's part of a GPT: [embedding] -> blocks ``layer_indices`` -> [final norm, tied LM head, loss].

    Owns the parameters of its part only. The word embedding is also the output layer (tied); a last
    pipeline stage without the embedding holds its own copy (``output_weight``), kept equal to the
    first stage's by the pipeline's embedding-group all-reduce. Never communicates outside its
    tensor-parallel group.
    """

    def __init__(self, config: GPTConfig, tp: AxisGroup, *, seed: int, layer_indices: list[int] | None = None,
                 pre_process: bool = True, post_process: bool = True, sequence_parallel: bool = False,
                 rng: RNGTracker | None = None):
        super().__init__()
        config.validate(tp.size)
        self.config, self.tp, self.sequence_parallel = config, tp, sequence_parallel
        self.pre_process, self.post_process = pre_process, post_process
        self.rng = rng or model_parallel_tracker(seed, tp.rank)
        h, std = config.hidden_size, config.init_method_std
        padded = config.padded_vocab_size(tp.size)
        word_init = WeightInit(seed, "embedding.word.weight", std)
        if pre_process:
            self.word_embedding = VocabParallelEmbedding(config.vocab_size, padded, h, tp, word_init)
            if config.position_embedding_type == "learned":
                self.position_embedding = nn.Embedding(config.max_positions, h)
                positions = WeightInit(seed, "embedding.position.weight", std)
                with torch.no_grad():
                    self.position_embedding.weight.copy_(positions.full((config.max_positions, h)))
                with_init(self.position_embedding.weight, lambda: positions.full((config.max_positions, h)))
            self.embedding_dropout = _dropout(config.hidden_dropout)
        self.layer_runner = None  # set by activation checkpointing to recompute whole layers (full)
        self.layer_indices = list(range(config.num_layers)) if layer_indices is None else list(layer_indices)
        self.layers = nn.ModuleList(TransformerBlock(config, i, tp, seed, sequence_parallel, self.rng)
                                    for i in self.layer_indices)
        if post_process:
            self.final_norm = _norm(config, sequence_parallel)
            if not pre_process:
                self.output_weight = VocabParallelEmbedding(config.vocab_size, padded, h, tp, word_init).weight
                self.output_weight.tied_embedding = True  # summed with the first stage's gradient
                self.output_weight.tied_copy = True  # counted once, on the first stage
        if pre_process and not post_process:
            self.word_embedding.weight.tied_embedding = True

    def global_parameter_names(self) -> dict[nn.Parameter, str]:
        """Each parameter's name in the whole GPT, the same in every layout: block indices are global,
        and the last stage's copy of the tied embedding is named as the embedding."""
        names = {}
        for name, param in self.named_parameters():
            parts = name.split(".")
            if parts[0] == "layers":
                parts[1] = str(self.layer_indices[int(parts[1])])
            names[param] = "word_embedding.weight" if name == "output_weight" else ".".join(parts)
        return names

    def output_layer_weight(self) -> torch.Tensor:
        return self.word_embedding.weight if self.pre_process else self.output_weight

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> hidden [s, b, h] (sequence-sharded under sequence parallelism)."""
        x = self.word_embedding(tokens.t())
        if self.config.position_embedding_type == "learned":
            x = x + self.position_embedding(position_ids.t())
        x = self.embedding_dropout(x)
        return scatter_to_sequence_parallel(x, self.tp) if self.sequence_parallel else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits, [s, b, padded_vocab / tp]."""
        return vocab_parallel_logits(self.final_norm(hidden), self.output_layer_weight(), self.tp,
                                     self.sequence_parallel)

    def forward(self, tokens: torch.Tensor | None, position_ids: torch.Tensor, labels: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run this part. Input: ``tokens`` [b, s] on the first stage, else ``hidden`` from the previous
        stage. Output: per-token loss [b, s] on the last stage when ``labels`` are given, the logits
        slice [s, b, v/tp] on the last stage without labels, else the hidden state for the next stage."""
        x = self.embed(tokens, position_ids) if self.pre_process else hidden
        rotary = rotary_tables(self.config, position_ids) if self.config.position_embedding_type == "rope" else None
        if self.layer_runner is not None:
            x = self.layer_runner(x, rotary)
        else:
            for layer in self.layers:
                x = layer(x, rotary)
        if not self.post_process:
            return x
        logits = self.logits(x)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels.t(), self.tp, self.config.vocab_size).t()
