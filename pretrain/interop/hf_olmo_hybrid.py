"""OLMo hybrid's ``config.json`` both ways, and what a model of ours must be to be one (``hf_hybrid``
dispatches here; ``hf_hybrid_names`` has its tensors).

Each OLMo hybrid layer is a mixer then a SwiGLU MLP: our pattern alternates ``G`` (its
``linear_attention``: a gated delta net whose beta may reach 2, ``linear_allow_neg_eigval``, and whose
output norm keeps flash-linear-attention's epsilon 1e-5) or ``*`` (``full_attention``: grouped queries,
OLMo 2's norms over the whole q and k projections, rotary positions or none: ``rope_parameters`` without
a base is NoPE, as the released checkpoints are) with ``-``. The delta-net layers are pre-norm (x +
f(norm(x)), their MLP too); the attention layers and their MLPs are post-norm (x + norm(f(x))):
``--post-norm-layers`` lists them.
"""

from __future__ import annotations

from models.config import GPTConfig
from pretrain.interop.hf_moe import unexpressed
from pretrain.interop.hf_positions import HFMappingError, refuse_other_values, rope_parameters, rotary

KIND = "olmo_hybrid"
MIXERS = {"linear_attention": "G", "full_attention": "*"}
OUTPUT_NORM_EPSILON = 1e-5  # its delta nets' gated output norm, whatever rms_norm_eps says
FIXED = {"normalization": "RMSNorm", "apply_layernorm_1p": False, "disable_bias_linear": True,
         "add_qkv_bias": False, "qk_layernorm": True, "qk_layernorm_scope": "projection",
         "attention_output_gate": False, "rotary_interleaved": False, "window_size": None,
         "softmax_type": "vanilla", "softmax_scale": None, "multi_latent_attention": False, "use_mup": False,
         "attn_logit_softcapping": None, "final_logit_softcapping": None, "embedding_multiplier": 1.0,
         "glu_linear_offset": 0.0, "activation_func_clamp_value": None, "norm_placement": "pre",
         "rope_scaling": "none", "rotary_percent": 1.0}

# transformers' OlmoHybridConfig defaults, for the keys a config.json may leave out (the linear heads and
# widths derive from the others as its __post_init__ derives them)
DEFAULTS = {"vocab_size": 100352, "hidden_size": 3840, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 30, "rms_norm_eps": 1e-6, "max_position_embeddings": 65536,
            "linear_conv_kernel_dim": 4, "linear_allow_neg_eigval": True, "tie_word_embeddings": False}


def olmo_hybrid_from_hf(hf: dict) -> dict:
    """Our GPTConfig fields for an OLMo hybrid config.json (a key it leaves out: transformers' default)."""
    hf = {**DEFAULTS, **{key: value for key, value in hf.items() if value is not None}}
    refuse_other_values(hf, KIND, {"attention_bias": False, "hidden_act": "silu"})
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    types = hf.get("layer_types") or ["full_attention" if i % 4 == 3 or (layers < 4 and i == layers - 1)
                                      else "linear_attention" for i in range(layers)]
    if any(t not in MIXERS for t in types):
        raise HFMappingError(f"{KIND} with layer_types={types}: each must be one of {', '.join(MIXERS)}")
    groups = hf.get("num_key_value_heads") or heads
    key_heads = hf.get("linear_num_key_heads") or heads
    key_dim = hf.get("linear_key_head_dim") or int(0.75 * hf["hidden_size"] / key_heads)
    parameters = hf.get("rope_parameters") or {}
    positions = (rotary(hf, KIND) | {"position_embedding_type": "rope"}
                 if parameters.get("rope_theta") is not None else {"position_embedding_type": "none"})
    longest = hf["max_position_embeddings"]
    return {"hidden_size": hf["hidden_size"], "vocab_size": hf["vocab_size"], "hf_model_type": KIND,
            "hybrid_layer_pattern": "".join(MIXERS[t] + "-" for t in types), "num_layers": 2 * len(types),
            "post_norm_layers": [layer for i, t in enumerate(types) if t == "full_attention"
                                 for layer in (2 * i, 2 * i + 1)] or None,
            "normalization": "RMSNorm", "layernorm_epsilon": hf["rms_norm_eps"], "disable_bias_linear": True,
            "swiglu": True, "ffn_hidden_size": hf["intermediate_size"], "num_attention_heads": heads,
            "group_query_attention": groups != heads, "num_query_groups": groups if groups != heads else None,
            "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads, "qk_layernorm": True,
            "qk_layernorm_scope": "projection", **positions,
            "attention_dropout": float(hf.get("attention_dropout") or 0.0), "hidden_dropout": 0.0,
            "linear_num_key_heads": key_heads,
            "linear_num_value_heads": hf.get("linear_num_value_heads") or heads,
            "linear_key_head_dim": key_dim,
            "linear_value_head_dim": hf.get("linear_value_head_dim") or 2 * key_dim,
            "linear_conv_kernel_dim": hf["linear_conv_kernel_dim"],
            "linear_allow_neg_eigval": bool(hf["linear_allow_neg_eigval"]),
            "linear_output_norm_epsilon": OUTPUT_NORM_EPSILON,
            "seq_length": min(longest, 4096), "max_position_embeddings": longest,
            "untie_embeddings_and_output_weights": not hf["tie_word_embeddings"]}


def _post_layers(layers: list[str]) -> list[int]:
    """The layers OLMo hybrid norms after their sublayer: each attention layer and its MLP."""
    return [layer for i in range(0, len(layers) - 1, 2) if layers[i] == "*" for layer in (i, i + 1)]


def olmo_hybrid_misses(config: GPTConfig, layers: list[str], text: str) -> list[str]:
    """The flags of ``config`` (pattern ``layers``, written ``text``) that OLMo hybrid cannot express."""
    misses = unexpressed(config, FIXED)
    if config.gdn_output_norm_epsilon != OUTPUT_NORM_EPSILON:
        misses.append(f"--linear-output-norm-epsilon {config.gdn_output_norm_epsilon} (OLMo hybrid's is "
                      f"{OUTPUT_NORM_EPSILON})")
    pairs = [layers[i:i + 2] for i in range(0, len(layers), 2)]
    if any(len(p) < 2 or p[0] not in "G*" or p[1] != "-" for p in pairs):
        misses.append(f"--hybrid-layer-pattern {text!r} (OLMo hybrid's layers are a mixer, G or *, then - "
                      "each)")
    elif sorted(config.post_norm_layers or []) != _post_layers(layers):
        misses.append(f"--post-norm-layers {' '.join(map(str, config.post_norm_layers or [])) or 'none'} "
                      f"(OLMo hybrid's are its attention layers and their MLPs: "
                      f"{' '.join(map(str, _post_layers(layers)))})")
    if config.activation != "swiglu":
        misses.append(f"--{config.activation} (OLMo hybrid's MLPs are SwiGLU)")
    if config.position_embedding not in ("rope", "none"):
        misses.append(f"--position-embedding-type {config.position_embedding} (OLMo hybrid: rope or none)")
    return misses


def olmo_hybrid_to_hf(config: GPTConfig, layers: list[str]) -> dict:
    """OLMo hybrid's config.json keys for ``config`` (which ``olmo_hybrid_misses`` passed)."""
    mixers = {symbol: name for name, symbol in MIXERS.items()}
    return {"num_hidden_layers": len(layers) // 2, "layer_types": [mixers[s] for s in layers[::2]],
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.query_groups,
            "head_dim": config.head_dim, "max_position_embeddings": config.max_positions,
            "intermediate_size": config.ffn_size, "hidden_act": "silu",
            "rms_norm_eps": config.layernorm_epsilon,
            "attention_bias": False, "attention_dropout": config.attention_dropout,
            "rope_parameters": rope_parameters(config) if config.position_embedding == "rope" else None,
            "linear_num_key_heads": config.linear_num_key_heads,
            "linear_num_value_heads": config.linear_num_value_heads,
            "linear_key_head_dim": config.linear_key_head_dim,
            "linear_value_head_dim": config.linear_value_head_dim,
            "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
            "linear_allow_neg_eigval": config.linear_allow_neg_eigval}
