"""QK-clip (Kimi K2, Megatron-LM's --qk-clip) and --log-max-attention-logit: after each optimizer step, the
largest attention logit each head reached in the step's forwards, agreed over data x context parallelism;
the heads above --qk-clip-threshold get their query and key projections scaled back (``clip_factors`` of
each attention layer) in the optimizer's masters and parameters."""

from __future__ import annotations

import torch
from torch import nn

from models.attention import AttentionCore
from parallel import comm
from parallel.process_groups import ParallelGroups
from parallel.zero.row_scaling import scale_rows


class QKClip:
    """Watches every attention layer of this rank's chunks (their ``max_logits``). Owns nothing but the
    threshold and alpha; clips through the optimizer (``scale_rows``), never around it."""

    def __init__(self, chunks: nn.ModuleList, groups: ParallelGroups, num_layers: int, clip: bool,
                 threshold: float, alpha: float):
        self.cores = [core for chunk in chunks for core in chunk.modules() if isinstance(core, AttentionCore)]
        for core in self.cores:
            core.track_logits()
        self.groups, self.num_layers = groups, num_layers
        self.clip, self.threshold, self.alpha = clip, threshold, alpha

    def after_step(self, optimizer, skipped: bool, device: torch.device) -> list[float]:
        """Clip (unless the step was skipped) and return the largest logit of every layer of the model (a
        collective over the world: every rank calls it after every step)."""
        maxima = [core.take_max_logits() for core in self.cores]
        heads = [len(m) if m is not None else 0 for m in maxima]
        flat = torch.cat([m.float().to(device) for m in maxima if m is not None]
                         or [torch.empty(0, device=device)])
        comm.all_reduce(flat, self.groups.dp_cp, op=torch.distributed.ReduceOp.MAX)
        per_head = list(flat.split(heads))
        if self.clip and not skipped:
            factors = {}
            for core, logits in zip(self.cores, per_head):
                if len(logits):
                    factors.update(core.clip_factors(logits, self.threshold, self.alpha))
            if factors:  # the same on every rank of a dense dp group (its maxima were agreed over dp x cp)
                scale_rows(optimizer, factors)
        layers = torch.full((self.num_layers,), float("-inf"), device=device)
        for core, logits in zip(self.cores, per_head):
            if len(logits):
                layers[core.layer] = torch.maximum(layers[core.layer], logits.max())
        comm.all_reduce(layers, self.groups.world, op=torch.distributed.ReduceOp.MAX)
        return layers.tolist()
