"""megatron-core's state-dict keys as this stack's parameter names.

Both stacks lay their tensors out alike: a fused QKV weight's rows are query groups of q, k and v; a gated
fc1 holds the gate, then the up matrix (ours stacks them as [2, ffn, hidden], the same elements); column-
and row-parallel weights and the vocabulary tables split along the same dimensions. So a key maps to one
of our names and its tensor keeps its elements. Layer norms go by either of Megatron's spellings: the
local spec's (``input_layernorm``, ``pre_mlp_layernorm``) or Transformer Engine's fused ones
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), which ``torch_dist`` checkpoints
use whatever the spec. Keys that are not parameters (``_extra_state``, buffers) are skipped.
"""

from __future__ import annotations

import re

# within one transformer layer: Megatron's key -> ours
LAYER_KEYS = {
    "input_layernorm.weight": "attention_norm.weight",
    "input_layernorm.bias": "attention_norm.bias",
    "self_attention.linear_qkv.layer_norm_weight": "attention_norm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "attention_norm.bias",
    "self_attention.linear_qkv.weight": "attention.qkv.weight",
    "self_attention.linear_qkv.bias": "attention.qkv.bias",
    "self_attention.q_layernorm.weight": "attention.q_norm.weight",
    "self_attention.q_layernorm.bias": "attention.q_norm.bias",
    "self_attention.k_layernorm.weight": "attention.k_norm.weight",
    "self_attention.k_layernorm.bias": "attention.k_norm.bias",
    "self_attention.linear_proj.weight": "attention.proj.weight",
    "self_attention.linear_proj.bias": "attention.proj.bias",
    "pre_mlp_layernorm.weight": "mlp_norm.weight",
    "pre_mlp_layernorm.bias": "mlp_norm.bias",
    "mlp.linear_fc1.layer_norm_weight": "mlp_norm.weight",
    "mlp.linear_fc1.layer_norm_bias": "mlp_norm.bias",
    "mlp.linear_fc1.weight": "mlp.fc1.weight",
    "mlp.linear_fc1.bias": "mlp.fc1.bias",
    "mlp.linear_fc2.weight": "mlp.fc2.weight",
    "mlp.linear_fc2.bias": "mlp.fc2.bias",
}
MODEL_KEYS = {
    "embedding.word_embeddings.weight": "word_embedding.weight",
    "embedding.position_embeddings.weight": "position_embedding.weight",
    "decoder.final_layernorm.weight": "final_norm.weight",
    "decoder.final_layernorm.bias": "final_norm.bias",
    "output_layer.weight": "output_layer.weight",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
STACKED_PREFIX = "decoder.layers."  # torch_dist: one key per layer tensor, the layers along a first axis


# ours -> Megatron's: the local spec's norm names (legacy files) or the fused ones (torch_dist, whatever
# the spec: megatron-core's own sharded state dict maps the local names onto them)
LOCAL_LAYER_KEYS = {ours: theirs for theirs, ours in LAYER_KEYS.items() if ".layer_norm_" not in theirs}
FUSED_LAYER_KEYS = {ours: theirs for theirs, ours in LAYER_KEYS.items()
                    if not theirs.startswith(("input_layernorm.", "pre_mlp_layernorm."))}
OUR_MODEL_KEYS = {ours: theirs for theirs, ours in MODEL_KEYS.items()}
# the modules of megatron-core's local spec that keep an (empty) extra state in a state dict
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                       "mlp.linear_fc2")


def megatron_key(ours: str, fused_norms: bool) -> tuple[str, int | None]:
    """Megatron's key of our name ``ours``, and its layer (None outside the layers): within the layer
    for a layer's tensor (``decoder.layers.{layer}.`` to be prefixed)."""
    if ours in OUR_MODEL_KEYS:
        return OUR_MODEL_KEYS[ours], None
    _, layer, inner = ours.split(".", 2)
    return (FUSED_LAYER_KEYS if fused_norms else LOCAL_LAYER_KEYS)[inner], int(layer)


class UnknownKey(ValueError):
    """A tensor of the checkpoint with no place in the model (another architecture)."""


def skipped(key: str) -> bool:
    """Whether ``key`` is state that is no parameter: Transformer Engine's extra state, rotary buffers."""
    return "_extra_state" in key or key.endswith(("inv_freq", "rotary_pos_emb.freqs"))


def ours_of(key: str, layer_offset: int = 0) -> str:
    """Our name of Megatron's ``key`` (a model chunk's, its layers numbered from ``layer_offset``)."""
    if key in MODEL_KEYS:
        return MODEL_KEYS[key]
    match = _LAYER.match(key)
    if match and match.group(2) in LAYER_KEYS:
        return f"layers.{int(match.group(1)) + layer_offset}.{LAYER_KEYS[match.group(2)]}"
    raise UnknownKey(key)


def ours_of_stacked(key: str) -> str:
    """Our name, with ``{}`` for the layer, of a torch_dist key whose first axis runs over the layers."""
    inner = key[len(STACKED_PREFIX):]
    if inner not in LAYER_KEYS:
        raise UnknownKey(key)
    return "layers.{}." + LAYER_KEYS[inner]
