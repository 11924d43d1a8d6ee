"""The multi-token prediction flags (Megatron's names and defaults), a part of ``models.config.GPTConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.flags import flag


@dataclass
class MTPConfig:
    """How many tokens past the next one the model also predicts (``mtp_num_layers`` depths, each one
    layer of the main model's kind) and how much their losses weigh. Owns values only; ``GPTConfig``
    calls ``validate_mtp``."""

    mtp_num_layers: int | None = field(default=None, metadata=flag(
        "multi-token prediction depths: depth k predicts the token k + 1 after each position from depth k - "
        "1's hidden state and the embedding of the token k after it (DeepSeek-V3's; none or 0: off)"))
    mtp_loss_scaling_factor: float = field(default=0.1, metadata=flag(
        "the depths' losses weigh this / --mtp-num-layers each beside the language-model loss"))

    @property
    def mtp_depths(self) -> int:
        """The multi-token prediction depths (0: none)."""
        return self.mtp_num_layers or 0

    def validate_mtp(self) -> None:
        """ValueError naming the flag for multi-token prediction this build cannot make."""
        if self.mtp_num_layers is not None and self.mtp_num_layers < 0:
            raise ValueError(f"--mtp-num-layers must be >= 0, got {self.mtp_num_layers}")
        if not self.mtp_depths:
            return
        if self.hybrid_layer_pattern:
            raise ValueError(f"--mtp-num-layers with --hybrid-layer-pattern {self.hybrid_layer_pattern!r}: a "
                             "hybrid's depths (the pattern's part after /) are not built yet; drop one")
        if self.num_experts:
            raise ValueError("--mtp-num-layers with --num-experts: multi-token prediction layers of experts "
                             "are not built yet; drop one")
        if not self.mtp_loss_scaling_factor >= 0:
            raise ValueError(f"--mtp-loss-scaling-factor must be >= 0, got {self.mtp_loss_scaling_factor}")
