"""Hugging Face ``config.json`` <-> our ``GPTConfig``, for every family whose models map exactly.

A family is a ``model_type`` (GPT-2, Llama 3.x, Mistral / Mistral-Nemo, Qwen2 / 2.5, Qwen3, Gemma 2,
Gemma 3 text, Phi-3 / Phi-4, OLMo 2): the features it fixes (``Family.features``: our field -> its value)
and the keys it reads beside the shared decoder ones. An import sets those features and records the
family (``hf_model_type``), so an export writes the same class back; a model trained from scratch is
exported as the first family that expresses it (Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE with their
experts: ``hf_moe``; DeepSeek-V3's latent attention and routing: ``hf_deepseek``; gpt-oss's sinks,
activation and biases: ``hf_gpt_oss``; rotary scaling and windows: ``hf_positions``). What no family
expresses exactly (other mixtures of experts, quantized weights but gpt-oss's MXFP4, multimodal towers,
encoder-decoders, bidirectional or chunked attention, biases where a family has none) is refused naming
the config key and its value, before any weight is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from models.config import GPTConfig
from pretrain.interop.hf_deepseek import KIND as DEEPSEEK, deepseek_from_hf, deepseek_misses, deepseek_to_hf
from pretrain.interop.hf_gpt_oss import KIND as GPT_OSS, gpt_oss_from_hf, gpt_oss_misses, gpt_oss_to_hf
from pretrain.interop.hf_hybrid import ARCHITECTURES as HYBRIDS, NOT_HYBRID, hybrid_from_hf, hybrid_misses, \
    hybrid_to_hf
from pretrain.interop.hf_moe import MOE_FAMILIES, MoEMappingError, moe_from_hf, moe_misses, moe_to_hf
from pretrain.interop.hf_positions import HFMappingError, hf_windows, rope_parameters, rotary, windows


LLAMA = {"norm_placement": "pre", "activation": "swiglu", "qk_layernorm": False, "add_qkv_bias": False}
GEMMA = {"norm_placement": "sandwich", "activation": "geglu", "add_qkv_bias": False}
# settings only some families have a key for: elsewhere they must keep these values
EXTRAS = {"softmax_scale": None, "attn_logit_softcapping": None, "final_logit_softcapping": None,
          "embedding_multiplier": 1.0, "rotary_base_local": None, "activation_func_clamp_value": None}


@dataclass(frozen=True)
class Family:
    """One Hugging Face decoder class: its ``model_type`` and class name, the features of ours it fixes,
    how its layers may be windowed (``none``, ``uniform``: every layer or none, ``per_layer``), its
    default for tied embeddings, and the ``EXTRAS`` it has keys for. Holds no weights."""

    model_type: str
    architecture: str
    features: dict
    windows: str = "none"
    tied_default: bool = False
    extras: tuple[str, ...] = ()
    qk_scope: str | None = field(default=None)


FAMILIES = {family.model_type: family for family in (
    Family("llama", "LlamaForCausalLM", LLAMA),
    Family("mistral", "MistralForCausalLM", LLAMA, windows="uniform"),
    Family("qwen2", "Qwen2ForCausalLM", {**LLAMA, "add_qkv_bias": True}, windows="per_layer"),
    Family("qwen3", "Qwen3ForCausalLM", {**LLAMA, "qk_layernorm": True}, windows="per_layer",
           qk_scope="head"),
    Family("phi3", "Phi3ForCausalLM", LLAMA, windows="uniform"),
    Family("olmo2", "Olmo2ForCausalLM", {**LLAMA, "norm_placement": "post", "qk_layernorm": True},
           qk_scope="projection"),
    # mixtures of experts (their experts: ``hf_moe``)
    Family("mixtral", "MixtralForCausalLM", LLAMA, windows="uniform"),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", {**LLAMA, "add_qkv_bias": True}, windows="per_layer"),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", {**LLAMA, "qk_layernorm": True}, windows="per_layer",
           qk_scope="head"),
    Family("olmoe", "OlmoeForCausalLM", {**LLAMA, "qk_layernorm": True}, qk_scope="projection"),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", {**LLAMA, "multi_latent_attention": True}),
    Family("gpt_oss", "GptOssForCausalLM", {**LLAMA, "activation": "quick_geglu", "softmax_type": "learnable",
                                            "glu_linear_offset": 1.0, "disable_bias_linear": False},
           windows="per_layer", extras=("activation_func_clamp_value",)),
    Family("gemma2", "Gemma2ForCausalLM", {**GEMMA, "qk_layernorm": False}, windows="per_layer",
           tied_default=True, extras=("softmax_scale", "attn_logit_softcapping", "final_logit_softcapping",
                                      "embedding_multiplier")),
    Family("gemma3_text", "Gemma3ForCausalLM", {**GEMMA, "qk_layernorm": True}, windows="per_layer",
           tied_default=True, qk_scope="head",
           extras=("softmax_scale", "attn_logit_softcapping", "final_logit_softcapping",
                   "embedding_multiplier", "rotary_base_local")),
)}
DECODER = {"position_embedding": "rope", "normalization": "RMSNorm", "disable_bias_linear": True,
           "rotary_interleaved": False, "multi_latent_attention": False, "softmax_type": "vanilla",
           "glu_linear_offset": 0.0, "use_mup": False, "attention_output_gate": False}
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
MULTIMODAL_KEYS = ("vision_config", "audio_config", "text_config", "vision_tower", "mm_vision_tower",
                   "image_token_index", "image_token_id")


# ------------------------------------------------------------------------------------- config in

def _refuse_unmapped(hf: dict, kind) -> None:
    for key in MOE_KEYS if kind not in MOE_FAMILIES else ():
        if hf.get(key):
            raise HFMappingError(f"model_type {kind!r} with {key}={hf[key]}: this mixture-of-experts family "
                                 f"is not mapped ({', '.join(MOE_FAMILIES)} are)")
    for key in MULTIMODAL_KEYS:
        if hf.get(key) is not None:
            raise HFMappingError(f"model_type {kind!r} with {key}: multimodal towers are not supported (a "
                                 "text-only checkpoint of the same family is)")
    if hf.get("is_encoder_decoder"):
        raise HFMappingError(f"model_type {kind!r} with is_encoder_decoder=true: encoder-decoder models are "
                             "not supported")
    quantization = (hf.get("quantization_config") or {}).get("quant_method")
    if quantization is not None and not (kind == GPT_OSS and quantization == "mxfp4"):
        raise HFMappingError(f"model_type {kind!r} with quantization_config.quant_method={quantization!r}: "
                             "quantized weights are not supported (gpt-oss's mxfp4 is, dequantized on "
                             "import)")
    if hf.get("use_bidirectional_attention"):
        raise HFMappingError(f"model_type {kind!r} with use_bidirectional_attention=true: only causal "
                             "attention maps")


def config_from_hf(hf: dict) -> GPTConfig:
    """Our GPTConfig for a Hugging Face config.json; HFMappingError naming what has no exact counterpart."""
    kind = hf.get("model_type")
    if kind in HYBRIDS or kind in NOT_HYBRID:
        return hybrid_from_hf(hf)
    _refuse_unmapped(hf, kind)
    if kind == "gpt2":
        return _gpt2_from_hf(hf)
    if kind not in FAMILIES:
        raise HFMappingError(f"model_type {kind!r} is not supported: gpt2, "
                             f"{', '.join([*FAMILIES, *HYBRIDS])} are")
    family = FAMILIES[kind]
    activation = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    wanted = {"swiglu": ("silu",), "geglu": ("gelu_pytorch_tanh", "gelu"),
              "quick_geglu": ("silu",)}[family.features["activation"]]  # gpt-oss names silu, runs its own
    if activation not in wanted:
        raise HFMappingError(f"{kind} with hidden_act={activation!r}: {' or '.join(wanted)} map")
    biases = {key: hf[key] for key in ("mlp_bias", "attention_bias") if hf.get(key)}
    if kind == "qwen2_moe" and hf.get("qkv_bias") is False:
        raise HFMappingError("qwen2_moe with qkv_bias=false: Qwen2-MoE maps with its q/k/v biases only")
    if biases and not (kind in ("qwen2", "qwen2_moe", GPT_OSS) and list(biases) == ["attention_bias"]):
        key, value = next(iter(biases.items()))
        raise HFMappingError(f"{kind} with {key}={value}: biases there are not supported")
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    layers, longest = hf["num_hidden_layers"], hf["max_position_embeddings"]
    fields = dict(num_layers=layers, hidden_size=hf["hidden_size"], num_attention_heads=heads,
                  ffn_hidden_size=hf["intermediate_size"], seq_length=min(longest, 4096),
                  max_position_embeddings=longest, vocab_size=hf["vocab_size"],
                  position_embedding_type="rope", normalization="RMSNorm",
                  layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), group_query_attention=groups != heads,
                  num_query_groups=groups if groups != heads else None,
                  kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, disable_bias_linear=True,
                  hidden_dropout=0.0, attention_dropout=0.0, hf_model_type=kind,
                  untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", family.tied_default),
                  swiglu=family.features["activation"] == "swiglu",
                  geglu=family.features["activation"] == "geglu",
                  openai_gelu=activation == "gelu_pytorch_tanh",
                  norm_placement=family.features["norm_placement"],
                  qk_layernorm=family.features["qk_layernorm"], qk_layernorm_scope=family.qk_scope or "head",
                  apply_layernorm_1p=kind.startswith("gemma"),  # Gemma stores norm weights as offsets from 1
                  add_qkv_bias=family.features["add_qkv_bias"], **rotary(hf, kind),
                  **windows(hf, kind, layers))
    if kind in MOE_FAMILIES:
        try:
            fields.update(deepseek_from_hf(hf) if kind == DEEPSEEK else gpt_oss_from_hf(hf) if kind == GPT_OSS
                          else moe_from_hf(hf, kind))
        except MoEMappingError as error:
            raise HFMappingError(str(error)) from None
    if kind.startswith("gemma"):
        fields.update(softmax_scale=hf.get("query_pre_attn_scalar", 256) ** -0.5,
                      attn_logit_softcapping=hf.get("attn_logit_softcapping"),
                      final_logit_softcapping=hf.get("final_logit_softcapping"),
                      embedding_multiplier=hf["hidden_size"] ** 0.5)
    if family.windows == "uniform" and fields.get("window_attn_skip_freq"):
        raise HFMappingError(f"{kind} with layer_types mixing sliding and full attention: {kind} windows "
                             "every layer")
    return GPTConfig(**fields)


def _gpt2_from_hf(hf: dict) -> GPTConfig:
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("add_cross_attention"):
        raise HFMappingError("GPT-2 with scale_attn_by_inverse_layer_idx or cross-attention is not "
                             "supported")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise HFMappingError(f"GPT-2 activation_function {activation!r} is not supported "
                             "(gelu, gelu_new)")
    return GPTConfig(num_layers=hf["n_layer"], hidden_size=hf["n_embd"], num_attention_heads=hf["n_head"],
                     ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"], seq_length=hf["n_positions"],
                     max_position_embeddings=hf["n_positions"], vocab_size=hf["vocab_size"],
                     layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
                     openai_gelu=activation != "gelu", hidden_dropout=0.0, attention_dropout=0.0,
                     hf_model_type="gpt2",
                     untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True))


# ------------------------------------------------------------------------------------ config out

def _gpt2_misses(config: GPTConfig) -> list[str]:
    wanted = {"--position-embedding-type": (config.position_embedding, "learned_absolute"),
              "--normalization": (config.normalization, "LayerNorm"),
              "--swiglu / --geglu / --squared-relu": (config.activation, "gelu"),
              "--num-query-groups": (config.query_groups, config.num_attention_heads),
              "--kv-channels": (config.head_dim, config.hidden_size // config.num_attention_heads),
              "--disable-bias-linear": (config.disable_bias_linear, False),
              "--qk-layernorm": (config.qk_layernorm, False), "--add-qkv-bias": (config.add_qkv_bias, False),
              "--attention-output-gate": (config.attention_output_gate, False),
              "--norm-placement": (config.norm_placement, "pre"), "--window-size": (config.window_size, None),
              "--multi-latent-attention": (config.multi_latent_attention, False),
              "--softmax-type": (config.softmax_type, "vanilla"), "--use-mup": (config.use_mup, False),
              "--mtp-num-layers": (config.mtp_depths, 0),
              **{f"--{name.replace('_', '-')}": (getattr(config, name), value)
                 for name, value in EXTRAS.items()}}
    return [f"{flag} {value}" for flag, (value, want) in wanted.items() if value != want] + moe_misses(config,
                                                                                                      "gpt2")


def _miss(name: str, value, wanted) -> str:
    """A setting a family cannot express, named by its flag."""
    if name == "activation":
        return f"--{wanted} (the MLP is {value})"
    flag = "position-embedding-type" if name == "position_embedding" else name.replace("_", "-")
    return f"--{flag} {value}"


def _misses(config: GPTConfig, family: Family) -> list[str]:
    """The flags of ``config`` that ``family`` cannot express, each with its value."""
    wanted = {**DECODER, **family.features}
    if family.model_type == DEEPSEEK:  # its rotary pairs are either layout (rope_interleave)
        del wanted["rotary_interleaved"]
    if family.qk_scope:
        wanted["qk_layernorm_scope"] = family.qk_scope
    wanted.update({name: value for name, value in EXTRAS.items() if name not in family.extras})
    if "embedding_multiplier" in family.extras:
        wanted["embedding_multiplier"] = config.hidden_size ** 0.5
    misses = [_miss(name, getattr(config, name), value) for name, value in wanted.items()
              if getattr(config, name) != value]
    if config.mtp_depths and family.model_type != DEEPSEEK:
        misses.append(f"--mtp-num-layers {config.mtp_depths} (multi-token prediction layers: DeepSeek-V3's "
                      "are mapped)")
    misses += {DEEPSEEK: deepseek_misses, GPT_OSS: gpt_oss_misses}.get(
        family.model_type, lambda c: moe_misses(c, family.model_type))(config)
    window, types = hf_windows(config)
    if window is not None and (family.windows == "none"
                               or (family.windows == "uniform" and "full_attention" in types)):
        misses.append(f"--window-size {config.window_size[0]} 0 (on {types.count('sliding_attention')} of "
                      f"{len(types)} layers)")
    if ("rotary_base_local" in family.extras and config.rotary_base_local is None and window is not None
            and config.rope_scaling != "none"):  # its windowed layers turn unscaled
        misses.append(f"--rope-scaling-type {config.rope_scaling} on windowed layers (give "
                      "--rotary-base-local)")
    return misses


def hf_kind(config: GPTConfig) -> str:
    """The Hugging Face ``model_type`` that expresses ``config`` exactly: the one it was imported from
    (``hf_model_type``), else the first that can; HFMappingError naming the flags that stand in the way."""
    if config.hf_model_type is not None:
        misses = (_gpt2_misses(config) if config.hf_model_type == "gpt2"
                  else hybrid_misses(config, config.hf_model_type) if config.hf_model_type in HYBRIDS
                  else _misses(config, FAMILIES[config.hf_model_type]))
        if misses:
            raise HFMappingError(f"--hf-model-type {config.hf_model_type} cannot express "
                                 f"{', '.join(misses)}: convert with --to consolidated instead")
        return config.hf_model_type
    if config.hybrid_layer_pattern:
        candidates = {kind: hybrid_misses(config, kind) for kind in HYBRIDS}
    else:
        candidates = {"gpt2": _gpt2_misses(config),
                      **{kind: _misses(config, f) for kind, f in FAMILIES.items()}}
    for kind, misses in candidates.items():
        if not misses:
            return kind
    nearest = sorted(candidates, key=lambda kind: len(candidates[kind]))[:2]
    raise HFMappingError("no Hugging Face class expresses this model ("
                         + "; ".join(f"{kind}: {', '.join(candidates[kind])}" for kind in nearest)
                         + "): convert with --to consolidated instead")


def config_to_hf(config: GPTConfig, special: dict[str, int | None]) -> dict:
    """config.json of the Hugging Face model that expresses ``config``; ``special``: bos/eos/pad ids, each
    written (null where the tokenizer has none: a family's own default, Phi-3's pad id 32000 say, may lie
    beyond the vocabulary)."""
    kind, tied = hf_kind(config), not config.untie_embeddings_and_output_weights
    special = {**dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id")), **special}
    if kind in HYBRIDS:
        return hybrid_to_hf(config, kind, special)
    if kind == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": config.vocab_size,
                "n_positions": config.max_positions, "n_embd": config.hidden_size,
                "n_layer": config.num_layers,
                "n_head": config.num_attention_heads, "n_inner": config.ffn_size,
                "activation_function": "gelu_new" if config.openai_gelu else "gelu",
                "layer_norm_epsilon": config.layernorm_epsilon, "resid_pdrop": config.hidden_dropout,
                "embd_pdrop": config.hidden_dropout, "attn_pdrop": config.attention_dropout,
                "tie_word_embeddings": tied, "torch_dtype": "float32", **special}
    family = FAMILIES[kind]
    activation = ("silu" if config.activation in ("swiglu", "quick_geglu")
                  else "gelu_pytorch_tanh" if config.openai_gelu else "gelu")
    hf = {"model_type": kind, "architectures": [family.architecture], "vocab_size": config.vocab_size,
          "hidden_size": config.hidden_size, "intermediate_size": config.ffn_size,
          "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
          "num_key_value_heads": config.query_groups, "head_dim": config.head_dim,
          "hidden_act": activation, "max_position_embeddings": config.max_positions,
          "rms_norm_eps": config.layernorm_epsilon, "rope_theta": config.rotary_base,
          "rope_parameters": rope_parameters(config), "attention_bias": config.add_qkv_bias,
          "mlp_bias": False, "tie_word_embeddings": tied, "attention_dropout": config.attention_dropout,
          "torch_dtype": "float32", **special}
    window, types = hf_windows(config)
    hf["sliding_window"] = window
    if family.windows == "per_layer":
        hf["layer_types"] = types
        if kind.startswith("qwen"):
            hf.update(use_sliding_window=window is not None, max_window_layers=config.num_layers)
    if kind == "phi3" and config.rope_scaling != "none":
        hf["original_max_position_embeddings"] = config.rope_original_max_position_embeddings
    if kind in MOE_FAMILIES:
        own = {DEEPSEEK: deepseek_to_hf, GPT_OSS: gpt_oss_to_hf}.get(kind, lambda c: moe_to_hf(c, kind))
        hf.update(own(config),
                  **({"qkv_bias": True} if kind == "qwen2_moe" else {}))
    if kind.startswith("gemma"):
        scalar = config.attention_scale ** -2
        hf.update(hidden_activation=activation, query_pre_attn_scalar=round(scalar)
                  if math.isclose(scalar, round(scalar)) else scalar,
                  attn_logit_softcapping=config.attn_logit_softcapping,
                  final_logit_softcapping=config.final_logit_softcapping)
        if window is None:
            hf["sliding_window"] = config.max_positions  # Gemma wants one; no layer uses it
    if kind == "gemma3_text":
        local = config.rotary_base_local or config.rotary_base
        hf["rope_parameters"] = {"full_attention": rope_parameters(config),
                                 "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    return hf
