"""The Mamba-2 mixer (megatron-core's ``MambaMixer``), split over tensor-parallel ranks by groups.

x [s, b, h] -> ``in_proj`` (column-parallel) -> z, x, B, C, dt; a causal depthwise convolution with SiLU
over x, B and C; dt = softplus(dt + dt_bias); the state-space-dual scan with decay exp(-dt exp(A_log))
per head and skip D; RMSNorm(y * SiLU(z)) per group times its weight; ``out_proj`` (row-parallel).

The master weights are **group-major**: ``in_proj``'s rows are, group by group, [z_g, x_g, B_g, C_g,
dt_g] (the convolution's channels [x_g, B_g, C_g]), so a contiguous tp slice is whole groups and each rank
splits its own rows without any exchange. Heads (``A_log``, ``D``, ``dt_bias``) and the inner channels (the
norm's weight, ``out_proj``'s columns) keep the natural order, head h in group h // (H / G), which is
megatron-core's. Interop turns Megatron's and Hugging Face's part-major rows into this order and back.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from models.config import GPTConfig
from models.linear_mixing import init
from models.linear_mixing.conv import recomputed_causal_conv
from models.linear_mixing.held import Held
from models.mamba.config import CONV_KERNEL, NORM_EPSILON
from models.mamba.gated_norm import GatedRMSNorm
from models.mamba.layout import virtual_groups
from models.mamba.kernels import ssd_scan
from parallel.comm import AxisGroup
from parallel.context import ContextParallel
from parallel.context.head_exchange import to_heads, to_sequence
from parallel.param_meta import declare
from parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, shard_parameter
from parallel.tensor.weight_init import WeightInit


def group_rows(config: GPTConfig) -> tuple[int, int, int, int, int]:
    """One group's rows of ``in_proj``: z, x, B, C, dt (I/G, I/G, N, N, H/G)."""
    groups = config.mamba_num_groups
    inner, state = config.mamba_inner // groups, config.mamba_state_dim
    return inner, inner, state, state, config.mamba_heads // groups


class MambaMixer(nn.Module):
    """One Mamba-2 mixer, this tp rank's G / tp groups (and their heads). Owns ``in_proj`` [rows / tp, h],
    ``conv1d`` (weight [channels / tp, 1, K], bias), ``A_log``, ``D``, ``dt_bias`` [H / tp], ``norm.weight``
    [I / tp] and ``out_proj`` [h, I / tp]. It communicates through its two linear layers (over tp) and,
    under context parallelism, by the head exchange over cp; nothing else."""

    RECOMPUTE_MODULE = "mamba"  # --recompute-modules mamba recomputes it

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 context: ContextParallel | None = None):
        super().__init__()
        h, std = config.hidden_size, config.matrix_init_std
        name = f"layers.{layer}.mamba"
        self.heads, self.groups = config.mamba_heads // tp.size, config.mamba_num_groups // tp.size
        self.head_dim, self.chunk = config.mamba_head_dim, config.mamba_chunk_size
        self.rows = group_rows(config)
        channels, heads = config.mamba_conv_channels, config.mamba_heads
        self.in_proj = ColumnParallelLinear(h, config.mamba_projection_rows, tp,
                                            WeightInit(seed, f"{name}.in_proj.weight", std), bias=False,
                                            sequence_parallel=sequence_parallel)
        # Megatron's Muon leaves the fused z, x, B, C, dt projection and the convolution's taps to AdamW
        declare(self.in_proj.weight, muon=False)
        conv = f"{name}.conv1d"
        self.conv1d = Held(
            shard_parameter(lambda: init.conv_weight(seed, f"{conv}.weight", channels, CONV_KERNEL), 0, tp),
            shard_parameter(lambda: init.conv_bias(seed, f"{conv}.bias", channels, CONV_KERNEL), 0, tp))
        declare(self.conv1d.weight, muon=False)
        self.A_log = shard_parameter(lambda: init.a_log(seed, f"{name}.A_log", heads), 0, tp)
        self.D = shard_parameter(lambda: torch.ones(heads), 0, tp)
        self.dt_bias = shard_parameter(lambda: init.dt_bias(seed, f"{name}.dt_bias", heads), 0, tp)
        self.norm = Held(shard_parameter(lambda: torch.ones(config.mamba_inner), 0, tp))
        self.out_proj = RowParallelLinear(config.mamba_inner, h, tp,
                                          WeightInit(seed, f"{name}.out_proj.weight", std)
                                          .scaled_for_residual(config.residual_branches),
                                          bias=False, sequence_parallel=sequence_parallel)
        self.runner = None  # how the mixer runs when it is recomputed (``recompute_with``)
        # under context parallelism: virtual groups per group, this cp rank's first and count of them, and
        # their convolution channels and heads among this tp rank's
        cp = context.group if context is not None and context.size > 1 else None
        self.split = max(1, cp.size // self.groups) if cp is not None else 1
        self.count = self.groups * self.split // cp.size if cp is not None else self.groups
        self.first = cp.rank * self.count if cp is not None else 0
        self.cp_channels, self.cp_heads = virtual_groups(self.groups, self.heads, self.head_dim, self.rows[2],
                                                         self.split, self.first, self.count)

    def recompute_with(self, runner) -> None:
        """Run the mixer through ``runner(compute, x)`` (--recompute-modules mamba)."""
        self.runner = runner

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None,
                context: ContextParallel | None = None) -> torch.Tensor:
        if self.runner is None:
            return self.compute(x, documents, context)
        # the runner checkpoints the tensors it is given: x only (the documents are no activation)
        return self.runner(functools.partial(self.compute, documents=documents, context=context), x)

    def compute(self, x: torch.Tensor, documents: torch.Tensor | None = None,
                context: ContextParallel | None = None) -> torch.Tensor:
        """out_proj(norm(scan(conv(x, B, C), dt) * SiLU(z))): what --recompute-modules mamba redoes. Under
        context parallelism (``context``) x, B, C and dt go to head shards (megatron-core's
        ``MambaContextParallel``): each cp rank convolves and scans whole sequences for its share of the
        heads (a group cut into shares where cp exceeds the rank's groups), and y comes back; z stays."""
        projected = self.in_proj(x).transpose(0, 1)  # [b, s, rows / tp]: the whole sequence under SP
        b, length = projected.shape[:2]
        grouped = projected.reshape(b, length, self.groups, -1)
        z, rest = grouped.split([self.rows[0], grouped.shape[-1] - self.rows[0]], dim=-1)
        cp = context.group if context is not None else None
        split, count = (self.split, self.count) if cp is not None else (1, self.groups)
        virtual = self._virtual_groups(rest, split)  # [b, s, groups x split, width]
        if cp is not None:
            parts = virtual.unflatten(2, (cp.size, count)).movedim(2, 0).flatten(-2)  # [cp, b, s, count x w]
            virtual = to_heads(parts, cp).unflatten(-1, (count, -1))  # [b, S, count, width]
        y = self._scan(virtual, documents, cp is not None)  # [b, S, my heads, P]
        if cp is not None:
            y = to_sequence(y.flatten(2), cp).movedim(0, 2).flatten(2)  # [b, s, heads x P]
        return self.out_proj(self.gated_norm(y, z.contiguous()).transpose(0, 1))  # z alone, not in_proj's all

    def _virtual_groups(self, rest: torch.Tensor, split: int) -> torch.Tensor:
        """[b, s, groups, x B C dt] -> each group as ``split`` groups of its heads, sharing its B and C."""
        if split == 1:
            return rest
        xs, B, C, dt = rest.split(self.rows[1:], dim=-1)
        shape = (*rest.shape[:3], split)
        parts = [xs.unflatten(-1, (split, -1)), B.unsqueeze(3).expand(*shape, -1),
                 C.unsqueeze(3).expand(*shape, -1), dt.unflatten(-1, (split, -1))]
        return torch.cat(parts, dim=-1).flatten(2, 3)

    def _scan(self, virtual: torch.Tensor, documents: torch.Tensor | None, shares: bool) -> torch.Tensor:
        """Convolve and scan the virtual groups in ``virtual`` ([b, S, count, width]): all of this tp rank's
        groups, or (``shares``, under context parallelism) this cp rank's, with their slices of the
        convolution, A_log, D and dt_bias."""
        b, length, count = virtual.shape[:3]
        split = self.split if shares else 1
        heads = self.heads // (self.groups * split)  # per virtual group
        state = self.rows[2]
        xs, B, C, dt = virtual.split([heads * self.head_dim, state, state, heads], dim=-1)
        weight, bias = self.conv1d.weight, self.conv1d.bias
        A_log, D, dt_bias = self.A_log, self.D, self.dt_bias
        if shares and (split > 1 or count != self.groups):
            weight, bias = (torch.cat([t[start:stop] for start, stop in self.cp_channels])
                            for t in (weight, bias))
            heads_here = slice(*self.cp_heads)
            A_log, D, dt_bias = A_log[heads_here], D[heads_here], dt_bias[heads_here]
        # the convolution keeps its input only (SiLU's input and output remade in backward); the scan keeps
        # contiguous x, B and C, not the convolution's whole output
        convolved = recomputed_causal_conv(torch.cat([xs, B, C], dim=-1).flatten(2), weight, bias, documents)
        xs, B, C = (t.contiguous() for t in
                    convolved.view(b, length, count, -1).split([heads * self.head_dim, state, state], dim=-1))
        dt = F.softplus(dt.reshape(b, length, count * heads).float() + dt_bias.float())
        xs = xs.reshape(b, length, count * heads, self.head_dim)
        return ssd_scan(xs, dt, -torch.exp(A_log.float()), B, C, self.chunk, D, documents)

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm(y * SiLU(z)) over each group's channels, times the weight: y [b, s, H/tp, P] (or its
        channels flat), z [b, s, G/tp, I/G] -> [b, s, I/tp]."""
        b, length = y.shape[:2]
        return GatedRMSNorm.apply(y.reshape(b, length, self.groups, -1), z, self.norm.weight, NORM_EPSILON)
