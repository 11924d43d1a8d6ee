"""Kimi Linear's ``config.json`` both ways, and what a model of ours must be to be one (``hf_hybrid``
dispatches here; ``hf_hybrid_names`` has its tensors).

Each Kimi Linear layer is a mixer then a feed-forward part: our pattern alternates ``K`` (its
``linear_attention``: Kimi delta attention, ``linear_attn_config``'s heads and width) or ``+``
(``full_attention``: latent attention without positions, NoPE, its key/value latent normed) with ``-`` (a
SwiGLU MLP: the first ``first_k_dense_replace`` layers) or ``E`` (DeepSeek-V3's sigmoid routing with the
score-correction bias and group-limited top-k, times ``routed_scaling_factor``, beside ungated shared
experts). Norms are plain RMSNorms of ``rms_norm_eps`` but the latent norms, which keep 1e-6 whatever it
says (``--latent-norm-epsilon``).
"""

from __future__ import annotations

from models.config import GPTConfig
from pretrain.interop.hf_deepseek import (latent_norm_fields, latent_norm_misses, sigmoid_routing_from_hf,
                                          sigmoid_routing_misses, sigmoid_routing_to_hf)
from pretrain.interop.hf_moe import unexpressed
from pretrain.interop.hf_positions import HFMappingError, refuse_other_values

KIND = "kimi_linear"
MIXERS = {"linear_attention": "K", "full_attention": "+"}
FIXED = {"normalization": "RMSNorm", "apply_layernorm_1p": False, "disable_bias_linear": True,
         "position_embedding": "none", "multi_latent_attention": True, "qk_layernorm": False,
         "softmax_scale": None, "window_size": None, "softmax_type": "vanilla", "use_mup": False,
         "attn_logit_softcapping": None, "final_logit_softcapping": None, "embedding_multiplier": 1.0,
         "glu_linear_offset": 0.0, "activation_func_clamp_value": None, "norm_placement": "pre",
         "moe_shared_expert_gate": False}


# transformers' KimiLinearConfig defaults, for the keys a config.json may leave out
DEFAULTS = {"num_experts": 256, "num_experts_per_token": 8, "num_expert_group": 1, "topk_group": 1,
            "routed_scaling_factor": 2.446, "moe_renormalize": True, "num_shared_experts": 1,
            "moe_intermediate_size": 1024, "intermediate_size": 9216, "rms_norm_eps": 1e-5,
            "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "linear_num_heads": 32, "linear_head_dim": 128, "linear_conv_kernel_dim": 4,
            "model_max_length": 1048576, "num_attention_heads": 32, "num_hidden_layers": 27}


def _types(hf: dict) -> tuple[list[str], list[str]]:
    """(each layer's mixer type, each layer's MLP type) as transformers derives them."""
    layers = hf["num_hidden_layers"]
    linear = hf.get("linear_attn_config") or {}
    mixers = hf.get("layer_types")
    if mixers is None and "full_attn_layers" in linear and "kda_layers" in linear:
        mixers = [None] * layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for layer in linear[key]:  # (1-based)
                mixers[layer - 1] = kind
    mixers = mixers or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    dense = hf.get("first_k_dense_replace", 1)
    feeds = hf.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(layers)]
    return mixers, feeds


def kimi_linear_from_hf(hf: dict) -> dict:
    """Our GPTConfig fields for a Kimi Linear config.json (a key it leaves out: transformers' default)."""
    aliases = {"num_experts_per_tok": "num_experts_per_token", "n_group": "num_expert_group",
               "norm_topk_prob": "moe_renormalize", "n_shared_experts": "num_shared_experts",
               "max_position_embeddings": "model_max_length"}  # (its attribute map)
    hf = {**DEFAULTS, **{aliases.get(key, key): value for key, value in hf.items()}}
    refuse_other_values(hf, KIND, {"attention_bias": False, "hidden_act": "silu", "pretraining_tp": 1})
    eps = hf["rms_norm_eps"]
    mixers, feeds = _types(hf)
    if any(t not in MIXERS for t in mixers) or any(t not in ("dense", "sparse") for t in feeds):
        raise HFMappingError(f"{KIND} with layer_types={mixers}, mlp_layer_types={feeds}: each must be one "
                             f"of {', '.join(MIXERS)} and dense or sparse")
    sparse = "sparse" in feeds
    pattern = "".join(MIXERS[m] + ("E" if f == "sparse" else "-") for m, f in zip(mixers, feeds))
    linear = hf.get("linear_attn_config") or {}
    heads = hf["num_attention_heads"]
    longest = hf["model_max_length"]
    fields = {"hidden_size": hf["hidden_size"], "vocab_size": hf["vocab_size"], "hf_model_type": KIND,
              "hybrid_layer_pattern": pattern, "num_layers": len(pattern), "normalization": "RMSNorm",
              "layernorm_epsilon": eps, **latent_norm_fields(eps), "disable_bias_linear": True,
              "swiglu": True,
              "ffn_hidden_size": hf["intermediate_size"], "num_attention_heads": heads,
              "multi_latent_attention": True, "position_embedding_type": "none",
              "q_lora_rank": hf["q_lora_rank"], "kv_lora_rank": hf["kv_lora_rank"],
              "qk_head_dim": hf["qk_nope_head_dim"], "qk_pos_emb_head_dim": hf["qk_rope_head_dim"],
              "v_head_dim": hf["v_head_dim"],
              "linear_num_value_heads": linear.get("num_heads", hf["linear_num_heads"]),
              "linear_value_head_dim": linear.get("head_dim", hf["linear_head_dim"]),
              "linear_conv_kernel_dim": linear.get("short_conv_kernel_size", hf["linear_conv_kernel_dim"]),
              "attention_dropout": float(hf.get("attention_dropout") or 0.0), "hidden_dropout": 0.0,
              "seq_length": min(longest, 4096), "max_position_embeddings": longest,
              "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False)}
    if sparse:
        shared = hf["num_shared_experts"]
        if not shared:
            raise HFMappingError(f"{KIND} with num_shared_experts={shared}: its MoE layers map with shared "
                                 "experts only")
        routing = {"num_experts_per_tok": hf["num_experts_per_token"], "n_group": hf["num_expert_group"],
                   "topk_group": hf["topk_group"], "norm_topk_prob": hf["moe_renormalize"],
                   "routed_scaling_factor": hf["routed_scaling_factor"]}
        fields.update(num_experts=hf["num_experts"], moe_ffn_hidden_size=hf["moe_intermediate_size"],
                      moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * shared,
                      **sigmoid_routing_from_hf(routing, KIND))
    return fields


def kimi_linear_misses(config: GPTConfig, layers: list[str], text: str) -> list[str]:
    """The flags of ``config`` (pattern ``layers``, written ``text``) that Kimi Linear cannot express."""
    misses = unexpressed(config, FIXED) + latent_norm_misses(config)
    pairs = [layers[i:i + 2] for i in range(0, len(layers), 2)]
    if any(len(p) < 2 or p[0] not in "K+" or p[1] not in "-E" for p in pairs):
        misses.append(f"--hybrid-layer-pattern {text!r} (Kimi Linear's layers are a mixer, K or +, then - or "
                      "E each)")
    if config.activation != "swiglu":
        misses.append(f"--{config.activation} (Kimi Linear's MLPs are SwiGLU)")
    if "E" in layers:
        misses += sigmoid_routing_misses(config)
        shared = config.moe_shared_expert_intermediate_size or 0
        width = config.moe_ffn_hidden_size or config.ffn_size
        if not shared or shared % width:
            misses.append(f"--moe-shared-expert-intermediate-size {shared} (Kimi Linear's shared experts are "
                          f"whole experts of --moe-ffn-hidden-size {width})")
    return misses


def kimi_linear_to_hf(config: GPTConfig, layers: list[str]) -> dict:
    """Kimi Linear's config.json keys for ``config`` (which ``kimi_linear_misses`` passed)."""
    mixers = {symbol: name for name, symbol in MIXERS.items()}
    routing = sigmoid_routing_to_hf(config) if "E" in layers else {}
    heads = config.linear_num_value_heads
    width = config.moe_ffn_hidden_size or config.ffn_size
    return {"num_hidden_layers": len(layers) // 2, "layer_types": [mixers[s] for s in layers[::2]],
            "mlp_layer_types": ["sparse" if s == "E" else "dense" for s in layers[1::2]],
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_attention_heads, "model_max_length": config.max_positions,
            "intermediate_size": config.ffn_size, "hidden_act": "silu",
            "rms_norm_eps": config.layernorm_epsilon,
            "attention_bias": False, "attention_dropout": config.attention_dropout,
            "q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank,
            "qk_nope_head_dim": config.qk_head_dim, "qk_rope_head_dim": config.qk_pos_emb_head_dim,
            "v_head_dim": config.v_head_dim, "linear_attn_config": {
                "num_heads": heads, "head_dim": config.linear_value_head_dim,
                "short_conv_kernel_size": config.linear_conv_kernel_dim,
                "kda_layers": [i + 1 for i, s in enumerate(layers[::2]) if s == "K"],
                "full_attn_layers": [i + 1 for i, s in enumerate(layers[::2]) if s == "+"]},
            "num_experts": config.num_experts or 0, "moe_intermediate_size": width,
            "num_shared_experts": (config.moe_shared_expert_intermediate_size or 0) // width,
            "num_experts_per_token": routing.get("num_experts_per_tok", 2),
            "num_expert_group": routing.get("n_group", 1), "topk_group": routing.get("topk_group", 1),
            "routed_scaling_factor": routing.get("routed_scaling_factor", 1.0), "moe_renormalize": True,
            "pretraining_tp": 1}
