"""The mixture-of-experts layer that takes a block's MLP place: router, token dispatcher, this rank's experts
and the shared expert, with Megatron's flags (``models.moe.config``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import GPTConfig
from models.mlp import MLP
from models.moe.balancing import LoadBalancing
from models.moe.experts import Experts
from models.moe.router import aux_scores, drop_tokens, route, sequence_aux_loss, switch_aux_loss, z_loss
from parallel import comm
from parallel.comm import AxisGroup, compile_boundary
from parallel.experts import DISPATCHERS, ExpertGroups, gather_rows
from parallel.param_meta import declare
from parallel.tensor.layers import LinearWeights, with_init
from parallel.tensor.weight_init import WeightInit

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class MoELayer(nn.Module):
    """x [s, b, h] (a sequence shard under sequence parallelism) -> sum over each token's top-k experts of
    weight x expert(token), plus the shared expert's output (gated with --moe-shared-expert-gate).

    Owns the router's weight [E, h] and bias [E] (with linear biases; both replicated, their gradients
    partial under sequence parallelism), this rank's ``experts`` and the ``shared_experts`` MLP (split
    over tp as the dense MLP is). The routing is
    decided here, once per forward, from the logits alone: a recomputed forward routes the same tokens the
    same way. With a capacity factor the choice of tokens to drop is made over the whole sequences of the
    micro-batch (all tp x cp ranks' tokens, as one process would), and every token counts in the
    balancing losses, whose gradients enter through ``balancing`` (``models.moe.balancing``, which also
    holds the expert biases of auxiliary-loss-free balancing). It never
    communicates outside its tp and expert groups.
    """

    RECOMPUTE_MODULE = "moe"  # --recompute-modules moe recomputes it

    def __init__(self, config: GPTConfig, layer: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 groups: ExpertGroups, balancing: LoadBalancing):
        super().__init__()
        h, experts = config.hidden_size, config.num_experts
        self.layer, self.config, self.groups, self.balancing = layer, config, groups, balancing
        self.options = config.router_options
        self.router_dtype = ROUTER_DTYPES.get(config.moe_router_dtype)
        split = sequence_parallel and tp.size > 1
        router = WeightInit(seed, f"layers.{layer}.mlp.router.weight", config.matrix_init_std)
        router_bias = None
        if not config.disable_bias_linear:  # Megatron's router has a bias with linear biases (gpt-oss)
            router_bias = declare(with_init(nn.Parameter(torch.zeros(experts)), lambda: torch.zeros(experts)),
                                  sequence_parallel=split)
        self.router = LinearWeights(declare(with_init(nn.Parameter(router.full((experts, h))),
                                                      lambda: router.full((experts, h))),
                                            sequence_parallel=split), router_bias)
        self.experts = Experts(config, layer, groups, seed)
        self.dispatcher = DISPATCHERS[config.moe_token_dispatcher_type](experts, groups)
        self.shared_experts = None
        self.shared_gate = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = MLP(config, layer, tp, seed, sequence_parallel,
                                      width=config.moe_shared_expert_intermediate_size,
                                      name="mlp.shared_experts")
            if config.moe_shared_expert_gate:
                gate = WeightInit(seed, f"layers.{layer}.mlp.shared_gate.weight", config.matrix_init_std)
                self.shared_gate = LinearWeights(
                    declare(with_init(nn.Parameter(gate.full((1, h))), lambda: gate.full((1, h))),
                            sequence_parallel=split), None)
        self.runner = None  # how the layer runs when it is recomputed (``recompute_with``)

    def recompute_with(self, runner) -> None:
        """Run the layer through ``runner(compute, x)`` (--recompute-modules moe)."""
        self.runner = runner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.runner(self.compute, x) if self.runner is not None else self.compute(x)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # position-major, as Megatron orders them
        dtype = self.router_dtype or x.dtype
        bias = self.router.bias
        logits = F.linear(tokens.to(dtype), self.router.weight.to(dtype),
                          None if bias is None else bias.to(dtype))
        weights, chosen = route(logits, self.options, self.balancing.bias(self.layer, logits.device))
        if self.config.moe_expert_capacity_factor is not None:
            weights, chosen = self._dropped(weights, chosen)
        out = self._dispatched(tokens, weights, chosen).to(x.dtype).view_as(x)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(F.linear(x, self.shared_gate.weight))
            out = out + shared
        loss = self._balancing_loss(logits, local_length=x.shape[0])
        return out if loss is None else self._attached(out, loss)

    @compile_boundary  # an autograd function holding the balancing's Python state
    def _attached(self, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return self.balancing.attach(out, loss)

    @compile_boundary  # tokens travel with host-read sizes; the experts' shapes follow the routing
    def _dispatched(self, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        self.balancing.record_tokens(self.layer, chosen.sum(dim=0))
        return self.dispatcher.run(tokens, weights, chosen, self.experts)

    @compile_boundary  # it gathers over the tp x cp group
    def _dropped(self, weights: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each expert's tokens beyond its capacity dropped, decided over the whole micro-batch's tokens."""
        config, group = self.config, self.groups.tokens
        every_weight = gather_rows(weights.detach(), group)
        every_choice = gather_rows(chosen, group)
        _, kept = drop_tokens(every_weight, every_choice, self.options.topk,
                              config.moe_expert_capacity_factor,
                              config.moe_token_drop_policy, config.moe_pad_expert_input_to_capacity)
        mine = kept[group.rank * weights.shape[0]:(group.rank + 1) * weights.shape[0]]
        return weights * mine, mine

    @compile_boundary  # it sums token counts over the tp x cp group and records them
    def _balancing_loss(self, logits: torch.Tensor, local_length: int) -> torch.Tensor | None:
        """This rank's share of the layer's balancing and z losses (the shares over the tp x cp ranks sum to
        the losses of the micro-batch's whole sequences), recorded in ``balancing``; None without any."""
        config, group, topk = self.config, self.groups.tokens, self.options.topk
        total = None
        kind, coefficient = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
        if kind != "none" and coefficient > 0:
            scores, chosen = aux_scores(logits, self.options)

            def summed(counts: torch.Tensor) -> torch.Tensor:
                comm.all_reduce(counts, group)
                return counts

            if kind == "aux_loss":
                counts = summed(chosen.sum(dim=0).to(scores.dtype))
                total = switch_aux_loss(scores, counts, logits.shape[0] * group.size, topk, coefficient)
            else:
                total = sequence_aux_loss(scores, chosen, local_length * group.size, topk, coefficient,
                                          local_length=local_length, sum_counts=summed)
            self.balancing.record(kind, total)
        if config.moe_z_loss_coeff:
            z = z_loss(logits, config.moe_z_loss_coeff) / group.size
            self.balancing.record("z_loss", z)
            total = z if total is None else total + z
        return total
