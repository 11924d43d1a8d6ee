"""The gated delta net (megatron-core's ``GatedDeltaNet``), split over tensor-parallel ranks by key heads.

x [s, b, h] -> ``in_proj`` (column-parallel) -> q, k, v, the output gate z, beta and the decay's input a; a
causal depthwise convolution with SiLU over q, k and v; q and k L2-normalised and repeated to the value
heads (each key head serves Hv / Hk of them); g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
(2 sigmoid(b) with --linear-allow-neg-eigval); the gated delta rule (``models.gdn.kernels``); RMSNorm over
each value head's channels (one weight for all heads: always an RMSNorm, as megatron-core's hybrid spec and
Qwen3-Next have it; its epsilon --linear-output-norm-epsilon) times SiLU(z); ``out_proj`` (row-parallel).

The master weights are **group-major**: ``in_proj``'s rows are, key head by key head, [q_j, k_j, v_j, z_j,
b_j, a_j] (the value-head parts those of its Hv / Hk value heads), the convolution's channels [q_j, k_j,
v_j], so a contiguous tp slice is whole key heads with their value heads and each rank splits its rows
without an exchange. ``A_log``, ``dt_bias``, z and the output keep the value heads' natural order, which is
megatron-core's. megatron-core keeps its rows part-major ([q | k | v | z | b | a]), transformers'
Qwen3-Next q, k, v, z per key head and b, a apart (``tests/models/test_gdn.py`` maps them).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from models.config import GPTConfig
from models.gdn.gated_norm import NormThenGate
from models.gdn.kernels import gated_delta_rule
from models.linear_mixing import init
from models.linear_mixing.conv import recomputed_causal_conv
from models.linear_mixing.held import Held
from models.norms import build_norm
from parallel.comm import AxisGroup
from parallel.context import ContextParallel
from parallel.context.head_exchange import to_heads, to_sequence
from parallel.param_meta import declare
from parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, shard_parameter
from parallel.tensor.weight_init import WeightInit

def group_widths(config: GPTConfig) -> tuple[int, int, int, int, int, int]:
    """One key head's rows of ``in_proj``: q, k, v, z, b, a (dk, dk, r dv, r dv, r, r; r = Hv / Hk)."""
    share = config.linear_num_value_heads // config.linear_num_key_heads
    key, value = config.linear_key_head_dim, share * config.linear_value_head_dim
    return key, key, value, value, share, share


class GatedDeltaNet(nn.Module):
    """One gated delta net, this tp rank's Hk / tp key heads (and their value heads). Owns ``in_proj``
    [rows / tp, h], ``conv1d.weight`` [channels / tp, 1, K], ``A_log`` and ``dt_bias`` [Hv / tp], the
    output norm (weight [dv], its gradient summed over tp) and ``out_proj`` [h, Hv dv / tp]. It
    communicates through its two linear layers (over tp) and, under context parallelism, by the head
    exchange over cp; nothing else."""

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 context: ContextParallel | None = None):
        super().__init__()
        h, std = config.hidden_size, config.matrix_init_std
        name = f"layers.{layer}.gdn"
        self.groups = config.linear_num_key_heads // tp.size
        self.widths = group_widths(config)
        self.share, self.key_dim = self.widths[4], config.linear_key_head_dim
        self.value_dim = config.linear_value_head_dim
        values, channels = config.linear_num_value_heads, config.gdn_conv_channels
        self.in_proj = ColumnParallelLinear(h, config.gdn_projection_rows, tp,
                                            WeightInit(seed, f"{name}.in_proj.weight", std), bias=False,
                                            sequence_parallel=sequence_parallel)
        declare(self.in_proj.weight, muon=False)  # (fused q, k, v, z, b, a: as Mamba's, to AdamW)
        taps = config.linear_conv_kernel_dim
        self.conv1d = Held(shard_parameter(
            lambda: init.conv_weight(seed, f"{name}.conv1d.weight", channels, taps), 0, tp))
        declare(self.conv1d.weight, muon=False)
        self.A_log = shard_parameter(lambda: init.a_log(seed, f"{name}.A_log", values), 0, tp)
        self.dt_bias = shard_parameter(lambda: torch.ones(values), 0, tp)
        # (an RMSNorm whatever --normalization says; each rank normalises its heads: the gradient summed)
        self.out_norm = build_norm(replace(config, normalization="RMSNorm",
                                           layernorm_epsilon=config.gdn_output_norm_epsilon),
                                   self.value_dim, tp.size > 1)
        self.beta_scale = 2.0 if config.linear_allow_neg_eigval else 1.0
        self.out_proj = RowParallelLinear(config.gdn_value_width, h, tp,
                                          WeightInit(seed, f"{name}.out_proj.weight", std)
                                          .scaled_for_residual(config.residual_branches),
                                          bias=False, sequence_parallel=sequence_parallel)
        cp = context.group if context is not None and context.size > 1 else None
        self.count = self.groups // cp.size if cp is not None else self.groups  # key heads a cp rank runs
        self.first = cp.rank * self.count if cp is not None else 0

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None,
                context: ContextParallel | None = None) -> torch.Tensor:
        projected = self.in_proj(x).transpose(0, 1)  # [b, s, rows / tp]: the whole sequence under SP
        b, length = projected.shape[:2]
        grouped = projected.reshape(b, length, self.groups, -1)
        qkv_width = sum(self.widths[:3])
        qkv, z, gates = grouped.split([qkv_width, self.widths[3], 2 * self.share], dim=-1)
        cp = context.group if context is not None else None
        if cp is not None:  # to head shards: each cp rank runs whole sequences of its key heads
            parts = torch.cat([qkv, gates], dim=-1).unflatten(2, (cp.size, self.count)).movedim(2, 0)
            rest = to_heads(parts.flatten(-2), cp).unflatten(-1, (self.count, -1))  # [b, S, count, width]
            qkv, gates = rest.split([qkv_width, 2 * self.share], dim=-1)
        o = self._delta_rule(qkv, gates, documents, cp is not None)  # [b, S, count x r, dv]
        if cp is not None:
            o = to_sequence(o.flatten(2), cp).movedim(0, 2).flatten(2)  # [b, s, Hv / tp x dv]
        gated = self._gated_norm(o.reshape(b, length, -1, self.value_dim), z.contiguous())
        return self.out_proj(gated.flatten(2).transpose(0, 1))

    def _delta_rule(self, qkv: torch.Tensor, gates: torch.Tensor, documents: torch.Tensor | None,
                    shares: bool) -> torch.Tensor:
        """Convolve q, k, v of the key heads in ``qkv`` ([b, S, count, qkv], their ``gates`` [b, S, count,
        b + a]: all of this tp rank's, or under context parallelism this cp rank's, with their slices of
        the convolution, A_log and dt_bias) and run the gated delta rule."""
        b, length, count = qkv.shape[:3]
        qkv_width = sum(self.widths[:3])
        beta, a = gates.split([self.share, self.share], dim=-1)
        weight, A_log, dt_bias = self.conv1d.weight, self.A_log, self.dt_bias
        if shares and count != self.groups:
            weight = weight[self.first * qkv_width:(self.first + count) * qkv_width]
            heads = slice(self.first * self.share, (self.first + count) * self.share)
            A_log, dt_bias = A_log[heads], dt_bias[heads]
        convolved = recomputed_causal_conv(qkv.flatten(2), weight, None, documents).view(b, length, count, -1)
        q, k, v = convolved.split(self.widths[:3], dim=-1)  # (the rule normalises q, k and repeats them)
        v = v.reshape(b, length, count * self.share, self.value_dim)
        a, beta = (t.reshape(b, length, -1) for t in (a, beta))
        return gated_delta_rule(q, k, v, a, beta, A_log, dt_bias, self.key_dim ** -0.5, documents,
                                self.beta_scale)

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each value head's output (o [b, s, Hv / tp, dv]) times SiLU(z) (z [b, s, Hk / tp,
        r dv]), keeping o, z and 1 / rms for backward."""
        return NormThenGate.apply(o, z.reshape(o.shape), self.out_norm.scale(), self.out_norm.eps)
