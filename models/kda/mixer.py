"""Kimi delta attention (Kimi Linear's ``KimiDeltaAttention``), split over tensor-parallel ranks by head.

x [s, b, h] -> ``in_proj`` (column-parallel) -> q, k, v and beta's input b per head; a causal depthwise
convolution with SiLU over q, k and v; q and k L2-normalised; the decay of every key channel from a
low-rank projection, g = -exp(A_log[head]) softplus(f_up(f_down(x)) + dt_bias); beta = sigmoid(b); the
delta rule with that decay (``models.kda.kernels``); RMSNorm over each head's output (one weight for all
heads) times sigmoid of the output gate, itself low-rank, g_up(g_down(x)); ``out_proj`` (row-parallel).

The master weights are head-major: ``in_proj``'s rows are, head by head, [q_j, k_j, v_j, b_j], the
convolution's channels [q_j, k_j, v_j], so a contiguous tp slice is whole heads. The down projections
``f_down`` [dk, h] and ``g_down`` [dv, h] are replicated over tp (each rank makes the whole latent, from
its own tokens under sequence parallelism: its gradient then partial), their latents gathered over the
sequence once, both together; the up projections are column-parallel by head. Kimi Linear keeps q, k, v
apart and its convolution's channels part-major ([q | k | v]); ``pretrain.interop`` maps them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import GPTConfig
from models.gdn.gated_norm import NormThenGate
from models.kda.kernels import kimi_delta_rule
from models.linear_mixing import init
from models.linear_mixing.conv import recomputed_causal_conv
from models.linear_mixing.held import Held
from models.norms import build_norm
from parallel.comm import AxisGroup
from parallel.context import ContextParallel
from parallel.context.head_exchange import to_heads, to_sequence
from parallel.param_meta import declare
from parallel.tensor.layers import (ColumnParallelLinear, LinearWeights, RowParallelLinear, replicated_linear,
                                    shard_parameter)
from parallel.tensor.mappings import copy_to_tensor_parallel, gather_from_sequence_parallel
from parallel.tensor.weight_init import WeightInit


class KimiDeltaAttention(nn.Module):
    """One Kimi delta attention, this tp rank's H / tp heads. Owns ``in_proj`` [rows / tp, h],
    ``conv1d.weight`` [channels / tp, 1, K], the decay's ``f_down`` (whole) and ``f_up`` [H dk / tp, dk],
    the gate's ``g_down`` (whole) and ``g_up`` [H dv / tp, dv], ``A_log`` [H / tp], ``dt_bias`` [H dk / tp],
    the output norm (weight [dv], its gradient summed over tp) and ``out_proj`` [h, H dv / tp]. It
    communicates through its linear layers, the latents' gather (over tp) and, under context parallelism,
    the head exchange over cp; nothing else."""

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 context: ContextParallel | None = None):
        super().__init__()
        h, std = config.hidden_size, config.matrix_init_std
        name = f"layers.{layer}.kda"
        heads = config.linear_num_value_heads
        self.key_dim = self.value_dim = config.linear_value_head_dim  # (one width for q, k and v)
        self.widths = (self.key_dim, self.key_dim, self.value_dim, 1)  # one head's in_proj rows
        self.heads, self.tp, self.split = heads // tp.size, tp, sequence_parallel and tp.size > 1
        self.in_proj = ColumnParallelLinear(h, heads * sum(self.widths), tp,
                                            WeightInit(seed, f"{name}.in_proj.weight", std), bias=False,
                                            sequence_parallel=sequence_parallel)
        declare(self.in_proj.weight, muon=False)  # (fused q, k, v, b: to AdamW, as Mamba's and G's)
        channels, taps = heads * sum(self.widths[:3]), config.linear_conv_kernel_dim
        self.conv1d = Held(shard_parameter(
            lambda: init.conv_weight(seed, f"{name}.conv1d.weight", channels, taps), 0, tp))
        declare(self.conv1d.weight, muon=False)

        def by_head(part: str, rows: int, columns: int) -> LinearWeights:
            weight = WeightInit(seed, f"{name}.{part}.weight", std)
            return LinearWeights(shard_parameter(lambda: weight.full((rows, columns)), 0, tp), None)

        self.f_down = replicated_linear(WeightInit(seed, f"{name}.f_down.weight", std), self.key_dim, h,
                                        self.split)
        self.f_up = by_head("f_up", heads * self.key_dim, self.key_dim)
        self.g_down = replicated_linear(WeightInit(seed, f"{name}.g_down.weight", std), self.value_dim, h,
                                        self.split)
        self.g_up = by_head("g_up", heads * self.value_dim, self.value_dim)
        self.A_log = shard_parameter(lambda: init.a_log(seed, f"{name}.A_log", heads), 0, tp)
        self.dt_bias = shard_parameter(lambda: torch.ones(heads * self.key_dim), 0, tp)
        self.out_norm = build_norm(config, self.value_dim, tp.size > 1)  # (each rank its heads: summed)
        self.out_proj = RowParallelLinear(heads * self.value_dim, h, tp,
                                          WeightInit(seed, f"{name}.out_proj.weight", std)
                                          .scaled_for_residual(config.residual_branches),
                                          bias=False, sequence_parallel=sequence_parallel)
        cp = context.group if context is not None and context.size > 1 else None
        self.count = self.heads // cp.size if cp is not None else self.heads  # heads a cp rank runs
        self.first = cp.rank * self.count if cp is not None else 0

    def _latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decay's and the gate's latents [b, S, dk] / [b, S, dv] of every token of the sequence
        (gathered over it under sequence parallelism; gradients summed over tp)."""
        latents = torch.cat([F.linear(x, self.f_down.weight), F.linear(x, self.g_down.weight)], dim=-1)
        latents = (gather_from_sequence_parallel(latents, self.tp) if self.split
                   else copy_to_tensor_parallel(latents, self.tp))
        return latents.transpose(0, 1).split([self.key_dim, self.value_dim], dim=-1)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None,
                context: ContextParallel | None = None) -> torch.Tensor:
        projected = self.in_proj(x).transpose(0, 1)  # [b, s, rows / tp]: the whole sequence under SP
        b, length = projected.shape[:2]
        f_latent, g_latent = self._latents(x)
        decay = F.linear(f_latent, self.f_up.weight).view(b, length, self.heads, self.key_dim)
        gate = F.linear(g_latent, self.g_up.weight).view(b, length, self.heads, self.value_dim)
        parts = torch.cat([projected.view(b, length, self.heads, -1), decay], dim=-1)
        cp = context.group if context is not None else None
        if cp is not None:  # to head shards: each cp rank runs whole sequences of its heads
            shards = parts.unflatten(2, (cp.size, self.count)).movedim(2, 0)
            parts = to_heads(shards.flatten(-2), cp).unflatten(-1, (self.count, -1))  # [b, S, count, width]
        o = self._delta_rule(parts, documents, cp is not None)  # [b, S, count, dv]
        if cp is not None:
            o = to_sequence(o.flatten(2), cp).movedim(0, 2).flatten(2)  # [b, s, H / tp x dv]
        normed = NormThenGate.apply(o.reshape(gate.shape), gate, self.out_norm.scale(), self.out_norm.eps,
                                    True)  # (times sigmoid(gate))
        return self.out_proj(normed.flatten(2).transpose(0, 1))

    def _delta_rule(self, parts: torch.Tensor, documents: torch.Tensor | None, shares: bool) -> torch.Tensor:
        """Convolve q, k, v of the heads in ``parts`` ([b, S, count, q k v b f]: all of this tp rank's, or
        under context parallelism this cp rank's, with their slices of the convolution, A_log and
        dt_bias) and run the rule."""
        b, length, count = parts.shape[:3]
        qkv_width = sum(self.widths[:3])
        qkv, beta, decay = parts.split([qkv_width, 1, self.key_dim], dim=-1)
        weight, A_log, dt_bias = self.conv1d.weight, self.A_log, self.dt_bias
        if shares and count != self.heads:
            weight = weight[self.first * qkv_width:(self.first + count) * qkv_width]
            A_log = A_log[self.first:self.first + count]
            dt_bias = dt_bias[self.first * self.key_dim:(self.first + count) * self.key_dim]
        convolved = recomputed_causal_conv(qkv.flatten(2), weight, None, documents).view(b, length, count, -1)
        q, k, v = convolved.split(self.widths[:3], dim=-1)
        return kimi_delta_rule(q, k, v, decay, beta.squeeze(-1), A_log, dt_bias, self.key_dim ** -0.5,
                               documents)
