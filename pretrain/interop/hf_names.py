"""How Hugging Face's GPT2LMHeadModel and LlamaForCausalLM (and the Llama-like Mistral and Qwen2)
correspond to this project's GPT: the configs both ways, and each tensor's names and layout both ways.

Our fused QKV holds, group by group, that group's query heads, then its key and its value head (see
``models.attention``); Hugging Face keeps q, k and v apart (Llama) or as q | k | v columns of one
Conv1D (GPT-2, whose weights are [in, out]). SwiGLU's gate and up are our ``fc1`` stacked [2, f, h].
A mapping is only offered where it is exact; anything else is refused, naming the option.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from models.config import GPTConfig

LLAMA_LIKE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class HFMappingError(ValueError):
    """A Hugging Face model or one of ours that the other side cannot express exactly; names why."""


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def _rope_fields(hf: dict) -> dict:
    """Our rotary fields (base and scaling) for a config's ``rope_parameters`` (or the older
    ``rope_scaling`` with ``rope_theta`` beside it); HFMappingError naming a rope_type we do not have."""
    parameters = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise HFMappingError(f"rope_type {kind!r} is not supported: {', '.join(ROPE_TYPES)} are")
    fields = {"rotary_base": float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if kind == "default":
        return fields
    longest = hf["max_position_embeddings"]
    original = parameters.get("original_max_position_embeddings",
                              hf.get("original_max_position_embeddings", longest))
    if kind == "dynamic":  # transformers scales dynamic NTK against max_position_embeddings
        original = longest
    factor = parameters.get("factor") or longest / original
    fields.update(rope_scaling_type=kind, rope_scaling_factor=float(factor),
                  rope_original_max_position_embeddings=int(original))
    optional = {"low_freq_factor": "rope_low_freq_factor", "high_freq_factor": "rope_high_freq_factor",
                "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "mscale": "rope_mscale",
                "mscale_all_dim": "rope_mscale_all_dim", "attention_factor": "rope_attention_factor",
                "truncate": "rope_yarn_truncate", "short_factor": "rope_short_factor",
                "long_factor": "rope_long_factor"}
    fields.update({ours: parameters[theirs] for theirs, ours in optional.items()
                   if parameters.get(theirs) is not None})
    return fields


def _rope_parameters(config: GPTConfig) -> dict:
    """transformers' ``rope_parameters`` for our rotary fields (the inverse of ``_rope_fields``)."""
    kind = config.rope_scaling
    parameters = {"rope_theta": config.rotary_base, "rope_type": "default" if kind == "none" else kind}
    if kind == "none":
        return parameters
    parameters["factor"] = config.rope_scaling_factor
    if kind != "dynamic":
        parameters["original_max_position_embeddings"] = config.rope_original_max_position_embeddings
    extra = {"llama3": {"low_freq_factor": config.rope_low_freq_factor,
                        "high_freq_factor": config.rope_high_freq_factor},
             "yarn": {"beta_fast": config.rope_beta_fast, "beta_slow": config.rope_beta_slow,
                      "mscale": config.rope_mscale, "mscale_all_dim": config.rope_mscale_all_dim,
                      "attention_factor": config.rope_attention_factor,
                      "truncate": config.rope_yarn_truncate},
             "longrope": {"short_factor": config.rope_short_factor, "long_factor": config.rope_long_factor,
                          "attention_factor": config.rope_attention_factor}}.get(kind, {})
    return {**parameters, **{key: value for key, value in extra.items() if value is not None}}


def config_from_hf(hf: dict) -> GPTConfig:
    """Our GPTConfig for a Hugging Face config.json; HFMappingError naming what has no exact counterpart."""
    kind = hf.get("model_type")
    if kind == "gpt2":
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
                         openai_gelu=activation != "gelu",
                         hidden_dropout=0.0, attention_dropout=0.0,
                         untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True))
    if kind not in LLAMA_LIKE:
        raise HFMappingError(f"model_type {kind!r} is not supported: GPT2LMHeadModel, LlamaForCausalLM, "
                             "MistralForCausalLM and Qwen2ForCausalLM are")
    for option in ("num_local_experts", "num_experts", "n_routed_experts"):
        if hf.get(option):
            raise HFMappingError(f"{kind} with {option}={hf[option]}: mixture-of-experts layers are not "
                                 "supported")
    window = hf.get("sliding_window")
    if (window and window < hf["max_position_embeddings"]
            and (kind != "qwen2" or hf.get("use_sliding_window"))):
        raise HFMappingError(f"{kind} with sliding_window={window} (< max_position_embeddings "
                             f"{hf['max_position_embeddings']}): sliding-window attention is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFMappingError(f"{kind} hidden_act {hf['hidden_act']!r} is not supported (SwiGLU needs silu)")
    if hf.get("mlp_bias") or (kind != "qwen2" and hf.get("attention_bias")):
        raise HFMappingError(f"{kind} with mlp_bias / attention_bias is not supported")
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    return GPTConfig(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                     num_attention_heads=heads,
                     ffn_hidden_size=hf["intermediate_size"],
                     seq_length=min(hf["max_position_embeddings"], 4096),
                     max_position_embeddings=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
                     position_embedding_type="rope", **_rope_fields(hf),
                     rotary_percent=float(hf.get("partial_rotary_factor", 1.0)), normalization="RMSNorm",
                     layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True,
                     group_query_attention=groups != heads,
                     num_query_groups=groups if groups != heads else None,
                     kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads, disable_bias_linear=True,
                     add_qkv_bias=kind == "qwen2", hidden_dropout=0.0, attention_dropout=0.0,
                     untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False))


def hf_kind(config: GPTConfig) -> str:
    """'gpt2' or 'llama' (or 'qwen2' with query/key/value biases): the Hugging Face class that expresses
    ``config`` exactly; HFMappingError naming the flags that neither does."""
    gpt2 = {"--position-embedding-type": (config.position_embedding, "learned_absolute"),
            "--normalization": (config.normalization, "LayerNorm"),
            "--swiglu / --squared-relu": (config.activation, "gelu"),
            "--num-query-groups": (config.query_groups, config.num_attention_heads),
            "--kv-channels": (config.head_dim, config.hidden_size // config.num_attention_heads),
            "--disable-bias-linear": (config.disable_bias_linear, False),
            "--qk-layernorm": (config.qk_layernorm, False),
            "--add-qkv-bias": (config.add_qkv_bias, False)}
    llama = {"--position-embedding-type": (config.position_embedding, "rope"),
             "--normalization": (config.normalization, "RMSNorm"), "--swiglu": (config.activation, "swiglu"),
             "--disable-bias-linear": (config.disable_bias_linear, True),
             "--qk-layernorm": (config.qk_layernorm, False),
             "--rotary-interleaved": (config.rotary_interleaved, False),
             "--rotary-percent": (config.rotary_percent, 1.0)}
    misses = {name: [f"{flag} {value}" for flag, (value, wanted) in table.items() if value != wanted]
              for name, table in (("gpt2", gpt2), ("llama", llama))}
    if not misses["gpt2"]:
        return "gpt2"
    if not misses["llama"]:
        return "qwen2" if config.add_qkv_bias else "llama"
    raise HFMappingError(f"neither GPT-2 ({', '.join(misses['gpt2'])}) nor Llama "
                         f"({', '.join(misses['llama'])}) "
                         "can express this model: convert with --to consolidated instead")


def config_to_hf(config: GPTConfig, special: dict[str, int | None]) -> dict:
    """config.json of the Hugging Face model that expresses ``config``; ``special``: bos/eos/pad ids."""
    kind, tied = hf_kind(config), not config.untie_embeddings_and_output_weights
    if kind == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": config.vocab_size,
                "n_positions": config.max_positions, "n_embd": config.hidden_size,
                "n_layer": config.num_layers,
                "n_head": config.num_attention_heads, "n_inner": config.ffn_size,
                "activation_function": "gelu_new" if config.openai_gelu else "gelu",
                "layer_norm_epsilon": config.layernorm_epsilon, "resid_pdrop": config.hidden_dropout,
                "embd_pdrop": config.hidden_dropout, "attn_pdrop": config.attention_dropout,
                "tie_word_embeddings": tied, "torch_dtype": "float32", **special}
    heads, groups = config.num_attention_heads, config.query_groups
    return {"model_type": kind, "architectures": [LLAMA_LIKE[kind]], "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "intermediate_size": config.ffn_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": heads,
            "num_key_value_heads": groups,
            "head_dim": config.head_dim, "hidden_act": "silu",
            "max_position_embeddings": config.max_positions,
            "rms_norm_eps": config.layernorm_epsilon, "rope_theta": config.rotary_base,
            "rope_parameters": _rope_parameters(config),
            "attention_bias": kind == "qwen2", "mlp_bias": False, "tie_word_embeddings": tied,
            "attention_dropout": config.attention_dropout, "torch_dtype": "float32", **special}


# ---------------------------------------------------------------------------------------------- tensors

def _qkv_from(config: GPTConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [a d, ...], k, v [G d, ...] -> ours [(a + 2G) d, ...], group by group."""
    groups, d = config.query_groups, config.head_dim
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
                     dim=1).reshape(-1, *rest)


def _qkv_to(config: GPTConfig, ours: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = config.query_groups, config.head_dim
    rest = ours.shape[1:]
    grouped = ours.reshape(groups, -1, *rest)
    queries = grouped.shape[1] - 2 * d
    return (grouped[:, :queries].reshape(-1, *rest), grouped[:, queries:queries + d].reshape(-1, *rest),
            grouped[:, queries + d:].reshape(-1, *rest))


def _norm_scale(config: GPTConfig, ours: torch.Tensor) -> torch.Tensor:
    """Our norm weight -> the scale Hugging Face stores (1 + w under --apply-layernorm-1p)."""
    return ours + 1 if config.apply_layernorm_1p else ours


Transform = Callable[..., torch.Tensor]


def import_plan(config: GPTConfig, hf: dict) -> Iterator[tuple[str, list[str], Transform]]:
    """(our name, the Hugging Face tensors it is made of, how) for every parameter of ours."""
    same = lambda t: t  # noqa: E731 - the identity, named for the table below
    t = lambda x: x.t()  # noqa: E731 - GPT-2's Conv1D keeps [in, out]
    if hf["model_type"] == "gpt2":
        def c_attn(weight):  # [h, 3h] (q | k | v columns) or a bias [3h]
            q, k, v = (weight.t() if weight.dim() == 2 else weight).chunk(3, dim=0)
            return _qkv_from(config, q, k, v)
        yield "word_embedding.weight", ["transformer.wte.weight"], same
        yield "position_embedding.weight", ["transformer.wpe.weight"], same
        for i in range(config.num_layers):
            ours, theirs = f"layers.{i}", f"transformer.h.{i}"
            for kind in ("weight", "bias"):
                yield f"{ours}.attention_norm.{kind}", [f"{theirs}.ln_1.{kind}"], same
                yield f"{ours}.attention.qkv.{kind}", [f"{theirs}.attn.c_attn.{kind}"], c_attn
                yield (f"{ours}.attention.proj.{kind}", [f"{theirs}.attn.c_proj.{kind}"],
                       t if kind == "weight" else same)
                yield f"{ours}.mlp_norm.{kind}", [f"{theirs}.ln_2.{kind}"], same
                yield f"{ours}.mlp.fc1.{kind}", [f"{theirs}.mlp.c_fc.{kind}"], t if kind == "weight" else same
                yield (f"{ours}.mlp.fc2.{kind}", [f"{theirs}.mlp.c_proj.{kind}"],
                       t if kind == "weight" else same)
        for kind in ("weight", "bias"):
            yield f"final_norm.{kind}", [f"transformer.ln_f.{kind}"], same
        if config.untie_embeddings_and_output_weights:
            yield "output_layer.weight", ["lm_head.weight"], same
        return
    yield "word_embedding.weight", ["model.embed_tokens.weight"], same
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        attention = [f"{theirs}.self_attn.{p}_proj.weight" for p in "qkv"]
        yield f"{ours}.attention_norm.weight", [f"{theirs}.input_layernorm.weight"], same
        yield f"{ours}.attention.qkv.weight", attention, lambda q, k, v: _qkv_from(config, q, k, v)
        if config.add_qkv_bias:
            yield (f"{ours}.attention.qkv.bias", [f"{theirs}.self_attn.{p}_proj.bias" for p in "qkv"],
                   lambda q, k, v: _qkv_from(config, q, k, v))
        yield f"{ours}.attention.proj.weight", [f"{theirs}.self_attn.o_proj.weight"], same
        yield f"{ours}.mlp_norm.weight", [f"{theirs}.post_attention_layernorm.weight"], same
        yield (f"{ours}.mlp.fc1.weight", [f"{theirs}.mlp.gate_proj.weight", f"{theirs}.mlp.up_proj.weight"],
               lambda gate, up: torch.stack([gate, up]))
        yield f"{ours}.mlp.fc2.weight", [f"{theirs}.mlp.down_proj.weight"], same
    yield "final_norm.weight", ["model.norm.weight"], same
    if config.untie_embeddings_and_output_weights:
        yield "output_layer.weight", ["lm_head.weight"], same


def export_plan(config: GPTConfig) -> Iterator[tuple[str, str, Transform]]:
    """(Hugging Face name, our parameter it comes from, how) for every tensor of the Hugging Face model."""
    kind = hf_kind(config)
    same = lambda x: x  # noqa: E731
    t = lambda x: x.t()  # noqa: E731
    scale = lambda x: _norm_scale(config, x)  # noqa: E731
    if kind == "gpt2":
        def c_attn(ours):
            q, k, v = _qkv_to(config, ours)
            joined = torch.cat([q, k, v], dim=0)
            return joined.t() if joined.dim() == 2 else joined
        yield "transformer.wte.weight", "word_embedding.weight", same
        yield "transformer.wpe.weight", "position_embedding.weight", same
        for i in range(config.num_layers):
            ours, theirs = f"layers.{i}", f"transformer.h.{i}"
            for part in ("weight", "bias"):
                norm = scale if part == "weight" else same
                conv = t if part == "weight" else same
                yield f"{theirs}.ln_1.{part}", f"{ours}.attention_norm.{part}", norm
                yield f"{theirs}.attn.c_attn.{part}", f"{ours}.attention.qkv.{part}", c_attn
                yield f"{theirs}.attn.c_proj.{part}", f"{ours}.attention.proj.{part}", conv
                yield f"{theirs}.ln_2.{part}", f"{ours}.mlp_norm.{part}", norm
                yield f"{theirs}.mlp.c_fc.{part}", f"{ours}.mlp.fc1.{part}", conv
                yield f"{theirs}.mlp.c_proj.{part}", f"{ours}.mlp.fc2.{part}", conv
        yield "transformer.ln_f.weight", "final_norm.weight", scale
        yield "transformer.ln_f.bias", "final_norm.bias", same
        if config.untie_embeddings_and_output_weights:
            yield "lm_head.weight", "output_layer.weight", same
        return
    yield "model.embed_tokens.weight", "word_embedding.weight", same
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        yield f"{theirs}.input_layernorm.weight", f"{ours}.attention_norm.weight", scale
        for index, name in enumerate("qkv"):
            yield (f"{theirs}.self_attn.{name}_proj.weight", f"{ours}.attention.qkv.weight",
                   lambda x, index=index: _qkv_to(config, x)[index])
            if config.add_qkv_bias:
                yield (f"{theirs}.self_attn.{name}_proj.bias", f"{ours}.attention.qkv.bias",
                       lambda x, index=index: _qkv_to(config, x)[index])
        yield f"{theirs}.self_attn.o_proj.weight", f"{ours}.attention.proj.weight", same
        yield f"{theirs}.post_attention_layernorm.weight", f"{ours}.mlp_norm.weight", scale
        yield f"{theirs}.mlp.gate_proj.weight", f"{ours}.mlp.fc1.weight", lambda x: x[0]
        yield f"{theirs}.mlp.up_proj.weight", f"{ours}.mlp.fc1.weight", lambda x: x[1]
        yield f"{theirs}.mlp.down_proj.weight", f"{ours}.mlp.fc2.weight", same
    yield "model.norm.weight", "final_norm.weight", scale
    if config.untie_embeddings_and_output_weights:
        yield "lm_head.weight", "output_layer.weight", same
