"""One multi-token prediction depth (megatron-core's ``MultiTokenPredictionLayer``).

Depth k sees, at each position i, the previous depth's hidden state (the main model's after its final
norm, for k = 1) and the embedding of the token k after i: each normed (``hnorm``, ``enorm``), joined
[embedding, hidden], projected back to the hidden size (``eh_proj``, column-parallel as Megatron's, its
output gathered over tp), through its layers (one of the main model's kind; a hybrid pattern's part after
``/``) and a final norm. The model's output
layer turns the result into the logits of the token k + 1 after i.
"""

from __future__ import annotations

import torch
from torch import nn

from models.attention import LayerInputs
from models.config import GPTConfig
from models.layers.stack import LayerStack
from models.norms import build_norm
from parallel.comm import AxisGroup
from parallel.tensor.layers import ColumnParallelLinear
from parallel.tensor.mappings import gather_from_tensor_parallel, scatter_to_sequence_parallel
from parallel.tensor.weight_init import WeightInit


class MTPDepth(LayerStack, nn.Module):
    """Owns its norms (``enorm``, ``hnorm``, ``final_norm``), ``eh_proj`` [h / tp, 2h] (its columns the
    embedding's, then the hidden state's) and ``layers`` (built by the caller from the layer registry: one
    of the main model's kind, or a hybrid pattern's part after ``/``).
    Borrows the embedding and the output layer from its model; communicates over tp only (eh_proj's
    gather and sequence parallelism's scatter, and its layer's own)."""

    def __init__(self, config: GPTConfig, depth: int, tp: AxisGroup, seed: int, sequence_parallel: bool,
                 layers: list[nn.Module]):
        super().__init__()
        h = config.hidden_size
        self.tp, self.sequence_parallel = tp, sequence_parallel and tp.size > 1
        self.enorm = build_norm(config, h, sequence_parallel)
        self.hnorm = build_norm(config, h, sequence_parallel)
        self.eh_proj = ColumnParallelLinear(2 * h, h, tp, WeightInit(seed, f"mtp.{depth}.eh_proj.weight",
                                                                     config.init_method_std),
                                            bias=False, sequence_parallel=sequence_parallel)
        self.layers = nn.ModuleList(layers)
        self.final_norm = build_norm(config, h, sequence_parallel)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """hidden, embedded [s, b, h] (sequence-sharded under sequence parallelism) -> this depth's hidden
        state, normed (the next depth's input, and its logits' through the output layer)."""
        joined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x = gather_from_tensor_parallel(self.eh_proj(joined), self.tp)  # [s, b, h], whole on every rank
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel(x, self.tp)
        return self.final_norm(self.run_layers(x, inputs))


def shifted(tensor: torch.Tensor, shift: int) -> torch.Tensor:
    """[b, s] moved ``shift`` positions left, zeros after the end (Megatron's roll_tensor at cp 1): the
    tokens, positions, labels and loss mask of depth ``shift``."""
    tail = tensor.new_zeros(tensor.shape[0], min(shift, tensor.shape[1]))
    return torch.cat([tensor[:, shift:], tail], dim=1)


def depth_batch(batch: dict, depths: int) -> dict:
    """What the prediction depths read of a micro-batch of whole sequences (``tokens``, ``position_ids``,
    ``labels``, ``loss_mask`` [b, S]; ``documents`` where attention keeps to documents): each as
    ``mtp_<key>`` [D, b, S], depth k's shifted by k (Megatron's roll), the loss mask also cleared where
    the target lies in the next document (its roll within packed sequences). Taken before a
    context-parallel cut, so a cp rank's share of them needs no exchange with its neighbours (Megatron
    swaps the shares' edges)."""
    out = {f"mtp_{key}": torch.stack([shifted(batch[key], k) for k in range(1, depths + 1)])
           for key in ("tokens", "position_ids", "labels", "loss_mask")}
    documents = batch.get("documents")
    if documents is not None:
        same = torch.stack([shifted(documents, k) == documents for k in range(1, depths + 1)])
        out["mtp_loss_mask"] = out["mtp_loss_mask"] * same
    return out
