"""The GPT architecture as a dataclass: one field per Megatron-style flag."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.flags import flag
from models.hybrid.config import HybridConfig
from models.latent.config import LatentAttentionConfig
from models.gdn.config import GatedDeltaConfig
from models.mamba.config import MambaConfig
from models.mtp.config import MTPConfig
from models.moe.config import MoEConfig
from models.mup_config import MuPConfig


@dataclass
class GPTConfig(HybridConfig, MambaConfig, GatedDeltaConfig, MoEConfig, LatentAttentionConfig, MuPConfig,
                MTPConfig):
    """Shape and options of the GPT (or of a hybrid model: ``--hybrid-layer-pattern``). Owns no weights;
    ``validate(tp)`` checks what tp must divide."""

    num_layers: int = field(default=4, metadata=flag(
        "transformer blocks (with --hybrid-layer-pattern: the pattern's layers, which it sets)"))
    hidden_size: int = field(default=256, metadata=flag("model width h"))
    num_attention_heads: int = field(default=4, metadata=flag("attention heads a; tp must divide it"))
    ffn_hidden_size: int | None = field(default=None,
                                        metadata=flag("MLP width (default 4h); tp must divide it"))
    seq_length: int = field(default=256, metadata=flag("tokens per sample s"))
    max_position_embeddings: int | None = field(
        default=None, metadata=flag("positions the model can take (default seq-length); >= --seq-length"))
    vocab_size: int | None = field(
        default=None, metadata=flag("tokenizer vocabulary (default: read from --tokenizer-model)"))
    make_vocab_size_divisible_by: int = field(
        default=128, metadata=flag("the embedding table is padded to a multiple of this x tp"))
    position_embedding_type: str = field(default="learned_absolute", metadata=flag(
        "learned absolute positions, rotary (rope) or none (learned is an alias of learned_absolute)",
        choices=["learned_absolute", "learned", "rope", "none"]))
    use_rotary_position_embeddings: bool = field(
        default=False,
        metadata=flag("rotary positions (Megatron's older spelling of --position-embedding-type rope)"))
    rotary_base: float = field(default=10000.0, metadata=flag("rotary embedding base (Llama-3: 500000)"))
    rotary_percent: float = field(default=1.0, metadata=flag("fraction of each head's channels that rotate"))
    rotary_interleaved: bool = field(default=False, metadata=flag(
        "rotate pairs of adjacent channels (RoFormer's layout) instead of the two halves"))
    rope_scaling_type: str = field(default="none", metadata=flag(
        "rotary frequency scaling for long contexts, as transformers' rope_type names it "
        "(models/rope_scaling)",
        choices=["none", "linear", "dynamic", "yarn", "llama3", "longrope"]))
    use_rope_scaling: bool = field(default=False, metadata=flag(
        "Llama 3.x's rope scaling (Megatron's flag; the same as --rope-scaling-type llama3)"))
    rope_scaling_factor: float = field(default=8.0, metadata=flag(
        "how many times the original context the scaled frequencies cover (Megatron's default 8)",
        aliases=["--rotary-scaling-factor"]))
    rope_original_max_position_embeddings: int = field(default=8192, metadata=flag(
        "the context the rotary base was trained at (Llama 3.1: 8192)"))
    rope_low_freq_factor: float = field(default=1.0, metadata=flag("llama3: low-frequency factor"))
    rope_high_freq_factor: float = field(default=4.0, metadata=flag("llama3: high-frequency factor"))
    rope_beta_fast: float = field(default=32.0, metadata=flag("yarn: extrapolation boundary (rotations)"))
    rope_beta_slow: float = field(default=1.0, metadata=flag("yarn: interpolation boundary (rotations)"))
    rope_mscale: float | None = field(default=None, metadata=flag("yarn: mscale (DeepSeek's form)",
                                                                   aliases=["--mscale"]))
    rope_mscale_all_dim: float | None = field(default=None, metadata=flag(
        "yarn: mscale_all_dim (with --multi-latent-attention it also scales the attention scores)",
        aliases=["--mscale-all-dim"]))
    rope_yarn_truncate: bool = field(default=True, metadata=flag(
        "yarn: round the correction range to whole dims"))
    rope_attention_factor: float | None = field(default=None, metadata=flag(
        "yarn / longrope: the factor cos and sin are scaled by (default: from the scaling factor)"))
    rope_short_factor: list[float] | None = field(default=None, metadata=flag(
        "longrope: one factor per rotary channel pair, at or below the original context"))
    rope_long_factor: list[float] | None = field(default=None, metadata=flag(
        "longrope: one factor per rotary channel pair, beyond the original context"))
    rotary_base_local: float | None = field(default=None, metadata=flag(
        "rotary base of the sliding-window layers, unscaled (Gemma 3's local layers: 10000); default: "
        "the same tables as every layer"))
    window_size: list[int] | None = field(default=None, metadata=flag(
        "sliding-window attention, Megatron's (LEFT, RIGHT): a query sees itself and the LEFT tokens before "
        "it (RIGHT 0: causal; LEFT -1: no window)", nargs=2))
    window_attn_skip_freq: list[int] | None = field(default=None, metadata=flag(
        "which layers keep full attention under --window-size: N, every Nth layer (Gemma 2: 2, Gemma 3: 6); "
        "or one 0/1 per layer, 1 = windowed (Megatron's)"))
    softmax_scale: float | None = field(default=None, metadata=flag(
        "the attention scores' scale (default 1/sqrt(--kv-channels); Gemma: query_pre_attn_scalar^-1/2)"))
    softmax_type: str = field(default="vanilla", metadata=flag(
        "attention sinks: each head's softmax also sums exp(sink), a logit with no value, fixed at 0 "
        "(off-by-one) or learned per head (learnable: gpt-oss's sinks)",
        choices=["vanilla", "off-by-one", "learnable"]))
    attn_logit_softcapping: float | None = field(default=None, metadata=flag(
        "cap the attention scores at +-C smoothly, C tanh(s / C) (Gemma 2: 50)"))
    final_logit_softcapping: float | None = field(default=None, metadata=flag(
        "cap the output logits at +-C smoothly, C tanh(z / C) (Gemma 2: 30)"))
    embedding_multiplier: float = field(default=1.0, metadata=flag(
        "the word embeddings' output is multiplied by this (Gemma: sqrt(--hidden-size))"))
    normalization: str = field(default="LayerNorm",
                               metadata=flag("norm layer", choices=["LayerNorm", "RMSNorm"]))
    layernorm_epsilon: float = field(default=1e-5, metadata=flag("norm epsilon", aliases=["--norm-epsilon"]))
    apply_layernorm_1p: bool = field(default=False, metadata=flag(
        "norm weights stored as offsets from 1 (initialised at 0; the norm scales by 1 + weight)"))
    norm_placement: str = field(default="pre", metadata=flag(
        "where the block's norms sit: before attention and the MLP (pre), before and after them (sandwich: "
        "Gemma 2/3), or after them only, on the residual branch (post: OLMo 2)",
        choices=["pre", "sandwich", "post"]))
    qk_layernorm: bool = field(default=False,
                               metadata=flag("normalise queries and keys before attention"))
    attention_output_gate: bool = field(default=False, metadata=flag(
        "gate each query head's output by sigmoid of a gate from the query projection (Qwen3-Next): the "
        "fused projection holds each group's query heads, then their gates, then its key and value"))
    qk_layernorm_scope: str = field(default="head", metadata=flag(
        "--qk-layernorm over each head's channels, one weight shared by the heads (Qwen3, Gemma 3), or over "
        "the whole query / key projection, one weight per channel (OLMo 2; RMSNorm only)",
        choices=["head", "projection"]))
    swiglu: bool = field(default=False, metadata=flag(
        "gated SiLU MLP: silu(x W_gate) * (x W_up) -> W_down (default --ffn-hidden-size: 8h/3 rounded "
        "down to 64)"))
    geglu: bool = field(default=False, metadata=flag(
        "gated GELU MLP: gelu(x W_gate) * (x W_up) -> W_down (Gemma; tanh GELU with --openai-gelu); "
        "--ffn-hidden-size defaults as with --swiglu"))
    squared_relu: bool = field(default=False, metadata=flag("squared ReLU MLP activation instead of GELU"))
    quick_geglu: bool = field(default=False, metadata=flag(
        "gated quick-GELU MLP: quick_gelu(x W_gate) * (x W_up) -> W_down, quick_gelu(z) = z sigmoid(1.702 z) "
        "(gpt-oss); --ffn-hidden-size defaults as with --swiglu"))
    glu_linear_offset: float = field(default=0.0, metadata=flag(
        "a gated MLP's up part is offset: act(gate) * (up + F) (gpt-oss: 1)"))
    activation_func_clamp_value: float | None = field(default=None, metadata=flag(
        "a gated MLP clamps its gate to <= C and its up part to [-C, C] before the activation (gpt-oss: 7)"))
    openai_gelu: bool = field(default=False,
                              metadata=flag("GELU's tanh approximation (OpenAI's GPT-2) instead of erf"))
    group_query_attention: bool = field(
        default=False, metadata=flag("grouped-query attention: --num-query-groups key/value heads"))
    num_query_groups: int | None = field(default=None, metadata=flag(
        "key/value heads with --group-query-attention (default 1); divides the heads, tp divides it"))
    kv_channels: int | None = field(default=None, metadata=flag(
        "channels per attention head (default --hidden-size / --num-attention-heads)"))
    untie_embeddings_and_output_weights: bool = field(
        default=False, metadata=flag("an output layer of its own instead of the word embedding's transpose"))
    disable_bias_linear: bool = field(default=False,
                                      metadata=flag("no biases in the attention and MLP linears"))
    add_qkv_bias: bool = field(default=False,
                               metadata=flag("a bias on the query/key/value projection even with "
                                                             "--disable-bias-linear (Qwen2)"))
    hf_model_type: str | None = field(default=None, metadata=flag(
        "the Hugging Face model_type an export writes (an import records its own; default: the first that "
        "expresses the model)", choices=["gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2",
                                         "gemma2", "gemma3_text", "nemotron_h", "mamba2",
                                         "granitemoehybrid"]))
    hidden_dropout: float = field(default=0.1, metadata=flag("dropout on residual branches and embeddings"))
    attention_dropout: float = field(default=0.1, metadata=flag("dropout on attention probabilities"))
    init_method_std: float = field(default=0.02, metadata=flag(
        "std of weight init; residual projections use std/sqrt(2 layers) (a pattern's: std/sqrt(layers))"))

    def __post_init__(self) -> None:
        self.resolve_pattern(num_layers_given=False)

    @property
    def ffn_size(self) -> int:
        """MLP width: --ffn-hidden-size, else Megatron's default (4h; 8h/3 rounded down to 64 with SwiGLU,
        which keeps the parameters of its three matrices near those of two 4h ones)."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.gated else 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def attention_projection_rows(self) -> int:
        """Rows of the fused query/key/value projection: each query head's channels (twice with
        --attention-output-gate: its gate's), each key/value group's key and value."""
        gated = 2 if self.attention_output_gate else 1
        return (gated * self.num_attention_heads + 2 * self.query_groups) * self.head_dim

    @property
    def query_groups(self) -> int:
        """Key/value heads: --num-query-groups with grouped-query attention, else one per query head."""
        return (self.num_query_groups or 1) if self.group_query_attention else self.num_attention_heads

    @property
    def position_embedding(self) -> str:
        """learned_absolute, rope or none, whichever spelling the flags used."""
        if self.use_rotary_position_embeddings:
            return "rope"
        return ("learned_absolute" if self.position_embedding_type == "learned"
                else self.position_embedding_type)

    @property
    def rope_scaling(self) -> str:
        """The rotary scaling kind, whichever spelling the flags used."""
        if self.rope_type == "yarn":
            return "yarn"
        return "llama3" if self.use_rope_scaling else self.rope_scaling_type

    @property
    def activation(self) -> str:
        """gelu, squared_relu, or a gated one: swiglu, geglu, quick_geglu."""
        for name in ("swiglu", "geglu", "quick_geglu", "squared_relu"):
            if getattr(self, name):
                return name
        return "gelu"

    @property
    def gated(self) -> bool:
        """A gated MLP (SwiGLU, GeGLU, quick GeGLU): fc1 holds the gate and up matrices."""
        return self.swiglu or self.geglu or self.quick_geglu

    @property
    def attention_scale(self) -> float:
        if self.softmax_scale is not None:
            return self.softmax_scale
        if self.use_mup:
            return self.mup_attention_scale()
        return self.latent_softmax_scale() if self.multi_latent_attention else self.head_dim ** -0.5

    def attention_window(self, layer: int) -> int | None:
        """The keys a query of (global, 0-based) ``layer`` sees, itself included (transformers'
        ``sliding_window``: keys i - W + 1 .. i), or None where the layer attends to the whole past.
        Megatron's rule: windowed unless --window-attn-skip-freq N makes layer number ``layer + 1`` a
        multiple of N, or its per-layer list says 0."""
        if not self.window_size or self.window_size[0] < 0:
            return None
        skip = self.window_attn_skip_freq
        if skip is not None and not (bool(skip[layer]) if len(skip) > 1 else (layer + 1) % skip[0]):
            return None
        return self.window_size[0] + 1

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by x tp (Megatron's rule)."""
        if self.vocab_size is None:
            raise ValueError("--vocab-size is unknown: give it or a --tokenizer-model to read it from")
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def validate(self, tp: int = 1) -> None:
        """Raise ValueError naming the flag for any shape the model (at this tp) cannot take."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if (self.kv_channels is None and not self.multi_latent_attention
                and self.hidden_size % self.num_attention_heads):
            raise ValueError(f"--num-attention-heads {self.num_attention_heads} does not divide "
                             "--hidden-size "
                             f"{self.hidden_size}: choose a head count that divides it, "
                             "or give --kv-channels")
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ValueError(f"--kv-channels must be >= 1, got {self.kv_channels}")
        if sum((self.swiglu, self.geglu, self.quick_geglu, self.squared_relu)) > 1:
            raise ValueError("--swiglu, --geglu, --quick-geglu and --squared-relu are four MLP activations: "
                             "choose one")
        for name in ("glu_linear_offset", "activation_func_clamp_value"):
            if getattr(self, name) not in (None, 0.0) and not self.gated:
                raise ValueError(f"--{name.replace('_', '-')} acts on a gated MLP's gate and up parts: add "
                                 "--swiglu, --geglu or --quick-geglu")
        if self.activation_func_clamp_value is not None and not self.activation_func_clamp_value > 0:
            raise ValueError("--activation-func-clamp-value must be > 0, got "
                             f"{self.activation_func_clamp_value}")
        self._validate_options()
        if self.has_attention:  # (a pattern of Mamba-2 and MLP layers has no heads to check)
            self._validate_attention(tp)
            self.validate_latent(tp)
        self.validate_mup()
        self.validate_hybrid(tp)
        self.validate_moe(self.num_layers, self.ffn_size)
        self.validate_mtp()
        if self.ffn_size < 1:
            raise ValueError(f"--ffn-hidden-size is {self.ffn_size} (with --swiglu it defaults to 8h/3 "
                             "rounded down to "
                             f"64, 0 at --hidden-size {self.hidden_size}): give --ffn-hidden-size")
        if self.ffn_size % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide --ffn-hidden-size "
                             f"{self.ffn_size}: "
                             "choose a width that tp divides")
        if self.max_positions < self.seq_length:
            raise ValueError(f"--seq-length {self.seq_length} is beyond --max-position-embeddings "
                             f"{self.max_positions}: raise --max-position-embeddings or shorten --seq-length")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1)")

    def _validate_attention(self, tp: int) -> None:
        heads, groups = self.num_attention_heads, self.query_groups
        if self.num_query_groups is not None and not self.group_query_attention:
            raise ValueError(f"--num-query-groups {self.num_query_groups} needs --group-query-attention "
                             "(without it "
                             "every head has its own keys and values): add it, or drop --num-query-groups")
        if groups < 1 or heads % groups:
            raise ValueError(f"--num-query-groups {groups} does not divide --num-attention-heads {heads}: "
                             "each group "
                             "serves an equal share of the query heads")
        if groups % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide "
                             + (f"--num-query-groups {groups}" if groups != heads
                                else f"--num-attention-heads {heads}")
                             + ": each rank holds whole key/value groups; choose a tp that divides it")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.position_embedding == "rope":
            rotated = self.rotary_channels
            if rotated < 2 or rotated % 2:
                raise ValueError("rotary positions turn pairs of channels: --rotary-percent "
                                 f"{self.rotary_percent} "
                                 f"of a head's {self.head_dim} channels is {rotated}; choose one that gives "
                                 "an even "
                                 "number (>= 2)")
            if self.rotary_base <= 0:
                raise ValueError(f"--rotary-base must be > 0, got {self.rotary_base}")
            self._validate_rope_scaling()

    def _validate_rope_scaling(self) -> None:
        kind = self.rope_scaling
        if self.rope_type == "yarn" and self.rope_scaling_type not in ("none", "yarn"):
            raise ValueError(f"--rope-type yarn and --rope-scaling-type {self.rope_scaling_type} are two "
                             "rotary scalings: give one")
        if kind == "none":
            return
        if self.rope_scaling_factor <= 0 or self.rope_original_max_position_embeddings <= 0:
            raise ValueError(f"--rope-scaling-type {kind}: --rope-scaling-factor and "
                             "--rope-original-max-position-embeddings must be > 0")
        if kind == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError("--rope-scaling-type llama3: need 0 < --rope-low-freq-factor < "
                             f"--rope-high-freq-factor, got {self.rope_low_freq_factor} and "
                             f"{self.rope_high_freq_factor}")
        if kind == "longrope":
            pairs = self.rotary_channels // 2
            for name, factors in (("--rope-short-factor", self.rope_short_factor),
                                  ("--rope-long-factor", self.rope_long_factor)):
                if factors is None or len(factors) != pairs:
                    raise ValueError(f"--rope-scaling-type longrope: {name} needs one factor per rotary "
                                     f"channel pair ({pairs}), got "
                                     f"{'none' if factors is None else len(factors)}")

    def _validate_options(self) -> None:
        """The window, soft-capping, scale, sink, norm and embedding options."""
        window = self.window_size
        if window is not None and (len(window) != 2 or window[1] != 0 or window[0] < -1):
            raise ValueError(f"--window-size {' '.join(map(str, window))}: give LEFT RIGHT with LEFT >= 0 "
                             "(or -1, no window) and RIGHT 0 (attention here is causal)")
        skip = self.window_attn_skip_freq
        if skip is not None:
            if self.window_size is None:
                raise ValueError("--window-attn-skip-freq chooses the full-attention layers among windowed "
                                 "ones: add --window-size LEFT 0")
            if (len(skip) == 1 and skip[0] < 1) or (len(skip) > 1 and (len(skip) != self.num_layers
                                                                      or set(skip) - {0, 1})):
                raise ValueError(f"--window-attn-skip-freq {' '.join(map(str, skip))}: give one N >= 1 or "
                                 f"one 0/1 per layer ({self.num_layers})")
        if self.rotary_base_local is not None and (self.position_embedding != "rope" or not window):
            raise ValueError("--rotary-base-local is the base of the sliding-window layers' rotary "
                             "positions: it needs --position-embedding-type rope and --window-size")
        for name in ("softmax_scale", "attn_logit_softcapping", "final_logit_softcapping",
                     "rotary_base_local"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if self.softmax_type == "learnable" and self.multi_latent_attention:
            raise ValueError("--softmax-type learnable: latent attention (--multi-latent-attention) has no "
                             "learned sinks; use --softmax-type off-by-one or vanilla")
        if not self.embedding_multiplier > 0:
            raise ValueError(f"--embedding-multiplier must be > 0, got {self.embedding_multiplier}")
        if self.qk_layernorm_scope == "projection" and self.normalization != "RMSNorm":
            raise ValueError("--qk-layernorm-scope projection normalises over a projection split across "
                             "tensor-parallel ranks, built for RMSNorm: add --normalization RMSNorm")

    @property
    def rotary_channels(self) -> int:
        """Channels of each head that rotary positions turn (the first ones; the rest pass through; with
        latent attention its rotary part, --qk-pos-emb-head-dim)."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.head_dim * self.rotary_percent)
