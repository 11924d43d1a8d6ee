"""The hybrid layer pattern's flags, a part of ``models.config.GPTConfig``: which layer each index is."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.flags import flag
from models.hybrid.pattern import ATTENTION_KINDS, ParsedPattern, parse_pattern

DEPRECATED_PATTERN = "--hybrid-override-pattern is deprecated. Use --hybrid-layer-pattern instead."


@dataclass
class HybridConfig:
    """The model as a string of layer symbols (Megatron-LM's HybridModel), or None: a GPT of
    --num-layers transformer blocks. Owns values only; ``resolve_pattern`` derives --num-layers from the
    pattern, ``validate_hybrid`` refuses what cannot be built at a tp (the layer registry refuses the
    symbols it has no layer for)."""

    hybrid_layer_pattern: str | None = field(default=None, metadata=flag(
        "the model as one symbol per layer (Megatron's HybridModel): M Mamba-2, * attention, + latent "
        "attention, - MLP, E mixture of experts; | between pipeline segments (their count a multiple of "
        "--pipeline-model-parallel-size); sets --num-layers, e.g. 'M-M*-|M-M*-'"))
    hybrid_override_pattern: str | None = field(default=None, metadata=flag(
        "Megatron's deprecated spelling of --hybrid-layer-pattern"))
    post_norm_layers: list[int] | None = field(default=None, metadata=flag(
        "a pattern's layers (0-based) whose norm sits after their sublayer, on the residual branch: x + "
        "norm(f(x)) (the OLMo hybrid's attention layers and their MLPs, as OLMo 2's); the others pre-norm"))

    def parsed_pattern(self) -> ParsedPattern | None:
        return parse_pattern(self.hybrid_layer_pattern) if self.hybrid_layer_pattern else None

    @property
    def uncut_pattern(self) -> str | None:
        """The pattern without its pipeline cuts (the model, whatever the layout), or None for a GPT."""
        pattern = self.parsed_pattern()
        return pattern.uncut if pattern is not None else None

    def resolve_pattern(self, num_layers_given: bool = True) -> list[str]:
        """Take the deprecated flag's pattern, make --num-layers the pattern's layer count (and turn on
        latent attention for ``+``), as Megatron does; return what it says about it (a different
        --num-layers, if given, and the deprecated flag). ValueError where both pattern flags are given."""
        notes = []
        if self.hybrid_override_pattern is not None:
            if self.hybrid_layer_pattern is not None:
                raise ValueError("--hybrid-override-pattern and --hybrid-layer-pattern are one setting: give "
                                 "--hybrid-layer-pattern only")
            self.hybrid_layer_pattern, self.hybrid_override_pattern = self.hybrid_override_pattern, None
            notes.append(DEPRECATED_PATTERN)
        pattern = self.parsed_pattern()
        if pattern is None:
            return notes
        if self.num_layers != len(pattern.layers) and num_layers_given:
            notes.append(f"--hybrid-layer-pattern is set; ignoring --num-layers ({self.num_layers}), "
                         f"using the pattern's {len(pattern.layers)} layers")
        self.num_layers = len(pattern.layers)
        if "+" in pattern.layers:
            self.multi_latent_attention = True
        return notes

    def layer_types(self) -> list[str]:
        """Each layer's entry in the layer registry (``models.layers.registry``): the pattern's symbols, or
        for a GPT one transformer block per layer (``*-``, ``*E`` where it is a mixture of experts; ``+``
        for latent attention)."""
        pattern = self.parsed_pattern()
        if pattern is not None:
            return list(pattern.layers)
        attention = "+" if self.multi_latent_attention else "*"
        return [attention + ("E" if moe else "-") for moe in super().moe_layers(self.num_layers)]

    def moe_layers(self, num_layers: int) -> list[bool]:
        """Which layers are mixtures of experts: a pattern's ``E``, else as --moe-layer-freq says."""
        pattern = self.parsed_pattern()
        if pattern is None:
            return super().moe_layers(num_layers)
        return [symbol == "E" for symbol in pattern.layers]

    @property
    def has_attention(self) -> bool:
        """Whether any layer attends (a GPT's all do; a pattern's attention symbols)."""
        pattern = self.parsed_pattern()
        return pattern is None or any(symbol in ATTENTION_KINDS for symbol in pattern.layers + pattern.mtp)

    @property
    def residual_branches(self) -> int:
        """The branches that add into the residual stream: two per GPT block, one per pattern layer (the
        init scales their output projections by 1/sqrt of it)."""
        pattern = self.parsed_pattern()
        return len(pattern.layers) if pattern is not None else 2 * self.num_layers

    def validate_sequence_layers(self, tp: int, cp: int) -> None:
        """ValueError naming the flags where this model's Mamba-2, gated delta net or Kimi delta attention
        layers (if any) cannot split over tp x cp."""
        pattern = self.parsed_pattern()
        if pattern is not None and "M" in pattern.layers:
            self.validate_mamba(tp, cp)
        if pattern is not None and "G" in pattern.layers:
            self.validate_gated_delta(tp, cp)
        if pattern is not None and "K" in pattern.layers:
            self.validate_kimi_delta(tp, cp)

    def validate_hybrid(self, tp: int = 1) -> None:
        """ValueError naming the flag for a pattern this build cannot make (or cannot make at this tp)."""
        pattern = self.parsed_pattern()
        gdn_only = [flag for flag, used in (("--linear-allow-neg-eigval", self.linear_allow_neg_eigval),
                                            ("--linear-output-norm-epsilon",
                                             self.linear_output_norm_epsilon is not None)) if used]
        if gdn_only and (pattern is None or "G" not in pattern.layers + pattern.mtp):
            raise ValueError(f"{', '.join(gdn_only)}: shape gated delta nets (G), which this model has none "
                             "of; drop it")
        if pattern is None:
            if self.post_norm_layers:
                raise ValueError("--post-norm-layers places the norms of a --hybrid-layer-pattern's layers; "
                                 "a GPT's blocks take --norm-placement")
            return
        shown = f"--hybrid-layer-pattern {pattern.text!r}"
        if self.num_layers != len(pattern.layers):
            raise ValueError(f"{shown} has {len(pattern.layers)} layers, --num-layers says "
                             f"{self.num_layers}: "
                             "drop --num-layers (the pattern sets it)")
        if "E" in pattern.layers and not self.num_experts:
            raise ValueError(f"{shown}: E (mixture of experts) needs --num-experts")
        if self.num_experts and "E" not in pattern.layers:
            raise ValueError(f"--num-experts {self.num_experts}: {shown} has no E (mixture of experts) "
                             "layer; "
                             "put E where experts should be, or drop --num-experts")
        if self.norm_placement != "pre":
            raise ValueError(f"--norm-placement {self.norm_placement}: a pattern's layers each have one "
                             "norm, before their sublayer (or after it: --post-norm-layers); drop the flag "
                             "or the pattern")
        post = self.post_norm_layers or []
        if any(not 0 <= layer < len(pattern.layers) for layer in post) or len(set(post)) != len(post):
            raise ValueError(f"--post-norm-layers {' '.join(map(str, post))}: give distinct layers of "
                             f"{shown}, 0 to {len(pattern.layers) - 1}")
        self.validate_sequence_layers(tp, 1)
