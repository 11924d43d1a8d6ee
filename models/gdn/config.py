"""The gated delta net layer's flags (Megatron's names and defaults), a part of
``models.config.GPTConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.flags import flag
from models.moe.config import parse_layer_freq

VARIANTS = ("gated_delta_net", "gdn")  # Megatron's --experimental-attention-variant names of it


@dataclass
class GatedDeltaConfig:
    """The shapes of the gated delta net layers (``G`` in ``--hybrid-layer-pattern``): Hk key heads of dk
    channels (queries alike), Hv value heads of dv channels (each key head serves Hv / Hk of them, as
    Qwen3-Next's grouped heads), and the short convolution's taps; Kimi delta attention (``K``) has Hv
    heads of dv channels for its q, k and v alike (Kimi Linear's one head count and width). Owns values
    only; ``GPTConfig`` calls ``validate_gated_delta`` / ``validate_kimi_delta`` where the pattern has such
    a layer."""

    linear_num_key_heads: int = field(default=16, metadata=flag(
        "gated delta net: key (and query) heads Hk (tp must divide it)"))
    linear_num_value_heads: int = field(default=32, metadata=flag(
        "gated delta net: value heads Hv (a multiple of the key heads)"))
    linear_key_head_dim: int = field(default=128, metadata=flag("gated delta net: channels per key head"))
    linear_value_head_dim: int = field(default=128, metadata=flag(
        "gated delta net: channels per value head"))
    linear_conv_kernel_dim: int = field(default=4, metadata=flag(
        "gated delta net: taps of the causal convolution over q, k and v"))
    linear_allow_neg_eigval: bool = field(default=False, metadata=flag(
        "gated delta net: beta = 2 sigmoid(b), in (0, 2), so the state's transition may have negative "
        "eigenvalues (the OLMo hybrid's linear_allow_neg_eigval)"))
    linear_output_norm_epsilon: float | None = field(default=None, metadata=flag(
        "gated delta net: its output norm's epsilon (default: --norm-epsilon, as megatron-core's; the OLMo "
        "hybrid's is 1e-5 whatever its other norms take)"))
    experimental_attention_variant: str | None = field(default=None, metadata=flag(
        "Megatron's GPT path to gated delta nets: each layer's attention one, but where "
        "--linear-attention-freq puts softmax attention (the model becomes a --hybrid-layer-pattern)",
        choices=list(VARIANTS)))
    linear_attention_freq: str | None = field(default=None, metadata=flag(
        "with --experimental-attention-variant: N (softmax attention in every N-th layer, gated delta nets "
        "in the others) or a list per layer, 1 a gated delta net and 0 attention"))

    @property
    def gdn_key_width(self) -> int:
        """The width of the queries (and of the keys): Hk dk."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_width(self) -> int:
        """The width of the values (and of the output gate z, and the output): Hv dv."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_channels(self) -> int:
        """The channels the convolution runs over: q, k and v (2 Hk dk + Hv dv)."""
        return 2 * self.gdn_key_width + self.gdn_value_width

    @property
    def gdn_projection_rows(self) -> int:
        """The input projection's outputs: q, k, v, z, beta and the decay's input (2 Hk dk + 2 Hv dv +
        2 Hv)."""
        return self.gdn_conv_channels + self.gdn_value_width + 2 * self.linear_num_value_heads

    @property
    def gdn_output_norm_epsilon(self) -> float:
        """The output norm's epsilon in effect: --linear-output-norm-epsilon, else --norm-epsilon."""
        return (self.layernorm_epsilon if self.linear_output_norm_epsilon is None
                else self.linear_output_norm_epsilon)

    @property
    def gdn_projection_parts(self) -> dict[str, int]:
        """The input projection's parts as megatron-core (and OLMo hybrid's separate projections) order them,
        each part's rows key head by key head: query, key, value, z, beta and the decay's input alpha."""
        keys, values, heads = self.gdn_key_width, self.gdn_value_width, self.linear_num_value_heads
        return {"query": keys, "key": keys, "value": values, "z": values, "beta": heads, "alpha": heads}

    @property
    def kda_conv_channels(self) -> int:
        """Kimi delta attention's convolution channels: q, k and v of its H = Hv heads of d = dv (3 H d)."""
        return 3 * self.gdn_value_width

    @property
    def kda_projection_rows(self) -> int:
        """Kimi delta attention's input projection: q, k, v and beta's input per head (H (3 d + 1))."""
        return self.kda_conv_channels + self.linear_num_value_heads

    @property
    def kda_exchanged_width(self) -> int:
        """What each token of a Kimi delta attention sends to its heads' cp rank: q, k, v, b and the decay's
        input (H (4 d + 1))."""
        return self.kda_projection_rows + self.gdn_value_width

    def gated_delta_pattern(self, moe: list[bool], attention: str) -> str:
        """The --hybrid-layer-pattern of Megatron's GPT path with --experimental-attention-variant: layer i
        a gated delta net (``G``) unless --linear-attention-freq N has (i + 1) % N == 0 (or its list a 0
        there: ``attention``), then its MLP (``E`` where ``moe`` says a mixture of experts, else ``-``)."""
        shown = f"--experimental-attention-variant {self.experimental_attention_variant}"
        if self.linear_attention_freq is None:
            raise ValueError(f"{shown} needs --linear-attention-freq (N, or a list of 1 and 0 per layer)")
        freq = parse_layer_freq(self.linear_attention_freq, "--linear-attention-freq")
        layers = len(moe)
        linear = ([(i + 1) % freq != 0 for i in range(layers)] if isinstance(freq, int) and freq >= 1
                  else [bool(value) for value in freq] if isinstance(freq, list) else [])
        if len(linear) != layers:
            raise ValueError(f"--linear-attention-freq {self.linear_attention_freq}: give N >= 1 or one "
                             f"entry per layer (--num-layers {layers})")
        return "".join(("G" if gated else attention) + ("E" if expert else "-")
                       for gated, expert in zip(linear, moe))

    def validate_kimi_delta(self, tp: int = 1, cp: int = 1) -> None:
        """ValueError naming the flag for Kimi delta attention (``K``) shapes: its heads are the
        --linear-num-value-heads, each of --linear-value-head-dim channels for q, k and v alike."""
        heads = self.linear_num_value_heads
        for name in ("linear_num_value_heads", "linear_value_head_dim", "linear_conv_kernel_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.normalization != "RMSNorm":
            raise ValueError(f"--normalization {self.normalization} with Kimi delta attention (K): its "
                             "output norm is built as an RMSNorm only; give --normalization RMSNorm")
        if heads % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide --linear-num-value-heads "
                             f"{heads} (Kimi delta attention's heads): each rank holds whole heads")
        if cp > 1 and (heads // tp) % cp:
            raise ValueError(f"--context-parallel-size {cp} does not divide a tensor-parallel rank's "
                             f"{heads // tp} Kimi delta attention heads (--linear-num-value-heads {heads} / "
                             f"--tensor-model-parallel-size {tp}): each cp rank runs whole heads")

    def validate_gated_delta(self, tp: int = 1, cp: int = 1) -> None:
        """ValueError naming the flag for shapes the layer (at this tp and cp) cannot take."""
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        keys, values = self.linear_num_key_heads, self.linear_num_value_heads
        if self.linear_output_norm_epsilon is not None and not self.linear_output_norm_epsilon > 0:
            raise ValueError("--linear-output-norm-epsilon must be > 0, got "
                             f"{self.linear_output_norm_epsilon}")
        if self.normalization != "RMSNorm":
            raise ValueError(f"--normalization {self.normalization} with gated delta nets (G): their output "
                             "norm is built as an RMSNorm only; give --normalization RMSNorm")
        if values % keys:
            raise ValueError(f"--linear-num-value-heads {values} is not a multiple of --linear-num-key-heads "
                             f"{keys}: each key head serves an equal share of the value heads")
        if keys % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide --linear-num-key-heads "
                             f"{keys}: each rank holds whole key heads with their value heads; choose a tp "
                             "that divides it")
        if cp > 1 and (keys // tp) % cp:
            raise ValueError(f"--context-parallel-size {cp} does not divide a tensor-parallel rank's "
                             f"{keys // tp} key heads (--linear-num-key-heads {keys} / "
                             f"--tensor-model-parallel-size {tp}): each cp rank runs whole key heads")
