"""Where a token attends and how its position turns, between Hugging Face's ``config.json`` and our flags:
the rotary base and scaling (``rope_parameters``, or the older ``rope_scaling`` with ``rope_theta``; Gemma 3's
one set per layer type) and the sliding windows (``sliding_window`` with ``layer_types``, Qwen's
``max_window_layers``, Gemma's patterns). Both directions live here so that they cannot disagree."""

from __future__ import annotations

from models.config import GPTConfig


class HFMappingError(ValueError):
    """A Hugging Face model or one of ours that the other side cannot express exactly; names why."""


def refuse_other_values(hf: dict, kind: str, keys: dict) -> None:
    """HFMappingError for the first ``key: wanted`` that config ``hf`` of family ``kind`` sets otherwise (a
    key left out or None takes the value that maps)."""
    for key, wanted in keys.items():
        if hf.get(key) is not None and hf[key] != wanted:
            raise HFMappingError(f"{kind} with {key}={hf[key]}: only {wanted} maps")


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


# ------------------------------------------------------------------------------------------ rotary

def rope_fields(hf: dict, parameters: dict) -> dict:
    """Our rotary fields (base and scaling) for rope ``parameters`` (``rope_parameters``, or the older
    ``rope_scaling`` with ``rope_theta`` beside it); HFMappingError naming a rope_type we do not have."""
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


def rope_parameters(config: GPTConfig) -> dict:
    """transformers' ``rope_parameters`` for our rotary fields (the inverse of ``_rope_fields``)."""
    kind = config.rope_scaling
    parameters = {"rope_theta": config.rotary_base, "rope_type": "default" if kind == "none" else kind}
    if config.rotary_percent != 1.0:
        parameters["partial_rotary_factor"] = config.rotary_percent
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


def rotary(hf: dict, kind: str) -> dict:
    """The rotary fields of a decoder config; Gemma 3 keeps one set per layer type, the sliding-window
    layers' unscaled with a base of their own."""
    parameters = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if kind != "gemma3_text":
        fields = rope_fields(hf, parameters)
    else:
        local = parameters.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise HFMappingError(f"gemma3_text with rope_parameters.sliding_attention.rope_type="
                                 f"{local['rope_type']!r}: the sliding-window layers' rotary positions "
                                 "map unscaled only")
        fields = rope_fields(hf, {"rope_theta": 1_000_000.0, **(parameters.get("full_attention") or {})})
        fields["rotary_base_local"] = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
    fields["rotary_percent"] = float(parameters.get("partial_rotary_factor",
                                                    hf.get("partial_rotary_factor", 1.0)))
    return fields


# ----------------------------------------------------------------------------------------- windows

def _layer_types(hf: dict, kind: str, layers: int) -> list[str]:
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    if kind in ("gemma2", "gemma3_text"):
        pattern = 2 if kind == "gemma2" else hf.get("sliding_window_pattern", 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if kind.startswith("qwen"):
        first = hf.get("max_window_layers", layers)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return ["sliding_attention"] * layers


def windows(hf: dict, kind: str, layers: int) -> dict:
    """--window-size and --window-attn-skip-freq for the config's sliding window and layer types."""
    window = hf.get("sliding_window")
    if kind.startswith("qwen") and not hf.get("use_sliding_window"):
        window = None
    if not window:
        return {}
    types = _layer_types(hf, kind, layers)
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != layers:
        raise HFMappingError(f"{kind} with layer_types {unknown or types}: only sliding_attention and "
                             f"full_attention layers map, one per layer ({layers})")
    windowed = [layer_type == "sliding_attention" for layer_type in types]
    if not any(windowed):
        return {}
    fields = {"window_size": [int(window) - 1, 0]}
    if not all(windowed):
        fields["window_attn_skip_freq"] = [int(w) for w in windowed]
    return fields


def hf_windows(config: GPTConfig) -> tuple[int | None, list[str]]:
    """(sliding_window, layer_types) of our windows."""
    windows = [config.attention_window(layer) for layer in range(config.num_layers)]
    window = next((w for w in windows if w is not None), None)
    return window, ["full_attention" if w is None else "sliding_attention" for w in windows]
