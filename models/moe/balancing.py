"""How a rank's MoE layers keep their experts' load balanced, and what the balance was in a step.

A MoE layer's balancing losses (auxiliary, sequence-auxiliary, z) never join the model's output: their
gradient is added where the layer's output flows back (``attach``), scaled as the main loss of one
micro-batch is (``gradient_scale``, which the training loop sets each step: the loss scale / micro-batches,
times cp, as gradients are averaged over the context-parallel ranks that each hold a share of the losses).
So every pipeline stage trains its own layers' balance, as Megatron's auxiliary-loss scaler does.

Auxiliary-loss-free balancing (--moe-router-enable-expert-bias, DeepSeek-V3): a bias per expert that only
decides the choice, moved after each step towards the mean load by the rate. Every rank holds every
layer's biases and moves them alike from the world's token counts, so the table is a run state: the same
on every rank, saved once, loaded in any layout.
"""

from __future__ import annotations

import torch

from models.moe.router import updated_expert_bias
from parallel import comm
from parallel.comm import AxisGroup


class _Attach(torch.autograd.Function):
    """The identity on ``x`` whose backward also starts ``loss``'s backward, at the holder's scale."""

    @staticmethod
    def forward(ctx, x, loss, holder):
        ctx.holder = holder
        return x

    @staticmethod
    def backward(ctx, grad):
        scale = ctx.holder.gradient_scale
        return grad, torch.full((), scale, dtype=torch.float32, device=grad.device), None


class LoadBalancing:
    """Owns, for one rank's MoE layers (all its model chunks): the factor their losses' gradients are scaled
    by (``gradient_scale``); summed over the layers and micro-batches since ``reset`` (forward passes that
    build a graph only, so that a recomputed forward does not count twice), each loss's value and the tokens
    each layer's experts received; and with ``bias_rate`` the expert-bias table [layers, E] of the whole
    model (fp32). Never changes the routing but through the biases, nor the main loss."""

    @staticmethod
    def for_model(config) -> "LoadBalancing":
        """The balancing of a rank's MoE layers of a model of ``config`` (a ``GPTConfig``: its layers,
        experts, and the expert biases' rate with --moe-router-enable-expert-bias); the prediction depths'
        layers are numbered past the model's."""
        rate = config.moe_router_bias_update_rate if config.moe_router_enable_expert_bias else None
        return LoadBalancing(config.num_layers + len(config.mtp_moe_layers()), config.num_experts or 0, rate)

    def __init__(self, num_layers: int = 0, num_experts: int = 0, bias_rate: float | None = None) -> None:
        self.gradient_scale = 1.0
        self.losses: dict[str, torch.Tensor] = {}
        self.tokens_per_expert: dict[int, torch.Tensor] = {}
        self.bias_rate = bias_rate
        self.shape = (num_layers, num_experts)
        self.expert_bias: torch.Tensor | None = None  # made on the first layer's device when first read

    def attach(self, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """``x``, with ``loss`` (a scalar) trained through it."""
        return _Attach.apply(x, loss, self) if loss.requires_grad else x

    def record(self, name: str, loss: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            value = loss.detach().double()
            self.losses[name] = value + self.losses[name] if name in self.losses else value

    def record_tokens(self, layer: int, counts: torch.Tensor) -> None:
        """``counts`` [E]: the tokens each of ``layer``'s experts received from this rank's tokens."""
        if torch.is_grad_enabled():
            previous = self.tokens_per_expert.get(layer)
            counts = counts.detach().to(torch.float64)
            self.tokens_per_expert[layer] = counts if previous is None else previous + counts

    def reset(self) -> None:
        self.losses.clear()
        self.tokens_per_expert.clear()

    def bias(self, layer: int, device: torch.device) -> torch.Tensor | None:
        """``layer``'s expert biases [E] (None without --moe-router-enable-expert-bias)."""
        return None if self.bias_rate is None else self._table(device)[layer]

    def _table(self, device: torch.device) -> torch.Tensor:
        if self.expert_bias is None:
            self.expert_bias = torch.zeros(self.shape, dtype=torch.float32, device=device)
        return self.expert_bias

    def update_biases(self, world: AxisGroup, device: torch.device) -> None:
        """Move every MoE layer's biases by the rate towards its mean load, from the tokens every rank's
        experts received this step (a collective over the world: each stage adds its own layers' counts)."""
        if self.bias_rate is None:
            return
        counts = torch.zeros(self.shape, dtype=torch.float64, device=device)
        for layer, tokens in self.tokens_per_expert.items():
            counts[layer] += tokens.to(device)
        comm.all_reduce(counts, world)
        moe = counts.sum(dim=1) > 0  # the MoE layers (a dense layer's row stays zero)
        table = self._table(device)
        table[moe] = updated_expert_bias(counts, table, self.bias_rate)[moe].float()

    def state_dict(self) -> dict:
        """The expert-bias table, as plain lists (a run state: the same on every rank)."""
        return {"expert_bias": self.expert_bias.tolist()} if self.expert_bias is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if "expert_bias" in state and self.bias_rate is not None:
            saved = torch.tensor(state["expert_bias"], dtype=torch.float32)
            if tuple(saved.shape) != self.shape:
                raise ValueError(f"the saved expert biases are {tuple(saved.shape)}, this model's "
                                 f"{self.shape} (--num-layers x --num-experts)")
            device = self.expert_bias.device if self.expert_bias is not None else saved.device
            self.expert_bias = saved.to(device)
