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
        """The multi-token prediction depths (0: none): a hybrid pattern's parts after ``/``, else
        --mtp-num-layers."""
        pattern = self.parsed_pattern()
        return pattern.depths if pattern is not None else self.mtp_num_layers or 0

    def mtp_layer_types(self) -> list[str]:
        """Each depth's layers' entries in the layer registry: a hybrid pattern's part after ``/``, else one
        layer of the main model's last kind."""
        pattern = self.parsed_pattern()
        return list(pattern.mtp) if pattern is not None else self.layer_types()[-1:]

    def mtp_moe_layers(self) -> list[bool]:
        """Which of the depths' layers (numbered past the model's, depth by depth) are mixtures of experts."""
        return ["E" in entry for entry in self.mtp_layer_types()] * self.mtp_depths

    def moe_layers_with_depths(self) -> list[bool]:
        """``moe_layers`` of the model's layers, then of the depths' (as ``LoadBalancing`` numbers them)."""
        return self.moe_layers(self.num_layers) + self.mtp_moe_layers()

    def validate_mtp(self) -> None:
        """ValueError naming the flag for multi-token prediction this build cannot make."""
        if self.mtp_num_layers is not None and self.mtp_num_layers < 0:
            raise ValueError(f"--mtp-num-layers must be >= 0, got {self.mtp_num_layers}")
        pattern = self.parsed_pattern()
        if pattern is not None and self.mtp_num_layers and self.mtp_num_layers != pattern.depths:
            raise ValueError(f"--mtp-num-layers {self.mtp_num_layers} beside --hybrid-layer-pattern "
                             f"{pattern.text!r} ({pattern.depths} depths after /): a hybrid's depths are the "
                             "pattern's parts after /, each of the same layers (e.g. 'M*M-/*-/*-'); drop the "
                             "flag")
        if not self.mtp_depths:
            return
        if not self.mtp_loss_scaling_factor >= 0:
            raise ValueError(f"--mtp-loss-scaling-factor must be >= 0, got {self.mtp_loss_scaling_factor}")
