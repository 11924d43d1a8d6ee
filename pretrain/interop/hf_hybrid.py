"""The Hugging Face hybrid families whose layers map exactly onto a ``--hybrid-layer-pattern``: their
``config.json`` both ways and what a model of ours must be for each (``hf_hybrid_names`` has the tensors).

- ``nemotron_h`` (Nemotron-H, Nemotron 3): ``layers_block_type`` is the pattern (linear_attention M,
  full_attention *, mlp -, moe E); attention without positions or biases; non-gated MLPs and experts of
  one activation (``mlp_hidden_act``: relu2 is --squared-relu); DeepSeek-V3's sigmoid routing and one
  ungated shared expert per MoE layer; the output layer always a tensor of its own.
- ``mamba2``: Mamba-2 layers only.
- ``qwen3_next`` (Qwen3-Next): gated delta nets and gated attention, each then an MLP or experts
  (``hf_qwen3_next``).
- ``kimi_linear`` (Kimi Linear): Kimi delta attention and latent attention without positions, each then
  an MLP or sigmoid-routed experts (``hf_kimi_linear``).
- ``olmo_hybrid`` (OLMo hybrid): gated delta nets (pre-norm) and post-norm attention, each then an MLP
  (``hf_olmo_hybrid``).
- ``granitemoehybrid`` (Granite 4.0-H): each layer a mixer (Mamba-2 or attention) then a feed-forward part
  (a gated MLP alone, or experts routed by softmax top-k plus that MLP as the shared expert), so our pattern
  alternates ``M``/``*`` with ``-`` (no experts) or ``E``; attention scaled by ``attention_multiplier``,
  rotary or no positions.

Every Mamba-2 family uses one epsilon for the layers' norms and the Mamba-2 gated norm, whose epsilon is
megatron-core's 1e-5: a model maps where its norm epsilon is 1e-5. A key whose value has no counterpart
(biases, a finite ``time_step_limit``, a latent MoE, Granite's residual or logit multipliers, ...) is refused
by name; Falcon-H1 (attention and Mamba side by side) and Jamba (Mamba-1) are not hybrid patterns.
"""

from __future__ import annotations

import math

from models.config import GPTConfig
from models.mamba.config import CONV_KERNEL, NORM_EPSILON
from pretrain.interop.hf_deepseek import (sigmoid_routing_from_hf, sigmoid_routing_misses,
                                          sigmoid_routing_to_hf)
from pretrain.interop.hf_moe import unexpressed
from pretrain.interop.hf_positions import HFMappingError, refuse_other_values
from pretrain.interop.hf_kimi_linear import KIND as KIMI, kimi_linear_from_hf, kimi_linear_misses, \
    kimi_linear_to_hf
from pretrain.interop.hf_olmo_hybrid import KIND as OLMO, olmo_hybrid_from_hf, olmo_hybrid_misses, \
    olmo_hybrid_to_hf
from pretrain.interop.hf_qwen3_next import KIND, qwen3_next_from_hf, qwen3_next_misses, qwen3_next_to_hf

# (the order an export tries them in: an all-Mamba model is a Mamba2 first)
ARCHITECTURES = {"mamba2": "Mamba2ForCausalLM", "nemotron_h": "NemotronHForCausalLM",
                 "granitemoehybrid": "GraniteMoeHybridForCausalLM", KIND: "Qwen3NextForCausalLM",
                 KIMI: "KimiLinearForCausalLM", OLMO: "OlmoHybridForCausalLM"}
# the mixer-then-MLP families' own modules: config in, what they cannot hold, config out
PAIRED = {KIND: (qwen3_next_from_hf, qwen3_next_misses, qwen3_next_to_hf),
          KIMI: (kimi_linear_from_hf, kimi_linear_misses, kimi_linear_to_hf),
          OLMO: (olmo_hybrid_from_hf, olmo_hybrid_misses, olmo_hybrid_to_hf)}
# OLMo hybrid's parts, which no other family has
OLMO_ONLY = {"post_norm_layers": None, "linear_allow_neg_eigval": False}
NEMOTRON_BLOCKS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                   "moe": "E"}
GRANITE_MIXERS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*"}
ACTIVATIONS = {"relu2": {"squared_relu": True}, "gelu": {}, "gelu_pytorch_tanh": {"openai_gelu": True}}
MTP_BLOCKS = "*E"  # Nemotron-H's MTP blocks: attention, experts
NOT_HYBRID = {"falcon_h1": "attention and Mamba-2 side by side in one layer (mamba_d_ssm)",
              "jamba": "Mamba-1 layers (mamba_dt_rank)", "bamba": "not mapped (its config keys differ)",
              "zamba2": "shared attention blocks", "mamba": "Mamba-1 layers"}


def _limit_is_open(hf: dict, kind: str) -> None:
    limit = hf.get("time_step_limit")  # transformers writes infinity as {"__float__": "Infinity"}
    bounds = [float(v["__float__"]) if isinstance(v, dict) else float(v) for v in limit or ()]
    if limit is not None and (bounds[0] != 0 or math.isfinite(bounds[1])):
        raise HFMappingError(f"{kind} with time_step_limit={limit}: dt is unclamped here (Megatron's), "
                             "only (0, inf) maps")


def _mamba_fields(hf: dict, kind: str, heads: str, head_dim: str, state: str, groups: str, chunk: str,
                  conv: str) -> dict:
    refuse_other_values(hf, kind, {conv: CONV_KERNEL})
    _limit_is_open(hf, kind)
    return {"mamba_num_heads": hf[heads], "mamba_head_dim": hf[head_dim], "mamba_state_dim": hf[state],
            "mamba_num_groups": hf[groups], "mamba_chunk_size": hf.get(chunk) or 128}


def _common(hf: dict, kind: str, eps_key: str) -> dict:
    eps = hf.get(eps_key, 1e-5)
    if eps != NORM_EPSILON:
        raise HFMappingError(f"{kind} with {eps_key}={eps}: its Mamba-2 gated norm takes the same epsilon, "
                             f"megatron-core's is {NORM_EPSILON}: only {NORM_EPSILON} maps")
    longest = hf.get("max_position_embeddings") or 4096
    return {"hidden_size": hf["hidden_size"], "vocab_size": hf["vocab_size"], "normalization": "RMSNorm",
            "layernorm_epsilon": eps, "disable_bias_linear": True, "hidden_dropout": 0.0,
            "attention_dropout": 0.0, "hf_model_type": kind, "seq_length": min(longest, 4096),
            "max_position_embeddings": longest}


def _attention(hf: dict, heads: int) -> dict:
    groups = hf.get("num_key_value_heads") or heads
    return {"num_attention_heads": heads, "group_query_attention": groups != heads,
            "num_query_groups": groups if groups != heads else None,
            "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads}


def hybrid_from_hf(hf: dict) -> GPTConfig:
    """Our GPTConfig for a hybrid family's config.json; HFMappingError naming what does not map."""
    kind = hf.get("model_type")
    if kind in NOT_HYBRID:
        raise HFMappingError(f"model_type {kind!r}: {NOT_HYBRID[kind]} does not map onto a hybrid pattern")
    fields = {"nemotron_h": _nemotron_from_hf, "mamba2": _mamba2_from_hf,
              "granitemoehybrid": _granite_from_hf,
              **{family: functions[0] for family, functions in PAIRED.items()}}[kind](hf)
    return GPTConfig(**fields)


def _nemotron_from_hf(hf: dict) -> dict:
    kind = "nemotron_h"
    refuse_other_values(hf, kind, {"use_bias": False, "mlp_bias": False, "use_conv_bias": True,
                       "mamba_hidden_act": "silu", "moe_latent_size": None})
    blocks = hf.get("layers_block_type")
    pattern = (hf.get("hybrid_override_pattern") if blocks is None
               else "".join(NEMOTRON_BLOCKS.get(block, "?") for block in blocks))
    if not pattern or "?" in pattern:
        raise HFMappingError(f"{kind} with layers_block_type={blocks}: each must be one of "
                             f"{', '.join(NEMOTRON_BLOCKS)}")
    main, pattern = pattern, pattern + _nemotron_depths(hf, kind)
    activation = hf.get("mlp_hidden_act", "relu2")
    if activation not in ACTIVATIONS:
        raise HFMappingError(f"{kind} with mlp_hidden_act={activation!r}: its MLPs are not gated; "
                             f"{', '.join(ACTIVATIONS)} map")
    fields = {**_common(hf, kind, "layer_norm_epsilon"), **_attention(hf, hf["num_attention_heads"]),
              **_mamba_fields(hf, kind, "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                              "chunk_size", "conv_kernel"),
              "hybrid_layer_pattern": pattern, "num_layers": len(main), "position_embedding_type": "none",
              "ffn_hidden_size": hf["intermediate_size"], "untie_embeddings_and_output_weights": True,
              **ACTIVATIONS[activation]}
    if "E" in pattern:  # (its layers' or its MTP blocks')
        fields.update(num_experts=hf["n_routed_experts"], moe_ffn_hidden_size=hf["moe_intermediate_size"],
                      moe_shared_expert_intermediate_size=hf.get("moe_shared_expert_intermediate_size")
                      or hf["intermediate_size"], **sigmoid_routing_from_hf(hf, kind))
    return fields


def _nemotron_depths(hf: dict, kind: str) -> str:
    """The pattern's parts after / of Nemotron-H's multi-token prediction (``num_nextn_predict_layers``
    steps, each of the blocks ``mtp_layers_block_type`` lists, or its older ``mtp_hybrid_override_pattern``;
    transformers' default attention then experts); vLLM builds attention and expert blocks there only."""
    depths = hf.get("num_nextn_predict_layers") or 0
    if not depths:
        return ""
    blocks, older = hf.get("mtp_layers_block_type"), hf.get("mtp_hybrid_override_pattern")
    if older and blocks in (None, ["full_attention", "moe"]):  # (transformers lets it override its default)
        blocks = None
    part = ("".join(NEMOTRON_BLOCKS.get(block, "?") for block in blocks) if blocks is not None
            else older or "*E")
    if not part or set(part) - set(MTP_BLOCKS):
        raise HFMappingError(f"{kind} with mtp_layers_block_type={blocks or part!r}: its MTP blocks map as "
                             f"{', '.join(MTP_BLOCKS)} only")
    return f"/{part}" * depths


def _mamba2_from_hf(hf: dict) -> dict:
    kind = "mamba2"
    refuse_other_values(hf, kind, {"use_bias": False, "use_conv_bias": True, "hidden_act": "silu"})
    if hf["num_heads"] * hf["head_dim"] != hf.get("expand", 2) * hf["hidden_size"]:
        raise HFMappingError(f"{kind} with num_heads={hf['num_heads']}, head_dim={hf['head_dim']}: their "
                             "product must be expand x hidden_size")
    layers = hf["num_hidden_layers"]
    return {**_common(hf, kind, "layer_norm_epsilon"),
            **_mamba_fields(hf, kind, "num_heads", "head_dim", "state_size", "n_groups", "chunk_size",
                            "conv_kernel"),
            "hybrid_layer_pattern": "M" * layers, "num_layers": layers, "num_attention_heads": 1,
            "position_embedding_type": "none",
            "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False)}


def _granite_from_hf(hf: dict) -> dict:
    kind = "granitemoehybrid"
    refuse_other_values(hf, kind, {"mamba_proj_bias": False, "mamba_conv_bias": True, "attention_bias": False,
                       "hidden_act": "silu", "residual_multiplier": 1.0, "logits_scaling": 1.0})
    heads = hf["num_attention_heads"]
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * hf["num_hidden_layers"]
    if any(t not in GRANITE_MIXERS for t in types):
        raise HFMappingError(f"{kind} with layer_types={types}: each must be one of "
                             f"{', '.join(GRANITE_MIXERS)}")
    experts = hf.get("num_local_experts") or 0
    pattern = "".join(GRANITE_MIXERS[t] + ("E" if experts else "-") for t in types)
    positions = hf.get("position_embedding_type")
    if positions not in (None, "nope", "rope"):
        raise HFMappingError(f"{kind} with position_embedding_type={positions!r}: rope or none maps")
    rope = hf.get("rope_parameters") or {}
    if positions == "rope" and rope.get("rope_type", "default") != "default":
        raise HFMappingError(f"{kind} with rope_parameters.rope_type={rope['rope_type']!r}: default maps")
    shared = hf.get("shared_intermediate_size") or 0
    if not shared:
        raise HFMappingError(f"{kind} with shared_intermediate_size={shared}: a shared MLP of no width (its "
                             "layers' only MLP without experts) does not map")
    fields = {**_common(hf, kind, "rms_norm_eps"), **_attention(hf, heads),
              **_mamba_fields(hf, kind, "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups",
                              "mamba_chunk_size", "mamba_d_conv"),
              "hybrid_layer_pattern": pattern, "num_layers": len(pattern), "swiglu": True,
              "position_embedding_type": "rope" if positions == "rope" else "none",
              "rotary_base": float(rope.get("rope_theta", 10000.0)),
              "softmax_scale": hf.get("attention_multiplier", 1.0),
              "embedding_multiplier": hf.get("embedding_multiplier", 1.0),
              "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False)}
    if experts:
        fields.update(num_experts=experts, moe_router_topk=hf.get("num_experts_per_tok", 2),
                      moe_ffn_hidden_size=hf["intermediate_size"], moe_aux_loss_coeff=0.0,
                      moe_shared_expert_intermediate_size=shared,
                      ffn_hidden_size=hf["intermediate_size"])
    else:
        fields["ffn_hidden_size"] = shared
    if fields["mamba_head_dim"] == "auto":
        fields["mamba_head_dim"] = hf.get("mamba_expand", 2) * hf["hidden_size"] // hf["mamba_n_heads"]
    return fields


# ------------------------------------------------------------------------------------ config out

def hybrid_misses(config: GPTConfig, kind: str) -> list[str]:
    """The flags of ``config`` (a hybrid pattern) that ``kind`` cannot express, each with its value."""
    pattern = config.parsed_pattern()
    if pattern is None:
        return ["--hybrid-layer-pattern (a GPT's blocks are no hybrid family's layers)"]
    layers = pattern.layers
    others = unexpressed(config, OLMO_ONLY) if kind != OLMO else []
    if kind != OLMO and config.gdn_output_norm_epsilon != config.layernorm_epsilon:
        others.append(f"--linear-output-norm-epsilon {config.linear_output_norm_epsilon} (OLMo hybrid's)")
    if pattern.depths and kind not in (KIND, "nemotron_h"):  # (Qwen3-Next's and Nemotron-H's map)
        others.append(f"--hybrid-layer-pattern {pattern.text!r} (its multi-token prediction depths)")
    if kind in PAIRED:
        return others + PAIRED[kind][1](config, layers, pattern.text)
    wanted = {"normalization": "RMSNorm", "layernorm_epsilon": NORM_EPSILON, "disable_bias_linear": True,
              "add_qkv_bias": False, "qk_layernorm": False, "window_size": None, "softmax_type": "vanilla",
              "multi_latent_attention": False, "use_mup": False, "attn_logit_softcapping": None,
              "final_logit_softcapping": None, "apply_layernorm_1p": False, "glu_linear_offset": 0.0,
              "attention_output_gate": False,
              "activation_func_clamp_value": None}
    misses = others + unexpressed(config, wanted)
    if config.position_embedding == "learned_absolute":
        misses.append("--position-embedding-type learned_absolute (no hybrid family learns positions)")
    if kind != "nemotron_h" and config.mamba_inner % config.hidden_size:
        misses.append(f"--mamba-num-heads {config.mamba_heads} (its inner width {config.mamba_inner} is no "
                      f"whole multiple of --hidden-size: the family's expand)")
    if kind == "mamba2":
        misses += unexpressed(config, {"embedding_multiplier": 1.0})
        stray = sorted(set(layers) - {"M"})
        return misses + [f"--hybrid-layer-pattern {pattern.text!r} (Mamba2 has Mamba-2 layers only: "
                         f"{''.join(stray)})"] * bool(stray)
    if kind == "nemotron_h":
        misses += unexpressed(config, {"position_embedding": "none", "softmax_scale": None,
                                       "embedding_multiplier": 1.0})
        if config.activation not in ("squared_relu", "gelu"):
            misses.append(f"--{config.activation} (Nemotron-H's MLPs are not gated)")
        stray = sorted(set(layers) - set("M*-E"))
        if stray:
            misses.append(f"--hybrid-layer-pattern {pattern.text!r} (Nemotron-H has no {''.join(stray)} "
                          "layers)")
        if set(pattern.mtp) - set(MTP_BLOCKS):
            misses.append(f"--hybrid-layer-pattern {pattern.text!r} (Nemotron-H's MTP blocks are "
                          f"{' or '.join(MTP_BLOCKS)})")
        if "E" in layers or "E" in pattern.mtp:
            misses += sigmoid_routing_misses(config)
            if not config.moe_shared_expert_intermediate_size or config.moe_shared_expert_gate:
                misses.append("--moe-shared-expert-intermediate-size (Nemotron-H's MoE layers have one "
                              "ungated shared expert)")
        return misses
    pairs = [layers[i:i + 2] for i in range(0, len(layers), 2)]
    feed = "E" if "E" in layers else "-"
    if any(len(p) < 2 or p[0] not in "M*" or p[1] != feed for p in pairs):
        misses.append(f"--hybrid-layer-pattern {pattern.text!r} (Granite's layers are a mixer, M or *, then "
                      f"{feed} each)")
    if config.activation != "swiglu":
        misses.append(f"--{config.activation} (Granite's MLPs are SwiGLU)")
    misses += unexpressed(config, {"rope_scaling": "none", "rotary_percent": 1.0,
                                   "rotary_interleaved": False})
    if feed == "E":
        misses += unexpressed(config, {"moe_router_score_function": "softmax",
                                       "moe_router_pre_softmax": False,
                                       "moe_router_enable_expert_bias": False,
                                       "moe_expert_capacity_factor": None,
                                       "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
                                       "moe_shared_expert_gate": False})
        if not config.moe_shared_expert_intermediate_size:
            misses.append("--moe-shared-expert-intermediate-size (Granite's MoE layers have a shared MLP)")
    return misses


def hybrid_to_hf(config: GPTConfig, kind: str, special: dict) -> dict:
    """config.json of ``kind`` for ``config`` (which ``hybrid_misses`` passed)."""
    layers = config.parsed_pattern().layers
    hf = {"model_type": kind, "architectures": [ARCHITECTURES[kind]], "vocab_size": config.vocab_size,
          "hidden_size": config.hidden_size, "torch_dtype": "float32", "use_cache": True,
          "tie_word_embeddings": not config.untie_embeddings_and_output_weights, **special}
    if kind in PAIRED:
        return {**hf, **PAIRED[kind][2](config, layers)}
    heads, head_dim, state, groups = (config.mamba_heads, config.mamba_head_dim, config.mamba_state_dim,
                                      config.mamba_num_groups)
    if kind == "mamba2":
        return {**hf, "num_hidden_layers": len(layers), "num_heads": heads, "head_dim": head_dim,
                "expand": config.mamba_inner // config.hidden_size, "state_size": state, "n_groups": groups,
                "conv_kernel": CONV_KERNEL, "chunk_size": config.mamba_chunk_size, "use_bias": False,
                "use_conv_bias": True, "hidden_act": "silu", "layer_norm_epsilon": config.layernorm_epsilon,
                "residual_in_fp32": False}
    attention = {"num_attention_heads": config.num_attention_heads,
                 "num_key_value_heads": config.query_groups,
                 "head_dim": config.head_dim, "max_position_embeddings": config.max_positions}
    if kind == "nemotron_h":
        names = {symbol: name for name, symbol in NEMOTRON_BLOCKS.items()
                 if name not in ("mamba", "attention")}
        hf.update(attention, layers_block_type=[names[symbol] for symbol in layers],
                  num_hidden_layers=len(layers), intermediate_size=config.ffn_size,
                  mlp_hidden_act="relu2" if config.squared_relu else
                  "gelu_pytorch_tanh" if config.openai_gelu else "gelu",
                  mamba_num_heads=heads, mamba_head_dim=head_dim, ssm_state_size=state, n_groups=groups,
                  conv_kernel=CONV_KERNEL, chunk_size=config.mamba_chunk_size, use_bias=False, mlp_bias=False,
                  use_conv_bias=True, mamba_hidden_act="silu", layer_norm_epsilon=config.layernorm_epsilon,
                  tie_word_embeddings=False)  # its output layer is always a tensor of its own
        if config.mtp_depths:
            hf.update(num_nextn_predict_layers=config.mtp_depths,
                      mtp_layers_block_type=[names[symbol] for symbol in config.mtp_layer_types()])
        if "E" in layers or "E" in config.mtp_layer_types():
            hf.update(n_routed_experts=config.num_experts,
                      moe_intermediate_size=config.moe_ffn_hidden_size or config.ffn_size,
                      moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
                      n_shared_experts=1, **sigmoid_routing_to_hf(config))
        return hf
    experts = config.num_experts or 0
    hf.update(attention, num_hidden_layers=len(layers) // 2,
              layer_types=["linear_attention" if symbol == "M" else "full_attention"
                           for symbol in layers[::2]],
              num_local_experts=experts, num_experts_per_tok=config.moe_router_topk if experts else 2,
              intermediate_size=(config.moe_ffn_hidden_size or config.ffn_size) if experts
              else config.ffn_size,
              shared_intermediate_size=(config.moe_shared_expert_intermediate_size if experts
                                        else config.ffn_size),
              hidden_act="silu", rms_norm_eps=config.layernorm_epsilon, attention_bias=False,
              attention_multiplier=config.attention_scale, embedding_multiplier=config.embedding_multiplier,
              residual_multiplier=1.0, logits_scaling=1.0, mamba_n_heads=heads, mamba_d_head=head_dim,
              mamba_n_groups=groups, mamba_d_state=state, mamba_d_conv=CONV_KERNEL,
              mamba_expand=config.mamba_inner // config.hidden_size, mamba_chunk_size=config.mamba_chunk_size,
              mamba_conv_bias=True, mamba_proj_bias=False,
              position_embedding_type="rope" if config.position_embedding == "rope" else None,
              rope_parameters={"rope_type": "default", "rope_theta": config.rotary_base})
    return hf
