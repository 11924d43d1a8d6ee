"""The Mamba-2 layer's flags (Megatron's names and defaults), a part of ``models.config.GPTConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.flags import flag

CONV_KERNEL = 4  # Megatron's d_conv; no flag
EXPAND = 2  # the inner width is 2 h unless --mamba-num-heads sets it; no flag
NORM_EPSILON = 1e-5  # the gated norm's epsilon in megatron-core's MambaMixer; no flag


@dataclass
class MambaConfig:
    """The shapes of the Mamba-2 layers (``M`` in ``--hybrid-layer-pattern``): H heads of P channels
    (inner width I = H P), G groups sharing their B and C projections of N states each. Owns values
    only; ``GPTConfig.validate`` calls ``validate_mamba`` where the pattern has a Mamba layer."""

    mamba_state_dim: int = field(default=128, metadata=flag("Mamba-2: states per group N (d_state)"))
    mamba_head_dim: int = field(default=64, metadata=flag("Mamba-2: channels per head P"))
    mamba_num_groups: int = field(default=8, metadata=flag(
        "Mamba-2: groups G sharing B and C (tp must divide it; it divides the heads)"))
    mamba_num_heads: int | None = field(default=None, metadata=flag(
        "Mamba-2: heads H (default 2 --hidden-size / --mamba-head-dim)"))
    mamba_chunk_size: int = field(default=128, metadata=flag(
        "Mamba-2: tokens per chunk of the scan (its memory and speed, not its result)"))

    @property
    def mamba_heads(self) -> int:
        return self.mamba_num_heads or EXPAND * self.hidden_size // self.mamba_head_dim

    @property
    def mamba_inner(self) -> int:
        """The inner width I = H x P (x, z and the output)."""
        return self.mamba_heads * self.mamba_head_dim

    @property
    def mamba_conv_channels(self) -> int:
        """The channels the convolution runs over: x, B and C (I + 2 G N)."""
        return self.mamba_inner + 2 * self.mamba_num_groups * self.mamba_state_dim

    @property
    def mamba_projection_rows(self) -> int:
        """The input projection's outputs: z, x, B, C and dt (2 I + 2 G N + H)."""
        return self.mamba_inner + self.mamba_conv_channels + self.mamba_heads

    def validate_mamba(self, tp: int = 1, cp: int = 1) -> None:
        """ValueError naming the flag for Mamba shapes the layer (at this tp and cp) cannot take."""
        for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        heads, groups = self.mamba_heads, self.mamba_num_groups
        if self.mamba_num_heads is None and (EXPAND * self.hidden_size) % self.mamba_head_dim:
            raise ValueError(f"--mamba-head-dim {self.mamba_head_dim} does not divide the inner width 2 x "
                             f"--hidden-size = {EXPAND * self.hidden_size}: choose one that does, or give "
                             "--mamba-num-heads")
        if heads < 1:
            raise ValueError(f"--mamba-num-heads must be >= 1, got {heads}")
        if heads % groups:
            raise ValueError(f"--mamba-num-groups {groups} does not divide the {heads} Mamba heads "
                             "(--mamba-num-heads): each group serves an equal share of them")
        if groups % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide --mamba-num-groups "
                             f"{groups}: "
                             "each rank holds whole groups; choose a tp that divides it")
        if cp > 1 and (heads // tp) % cp:
            raise ValueError(f"--context-parallel-size {cp} does not divide a tensor-parallel rank's "
                             f"{heads // tp} Mamba heads (--mamba-num-heads {heads} / "
                             f"--tensor-model-parallel-size {tp}): each cp rank scans whole heads")
        local_groups = groups // tp
        if cp > 1 and local_groups % cp and cp % local_groups:
            raise ValueError(f"--context-parallel-size {cp} and a tensor-parallel rank's {local_groups} "
                             f"groups (--mamba-num-groups {groups} / --tensor-model-parallel-size {tp}): "
                             "one must divide the other, as each cp rank takes whole groups or a share "
                             "of one")
