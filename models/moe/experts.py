"""One rank's experts of one MoE layer: MLPs of --moe-ffn-hidden-size with the model's activation, each
split over the expert tensor-parallel group by width, run together on rows grouped by expert."""

from __future__ import annotations

import torch
from torch import nn

from models.config import GPTConfig
from models.mlp import activation_of
from parallel.comm import AxisGroup
from parallel.experts import ExpertGroups, grouped_linear
from parallel.param_meta import declare
from parallel.tensor.layers import LinearWeights, shard_parameter, with_init
from parallel.tensor.weight_grad import WeightGradStore
from parallel.tensor.weight_init import WeightInit


class Expert(nn.Module):
    """One expert's weights on this rank: fc1 [f / etp (x 2 gated: gate, then up), h] split by width as a
    column-parallel layer's, fc2 [h, f / etp] as a row-parallel one's; fc2's bias whole (each etp rank adds
    1/etp of it and its gradient is summed over etp). Every weight declared ``expert``."""

    def __init__(self, config: GPTConfig, name: str, etp: AxisGroup, width: int, seed: int):
        """``width``: the whole expert's (each etp rank keeps 1/etp of it)."""
        super().__init__()
        h, std = config.hidden_size, config.matrix_init_std
        bias = not config.disable_bias_linear
        shape, dim = ((2, width, h), 1) if config.gated else ((width, h), 0)
        fc1 = WeightInit(seed, f"{name}.fc1.weight", std)
        fc2 = WeightInit(seed, f"{name}.fc2.weight", std).scaled_for_residual(config.residual_branches)
        self.fc1 = LinearWeights(
            declare(shard_parameter(lambda: fc1.full(shape), dim, etp), expert=True),
            declare(shard_parameter(lambda: torch.zeros(shape[:-1]), dim, etp), expert=True)
            if bias else None)
        self.fc2 = LinearWeights(
            declare(shard_parameter(lambda: fc2.full((h, width)), 1, etp), expert=True),
            declare(with_init(nn.Parameter(torch.zeros(h)), lambda: torch.zeros(h)), expert=True,
                    sequence_parallel=etp.size > 1) if bias else None)


class Experts(nn.Module):
    """The experts of one MoE layer that this ep rank holds, [first, first + E / ep), keyed by their index
    in the layer (``experts.5.fc1.weight`` is expert 5's whatever ep is, so a checkpoint re-cuts by name).

    ``forward(rows, counts)``: rows grouped by local expert (``counts`` each) -> this etp rank's partial
    outputs, as one grouped product per matrix (``grouped``: --moe-grouped-gemm) or one product per expert.
    Never communicates: the token dispatcher brings the rows and sums the partials. ``weight_grads``
    (``parallel.tensor.layers.defer_weight_gradients``), when set, lets a split backward defer the products
    for the weights' gradients.
    """

    weight_grads: WeightGradStore | None = None

    def __init__(self, config: GPTConfig, layer: int, groups: ExpertGroups, seed: int):
        super().__init__()
        width = config.moe_ffn_hidden_size or config.ffn_size
        local = config.num_experts // groups.ep.size
        first = groups.ep.rank * local
        self.etp = groups.etp.size
        self.activate = activation_of(config)
        self.grouped = config.moe_grouped_gemm
        self.activation_runner = None  # how the activation runs when it is recomputed
        for e in range(first, first + local):
            name = f"layers.{layer}.mlp.experts.{e}"
            self.add_module(str(e), Expert(config, name, groups.etp, width, seed))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        experts = list(self.children())
        fc1 = [expert.fc1 for expert in experts]
        fc2 = [expert.fc2 for expert in experts]
        biases = [linear.bias.flatten() for linear in fc1] if fc1[0].bias is not None else None
        hidden = grouped_linear(rows, [linear.weight for linear in fc1], counts, biases, self.grouped,
                                self.weight_grads)
        runner = self.activation_runner
        activated = self.activate(hidden) if runner is None else runner.run(self.activate, hidden)
        biases = None
        if fc2[0].bias is not None:
            biases = [linear.bias / self.etp if self.etp > 1 else linear.bias for linear in fc2]
        out = grouped_linear(activated, [linear.weight for linear in fc2], counts, biases, self.grouped,
                             self.weight_grads)
        if runner is not None:  # fc2 has read the activation: dropped until its backward
            runner.drop(self.activate, hidden, activated, out)
        return out

    def recompute_activation_with(self, runner) -> None:
        """Run the activation through ``runner.run(activate, hidden)`` and drop its output once fc2 has
        read it (``runner.drop``: --recompute-modules moe_act)."""
        self.activation_runner = runner

    def deferred_weights(self) -> list[nn.Parameter]:
        """The weights whose gradients a split backward defers (``weight_grads``)."""
        return [linear.weight for expert in self.children() for linear in (expert.fc1, expert.fc2)]
