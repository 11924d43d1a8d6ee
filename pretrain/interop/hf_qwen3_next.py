"""Qwen3-Next's ``config.json`` both ways, and what a model of ours must be to be one (``hf_hybrid``
dispatches here; ``hf_hybrid_names`` has its tensors).

Each Qwen3-Next layer is a mixer then a feed-forward part: our pattern alternates ``G`` (its
``linear_attention``: a gated delta net) or ``*`` (``full_attention``: attention with per-head q and k
norms and a sigmoid output gate from the query projection, rotary on the first ``partial_rotary_factor``
of each head's channels) with ``-`` (a SwiGLU MLP, its ``mlp_only_layers`` or sparse step) or ``E``
(softmax top-k experts beside a sigmoid-gated shared expert). Every norm is an RMSNorm of weight 1 + w
(``--apply-layernorm-1p``) of one epsilon, the delta net's output norm included (megatron-core's, which
transformers stores as the plain weight). Its one multi-token prediction layer (``mtp.*``) is our depth
``/*E`` (or ``/*-``).
"""

from __future__ import annotations

from models.config import GPTConfig
from pretrain.interop.hf_moe import moe_from_hf, moe_layers_of, moe_misses, moe_to_hf, unexpressed
from pretrain.interop.hf_positions import HFMappingError, refuse_other_values, rope_parameters, rotary

KIND = "qwen3_next"
MIXERS = {"linear_attention": "G", "full_attention": "*"}
# the keys config.json files count MTP layers by: Qwen's release, transformers' generic one, and DeepSeek-V3's
# and Nemotron-H's (vLLM's)
DEPTH_KEYS = ("mtp_num_hidden_layers", "num_mtp_layers", "num_nextn_predict_layers")

# what Qwen3-Next fixes, as our fields
FIXED = {"normalization": "RMSNorm", "apply_layernorm_1p": True, "disable_bias_linear": True,
         "add_qkv_bias": False, "qk_layernorm": True, "qk_layernorm_scope": "head",
         "attention_output_gate": True, "position_embedding": "rope", "rotary_interleaved": False,
         "window_size": None, "softmax_type": "vanilla", "softmax_scale": None,
         "multi_latent_attention": False,
         "use_mup": False, "attn_logit_softcapping": None, "final_logit_softcapping": None,
         "embedding_multiplier": 1.0, "glu_linear_offset": 0.0, "activation_func_clamp_value": None,
         "norm_placement": "pre"}


# transformers' Qwen3NextConfig defaults, for the keys a config.json may leave out
DEFAULTS = {"num_key_value_heads": 2, "head_dim": 256, "num_experts": 512, "num_experts_per_tok": 10,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
            "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
            "intermediate_size": 5632, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "num_hidden_layers": 48, "partial_rotary_factor": 0.25}


def qwen3_next_from_hf(hf: dict) -> dict:
    """Our GPTConfig fields for a Qwen3-Next config.json (a key it leaves out: transformers' default)."""
    hf = {**DEFAULTS, **{key: value for key, value in hf.items() if value is not None}}
    refuse_other_values(hf, KIND, {"attention_bias": False, "hidden_act": "silu"})
    layers = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval") or 4
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                      for i in range(layers)]
    if any(t not in MIXERS for t in types):
        raise HFMappingError(f"{KIND} with layer_types={types}: each must be one of {', '.join(MIXERS)}")
    moe = moe_from_hf(hf, KIND) if hf.get("num_experts") else {}
    shared = hf.get("shared_expert_intermediate_size")
    if moe and not shared:
        raise HFMappingError(f"{KIND} with shared_expert_intermediate_size={shared}: a shared expert of no "
                             "width does not map")
    moe.pop("moe_layer_freq", None)  # (the pattern's E places them)
    sparse = moe_layers_of(hf, layers) if moe else [0] * layers
    pattern = "".join(MIXERS[t] + "-E"[sparse[i]] for i, t in enumerate(types)) + _depth_part(hf, sparse)
    heads = hf["num_attention_heads"]
    groups = hf["num_key_value_heads"]
    longest = hf["max_position_embeddings"]
    return {"hidden_size": hf["hidden_size"], "vocab_size": hf["vocab_size"], "hf_model_type": KIND,
            "hybrid_layer_pattern": pattern, "num_layers": 2 * layers, "normalization": "RMSNorm",
            "layernorm_epsilon": hf["rms_norm_eps"], "apply_layernorm_1p": True,
            "disable_bias_linear": True, "swiglu": True, "ffn_hidden_size": hf["intermediate_size"],
            "num_attention_heads": heads, "group_query_attention": groups != heads,
            "num_query_groups": groups if groups != heads else None,
            "kv_channels": hf["head_dim"], "qk_layernorm": True,
            "attention_output_gate": True, "position_embedding_type": "rope",
            **rotary(hf, KIND),
            "attention_dropout": float(hf.get("attention_dropout") or 0.0), "hidden_dropout": 0.0,
            "linear_num_key_heads": hf["linear_num_key_heads"],
            "linear_num_value_heads": hf["linear_num_value_heads"],
            "linear_key_head_dim": hf["linear_key_head_dim"],
            "linear_value_head_dim": hf["linear_value_head_dim"],
            "linear_conv_kernel_dim": hf["linear_conv_kernel_dim"],
            "seq_length": min(longest, 4096), "max_position_embeddings": longest,
            "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False), **moe}


def _depth_part(hf: dict, sparse: list[int]) -> str:
    """The pattern's part after / of Qwen3-Next's multi-token prediction layer (``mtp_num_hidden_layers``,
    or transformers' ``num_mtp_layers``, or vLLM's ``num_nextn_predict_layers``): full attention, then
    experts or an MLP by the rule of layer 0 (its index there), as vLLM's and transformers' MTP layers
    build it."""
    depths = next((hf[key] for key in DEPTH_KEYS if hf.get(key)), 0)
    if depths > 1:
        raise HFMappingError(f"{KIND} with {depths} MTP layers: they share one fc and its norms there, ours "
                             "have a projection per depth; only 1 maps")
    if depths and hf.get("mtp_use_dedicated_embeddings"):
        raise HFMappingError(f"{KIND} with mtp_use_dedicated_embeddings=true: an MTP embedding of its own "
                             "does not map (ours is the model's)")
    return f"/*{'-E'[sparse[0]]}" if depths else ""


def qwen3_next_misses(config: GPTConfig, layers: list[str], text: str) -> list[str]:
    """The flags of ``config`` (pattern ``layers``, written ``text``) that Qwen3-Next cannot express."""
    misses = unexpressed(config, FIXED)
    pairs = [layers[i:i + 2] for i in range(0, len(layers), 2)]
    if any(len(p) < 2 or p[0] not in "G*" or p[1] not in "-E" for p in pairs):
        misses.append(f"--hybrid-layer-pattern {text!r} (Qwen3-Next's layers are a mixer, G or *, then - "
                      "or E each)")
    if config.activation != "swiglu":
        misses.append(f"--{config.activation} (Qwen3-Next's MLPs are SwiGLU)")
    depth = config.mtp_layer_types()
    if config.mtp_depths and (config.mtp_depths > 1 or depth != ["*", layers[1]]):
        misses.append(f"--hybrid-layer-pattern {text!r} (Qwen3-Next has one MTP layer: attention, then the "
                      f"feed-forward kind of its layer 0, /*{layers[1]})")
    if "E" in layers:
        misses += moe_misses(config, KIND)
        if not config.moe_shared_expert_intermediate_size:
            misses.append("--moe-shared-expert-intermediate-size (Qwen3-Next's MoE layers have a gated "
                          "shared expert)")
    return misses


def qwen3_next_to_hf(config: GPTConfig, layers: list[str]) -> dict:
    """Qwen3-Next's config.json keys for ``config`` (which ``qwen3_next_misses`` passed)."""
    mixers = {symbol: name for name, symbol in MIXERS.items()}
    feeds = layers[1::2]
    hf = {"num_hidden_layers": len(layers) // 2, "layer_types": [mixers[s] for s in layers[::2]],
          "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.query_groups,
          "head_dim": config.head_dim, "max_position_embeddings": config.max_positions,
          "intermediate_size": config.ffn_size, "hidden_act": "silu",
          "rms_norm_eps": config.layernorm_epsilon,
          "attention_bias": False, "attention_dropout": config.attention_dropout,
          "rope_parameters": {**rope_parameters(config), "partial_rotary_factor": config.rotary_percent},
          "linear_num_key_heads": config.linear_num_key_heads,
          "linear_num_value_heads": config.linear_num_value_heads,
          "linear_key_head_dim": config.linear_key_head_dim,
          "linear_value_head_dim": config.linear_value_head_dim,
          "linear_conv_kernel_dim": config.linear_conv_kernel_dim, "num_experts": 0, "decoder_sparse_step": 1,
          "mlp_only_layers": []}
    if "E" in feeds:
        hf.update(moe_to_hf(config, KIND),
                  mlp_only_layers=[layer for layer, symbol in enumerate(feeds) if symbol != "E"])
    if config.mtp_depths:  # (the release's key, and transformers' that its MtpModel.from_pretrained reads)
        hf.update(mtp_num_hidden_layers=1, num_mtp_layers=1, mtp_layer_types=["full_attention"])
    return hf
