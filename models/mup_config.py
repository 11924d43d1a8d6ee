"""muP's flags (Megatron-LM's names and meanings, megatron-core 0.17+), a part of ``models.config.GPTConfig``.

The maximal update parametrization (Tensor Programs V) makes a model of width ``h`` train like its proxy of
width ``--mup-base-hidden-size``, so that a learning rate tuned on the proxy carries over. With the width
multiplier ``m = h / base`` (global sizes: tensor parallelism does not change it): hidden matrices start
from ``N(0, std / sqrt(m))`` (residual output projections also by ``1 / sqrt(2 layers)``), embeddings and
the output layer from ``N(0, std)``; attention scores are scaled ``s / head_dim^p`` (``s`` the square root
of ``--mup-base-head-dim``, 1 without; ``p`` ``--mup-attn-scale-power``, 1: the ``1/d`` of muP), the
embeddings' output by ``--mup-embedding-mult``, the logits by ``--mup-output-mult`` (``1/m`` unless given);
AdamW's learning rate and epsilon of the hidden matrices are divided by ``m``
(``pretrain.training.param_groups``). ``docs/mup_design.md`` holds the rules as Megatron states them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from models.flags import flag


@dataclass
class MuPConfig:
    """muP's switches and its base model's sizes. Owns values only; ``GPTConfig.validate`` calls
    ``validate_mup``."""

    use_mup: bool = field(default=False, metadata=flag(
        "the maximal update parametrization (muP): width-scaled init, attention 1/d, logits / m, hidden "
        "matrices' AdamW rate and epsilon / m, m = --hidden-size / --mup-base-hidden-size"))
    mup_base_hidden_size: int | None = field(default=None, metadata=flag(
        "--use-mup: the width of the proxy model the rates were tuned on (default: --hidden-size, m = 1)"))
    mup_embedding_mult: float = field(default=1.0, metadata=flag(
        "--use-mup: a factor on the embeddings' output"))
    mup_output_mult: float | None = field(default=None, metadata=flag(
        "--use-mup: a factor on the logits (default 1 / m)"))
    mup_base_head_dim: float | None = field(default=None, metadata=flag(
        "--use-mup: scores scaled sqrt(this) / head_dim^p, the standard scale at the base head size "
        "(default: 1 / head_dim^p)"))
    mup_attn_scale_power: float = field(default=1.0, metadata=flag(
        "--use-mup: the power p of head_dim in the attention scale (1: muP's 1/d; 0.5: the standard one)"))

    @property
    def mup_width_mult(self) -> float:
        """m: the width over the base width (1 without muP)."""
        if not self.use_mup or self.mup_base_hidden_size is None:
            return 1.0
        return self.hidden_size / self.mup_base_hidden_size

    @property
    def matrix_init_std(self) -> float:
        """The std hidden matrices start from: --init-method-std, / sqrt(m) under muP."""
        return self.init_method_std / math.sqrt(self.mup_width_mult)

    @property
    def logit_multiplier(self) -> float:
        """What the logits are multiplied by (1 without muP)."""
        if not self.use_mup:
            return 1.0
        return self.mup_output_mult if self.mup_output_mult is not None else 1.0 / self.mup_width_mult

    def mup_attention_scale(self) -> float:
        """muP's score scale: sqrt(base head dim or 1) / head_dim^p."""
        base = math.sqrt(self.mup_base_head_dim) if self.mup_base_head_dim is not None else 1.0
        return base / self.head_dim ** self.mup_attn_scale_power

    def validate_mup(self) -> None:
        """ValueError naming the flag for muP settings this model cannot take."""
        given = [name for name in ("mup_base_hidden_size", "mup_output_mult", "mup_base_head_dim")
                 if getattr(self, name) is not None] + [
            name for name, default in (("mup_embedding_mult", 1.0), ("mup_attn_scale_power", 1.0))
            if getattr(self, name) != default]
        if not self.use_mup:
            if given:
                raise ValueError(f"--{given[0].replace('_', '-')} sets muP up: add --use-mup")
            return
        if self.mup_base_hidden_size is not None and self.mup_base_hidden_size < 1:
            raise ValueError(f"--mup-base-hidden-size must be >= 1, got {self.mup_base_hidden_size}")
        if not 0 < self.mup_attn_scale_power <= 1:
            raise ValueError(f"--mup-attn-scale-power {self.mup_attn_scale_power:g}: the power of head_dim "
                             "in the attention scale is in (0, 1] (1: muP's 1/d; 0.5: the standard "
                             "1/sqrt(d))")
        for name in ("mup_embedding_mult", "mup_output_mult", "mup_base_head_dim"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if self.multi_latent_attention:
            raise ValueError("--use-mup with --multi-latent-attention: latent attention's width rules are "
                             "not built (Megatron's muP covers standard attention); drop one")
