"""The multi-head latent attention flags (Megatron's names and meanings), a part of
``models.config.GPTConfig``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from models.flags import flag


@dataclass
class LatentAttentionConfig:
    """Whether attention is multi-head latent attention and its shapes: queries through a low-rank latent
    (or one projection), keys and values through one shared latent, each head's query and key made of a
    part without positions (``qk_head_dim``) and a rotary part (``qk_pos_emb_head_dim``, the key's shared
    by the heads), values of their own width. Owns values only; ``GPTConfig.validate`` calls
    ``validate_latent``."""

    multi_latent_attention: bool = field(default=False, metadata=flag(
        "multi-head latent attention (DeepSeek-V2/V3): keys and values from one compressed latent per token"))
    q_lora_rank: int | None = field(default=None, metadata=flag(
        "--multi-latent-attention: rank of the queries' latent (none: one query projection, uncompressed)"))
    kv_lora_rank: int = field(default=512, metadata=flag(
        "--multi-latent-attention: rank of the keys' and values' latent"))
    qk_head_dim: int = field(default=128, metadata=flag(
        "--multi-latent-attention: each head's query / key channels without positions"))
    qk_pos_emb_head_dim: int = field(default=64, metadata=flag(
        "--multi-latent-attention: each head's rotary query / key channels (the key's shared by the heads)"))
    v_head_dim: int = field(default=128, metadata=flag(
        "--multi-latent-attention: each head's value channels"))
    latent_norm_epsilon: float | None = field(default=None, metadata=flag(
        "--multi-latent-attention: the latent norms' epsilon (default: --norm-epsilon, as Megatron's; "
        "transformers' DeepSeek-V3 and Kimi Linear keep 1e-6 whatever rms_norm_eps says)"))
    rope_type: str | None = field(default=None, metadata=flag(
        "Megatron's rotary kind: rope, or yarn (the same as --rope-scaling-type yarn; its factor, mscale "
        "and mscale-all-dim are --rotary-scaling-factor, --mscale, --mscale-all-dim)",
        choices=["rope", "yarn"]))

    @property
    def query_key_channels(self) -> int:
        """Channels of a head's query and key: with latent attention the part without positions and the
        rotary part, else the head's channels."""
        return (self.qk_head_dim + self.qk_pos_emb_head_dim if self.multi_latent_attention
                else self.head_dim)

    @property
    def value_channels(self) -> int:
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    def latent_softmax_scale(self) -> float:
        """1 / sqrt(query/key channels), times yarn's mscale(factor, --mscale-all-dim) squared (DeepSeek
        scales every channel's scores as it scales the rotary ones; Megatron and transformers alike)."""
        scale = self.query_key_channels ** -0.5
        if self.rope_scaling == "yarn" and self.rope_mscale_all_dim and self.rope_scaling_factor > 1:
            mscale = 0.1 * self.rope_mscale_all_dim * math.log(self.rope_scaling_factor) + 1.0
            scale *= mscale * mscale
        return scale

    def validate_latent(self, tp: int) -> None:
        """Raise ValueError naming the flag for a latent attention the model cannot take."""
        if not self.multi_latent_attention:
            for name in ("q_lora_rank", "latent_norm_epsilon"):
                if getattr(self, name) is not None:
                    raise ValueError(f"--{name.replace('_', '-')} shapes multi-head latent attention: add "
                                     "--multi-latent-attention")
            return
        if self.latent_norm_epsilon is not None and self.latent_norm_epsilon <= 0:
            raise ValueError(f"--latent-norm-epsilon must be > 0, got {self.latent_norm_epsilon}")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "q_lora_rank"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"--qk-pos-emb-head-dim {self.qk_pos_emb_head_dim}: rotary positions turn pairs "
                             "of channels; give an even number")
        if self.position_embedding not in ("rope", "none"):
            raise ValueError("--multi-latent-attention turns its --qk-pos-emb-head-dim channels by rotary "
                             "positions (or, with none, leaves them as they are: Kimi Linear's NoPE): add "
                             "--position-embedding-type rope or none")
        conflicts = {"--group-query-attention": self.group_query_attention,
                     "--qk-layernorm": self.qk_layernorm,
                     "--attention-output-gate": self.attention_output_gate,
                     "--kv-channels": self.kv_channels is not None,
                     "--rotary-percent": self.rotary_percent != 1.0,
                     "--attn-logit-softcapping": self.attn_logit_softcapping is not None}
        for name, given in conflicts.items():
            if given:
                raise ValueError(f"{name} with --multi-latent-attention: latent attention has one key and "
                                 "value per head from its latent, its own latent norms and head shapes "
                                 "(--qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim); drop it")
        if self.num_attention_heads % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide --num-attention-heads "
                             f"{self.num_attention_heads}: each rank holds whole heads")
