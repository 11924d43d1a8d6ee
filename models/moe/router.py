"""The mixture-of-experts router's mathematics, with Megatron's flags and meanings (``RouterOptions``):
which experts each token goes to and with what weight, the balancing losses, and the auxiliary-loss-free
expert bias. Pure functions of tensors: no parameters, no communication (the caller sums token counts
over its groups before ``updated_expert_bias`` and the losses).

- ``route``: scores by softmax (over the top-k logits, or over all of them first with
  ``pre_softmax``) or by sigmoid (normalised over the chosen k when k > 1); the choice by plain top-k or
  group-limited top-k (DeepSeek-V3: the experts cut into ``num_groups`` groups, a group scored by the sum of
  its best ``topk / group_topk`` experts, the ``group_topk`` best groups kept); with an ``expert_bias`` the
  bias only decides the choice, the weights stay the unbiased scores; ``topk_scaling_factor`` scales them.
- ``aux_scores``: the scores the balancing losses see (softmax, or sigmoid normalised over all experts) and
  their own top-k map.
- ``switch_aux_loss`` (``--moe-router-load-balancing-type aux_loss``): E / (k T^2) x sum_i (sum_t p_ti)
  (tokens to i), Switch Transformer's loss as Megatron scales it; ``sequence_aux_loss`` (``seq_aux_loss``):
  the same per sequence, averaged over the batch; ``z_loss``: mean over tokens of logsumexp(logits)^2.
- ``drop_tokens`` (``--moe-expert-capacity-factor``): an expert takes at most ceil(T k / E x factor)
  tokens, those of the highest weights (``--moe-token-drop-policy probs``) or the earliest
  (``position``); ``--moe-pad-expert-input-to-capacity`` fills every expert to that many rows (zero weights).
- ``updated_expert_bias``: DeepSeek-V3's rule, each expert's bias moved by the update rate towards the mean
  load (up when it received fewer tokens than the mean, down when more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class RouterOptions:
    """Megatron's --moe-router-* choices for one MoE layer. Owns no tensor."""

    num_experts: int
    topk: int = 2
    score_function: str = "softmax"  # --moe-router-score-function softmax|sigmoid
    pre_softmax: bool = False  # --moe-router-pre-softmax
    num_groups: int | None = None  # --moe-router-num-groups
    group_topk: int | None = None  # --moe-router-group-topk
    topk_scaling_factor: float | None = None  # --moe-router-topk-scaling-factor

    def __post_init__(self):
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"--moe-router-topk {self.topk} must be between 1 and --num-experts "
                             f"{self.num_experts}")
        if self.score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"--moe-router-score-function {self.score_function}: choose softmax or sigmoid")
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError("--moe-router-num-groups and --moe-router-group-topk go together")
        if self.num_groups is not None:
            if self.num_experts % self.num_groups or not 1 <= self.group_topk <= self.num_groups:
                raise ValueError(f"--moe-router-num-groups {self.num_groups} must divide --num-experts "
                                 f"{self.num_experts}, and --moe-router-group-topk {self.group_topk} be "
                                 "between 1 and it")
            per_group = self.num_experts // self.num_groups
            if self.topk % self.group_topk or self.topk // self.group_topk > per_group:
                raise ValueError(f"--moe-router-topk {self.topk} must be a multiple of "
                                 f"--moe-router-group-topk {self.group_topk} that its groups can hold")


def _choose(scores: torch.Tensor, options: RouterOptions) -> torch.Tensor:
    """[T, k] indices of the chosen experts: the top k, within the best groups when routing is limited."""
    if options.num_groups is None:
        return torch.topk(scores, options.topk, dim=-1).indices
    tokens = scores.shape[0]
    grouped = scores.view(tokens, options.num_groups, -1)
    group_scores = grouped.topk(options.topk // options.group_topk, dim=-1).values.sum(dim=-1)
    best = torch.topk(group_scores, options.group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
    masked = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(tokens, -1)
    return torch.topk(masked, options.topk, dim=-1).indices


def route(logits: torch.Tensor, options: RouterOptions,
          expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, E], zero where an expert is not chosen; chosen [T, E] bool) of ``logits`` [T, E]."""
    if options.score_function == "softmax":
        if options.pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            chosen = _choose(scores, options)
            weights = scores.gather(1, chosen)
        else:
            chosen = _choose(logits, options)
            weights = torch.softmax(logits.gather(1, chosen), dim=-1, dtype=torch.float32).type_as(logits)
    else:
        scores = torch.sigmoid(logits.float()).type_as(logits)
        chosen = _choose(scores if expert_bias is None else scores + expert_bias, options)
        weights = scores.gather(1, chosen)
        if options.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if options.topk_scaling_factor:
        weights = weights * options.topk_scaling_factor
    routed = torch.zeros_like(logits).scatter(1, chosen, weights)
    return routed, torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)


def drop_tokens(weights: torch.Tensor, chosen: torch.Tensor, topk: int, capacity_factor: float,
                policy: str = "probs", pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, chosen) [T, E] with each expert's tokens beyond its capacity dropped (``policy`` "probs":
    the lowest weights go; "position": the latest tokens go); with ``pad`` every expert's map holds exactly
    its capacity, the rows no token fills at weight zero."""
    tokens, experts = weights.shape
    capacity = math.ceil(tokens * topk / experts * capacity_factor)
    if capacity >= tokens:
        keep = torch.ones_like(chosen)
    else:
        if policy == "probs":
            rank = weights
        elif policy == "position":  # routed tokens first, each group in token order
            order = torch.arange(tokens, 0, -1, device=weights.device, dtype=torch.float32).unsqueeze(1)
            rank = chosen.float() * (tokens + 1) + order
        else:
            raise ValueError(f"--moe-token-drop-policy {policy}: choose probs or position")
        keep = torch.zeros_like(chosen).scatter(0, torch.topk(rank, capacity, dim=0).indices, True)
    kept = keep if pad else chosen & keep
    return weights * kept, kept


def aux_scores(logits: torch.Tensor, options: RouterOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, E] the balancing losses see, their own top-k map [T, E] bool)."""
    if options.score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    chosen = torch.topk(scores, options.topk, dim=-1).indices
    return scores, torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)


def switch_aux_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_tokens: int, topk: int,
                    coefficient: float) -> torch.Tensor:
    """Switch Transformer's balancing loss as Megatron scales it: ``scores`` [T, E] of this rank's tokens,
    ``tokens_per_expert`` [E] and ``total_tokens`` counted at the level the loss balances (the batch)."""
    experts = scores.shape[-1]
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (experts * coefficient
                                                            / (topk * total_tokens * total_tokens))


def sequence_aux_loss(scores: torch.Tensor, chosen: torch.Tensor, sequence_length: int, topk: int,
                      coefficient: float, local_length: int | None = None,
                      sum_counts: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The balancing loss of each sequence on its own, averaged over the sequences: ``scores`` and
    ``chosen`` [l * b, E] in Megatron's token order (position-major: token t of sequence j at t * b + j),
    ``l`` = ``local_length`` tokens of each sequence of ``sequence_length``. Where the other tokens of the
    sequences are on other ranks, ``sum_counts`` sums the per-sequence counts [b, E] over them: this rank's
    share of the loss is returned (the shares sum to the loss)."""
    experts, local = scores.shape[-1], local_length or sequence_length
    batch = scores.shape[0] // local
    per_sequence = scores.float().view(local, batch, experts).sum(dim=0)  # [b, E]
    counts = chosen.view(local, batch, experts).sum(dim=0).to(per_sequence.dtype)
    if sum_counts is not None:
        counts = sum_counts(counts)
    return (per_sequence * counts).sum() * (experts * coefficient
                                            / (topk * sequence_length * sequence_length)) / batch


def z_loss(logits: torch.Tensor, coefficient: float) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2, times ``coefficient``."""
    return torch.logsumexp(logits, dim=-1).square().mean() * coefficient


@torch.no_grad()
def updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor,
                        rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing: each bias moves by ``rate`` towards the mean load
    (``tokens_per_expert`` [..., E], summed over every rank that routes with this bias)."""
    mean = tokens_per_expert.float().sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(mean - tokens_per_expert) * rate
