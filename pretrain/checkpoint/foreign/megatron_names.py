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
    # a mixture of experts' router and its shared experts (their gate: one row, a sigmoid of it scales them)
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.bias": "mlp.router.bias",
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts.fc1.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.fc2.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_gate.weight",
    # a hybrid model's Mamba-2 layer (``M``): its pre-norm (the local spec's ``norm``, fused into in_proj
    # in Transformer Engine's) and its mixer; Megatron-LM main's legacy files name the convolution's
    # tensors ``conv1d_weight`` / ``conv1d_bias`` (listed first: an export writes megatron-core 0.16's)
    "norm.weight": "mamba_norm.weight",
    "norm.bias": "mamba_norm.bias",
    "mixer.in_proj.layer_norm_weight": "mamba_norm.weight",
    "mixer.in_proj.layer_norm_bias": "mamba_norm.bias",
    "mixer.in_proj.weight": "mamba.in_proj.weight",
    "mixer.conv1d_weight": "mamba.conv1d.weight",
    "mixer.conv1d_bias": "mamba.conv1d.bias",
    "mixer.conv1d.weight": "mamba.conv1d.weight",
    "mixer.conv1d.bias": "mamba.conv1d.bias",
    "mixer.A_log": "mamba.A_log",
    "mixer.D": "mamba.D",
    "mixer.dt_bias": "mamba.dt_bias",
    "mixer.norm.weight": "mamba.norm.weight",
    "mixer.out_proj.weight": "mamba.out_proj.weight",
    # a hybrid model's gated delta net layer (``G``, Megatron-LM main's: a TransformerLayer whose
    # self_attention is a GatedDeltaNet, its pre-norm fused into in_proj: Megatron builds it with
    # Transformer Engine only, so both formats use the fused name)
    "self_attention.in_proj.layer_norm_weight": "gdn_norm.weight",
    "self_attention.in_proj.layer_norm_bias": "gdn_norm.bias",
    "self_attention.in_proj.weight": "gdn.in_proj.weight",
    "self_attention.conv1d.weight": "gdn.conv1d.weight",
    "self_attention.A_log": "gdn.A_log",
    "self_attention.dt_bias": "gdn.dt_bias",
    "self_attention.out_norm.weight": "gdn.out_norm.weight",
    "self_attention.out_proj.weight": "gdn.out_proj.weight",
}
# latent attention's, within a layer (its latent norms take the dense layer's q/k-norm keys in the local spec,
# and fuse into the up projections in Transformer Engine's)
LATENT_LAYER_KEYS = {
    "self_attention.linear_q_proj.weight": "attention.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "attention.q_down.weight",
    "self_attention.linear_q_up_proj.weight": "attention.q_up.weight",
    "self_attention.linear_kv_down_proj.weight": "attention.kv_down.weight",
    "self_attention.linear_kv_up_proj.weight": "attention.kv_up.weight",
    "self_attention.q_layernorm.weight": "attention.q_latent_norm.weight",
    "self_attention.kv_layernorm.weight": "attention.kv_latent_norm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "attention.q_latent_norm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "attention.kv_latent_norm.weight",
}
# the down projections the local spec splits over tp by rows (ours, and Transformer Engine's, are whole)
ROW_SPLIT_DOWN = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")
# within one expert (SequentialMLP's local_experts.{i}, or torch_dist's expert axis): Megatron's -> ours
EXPERT_KEYS = {"linear_fc1.weight": "fc1.weight", "linear_fc1.bias": "fc1.bias",
               "linear_fc2.weight": "fc2.weight", "linear_fc2.bias": "fc2.bias"}
OUR_EXPERT_KEYS = {ours: theirs for theirs, ours in EXPERT_KEYS.items()}
LEGACY_EXPERTS = "mlp.experts.local_experts."  # + {local expert}.{EXPERT_KEYS}
STACKED_EXPERTS = "mlp.experts.experts."  # torch_dist: + {EXPERT_KEYS}, the experts along an axis
MODEL_KEYS = {
    "embedding.word_embeddings.weight": "word_embedding.weight",
    "embedding.position_embeddings.weight": "position_embedding.weight",
    "decoder.final_layernorm.weight": "final_norm.weight",
    "decoder.final_layernorm.bias": "final_norm.bias",
    "decoder.final_norm.weight": "final_norm.weight",  # (a HybridModel's)
    "decoder.final_norm.bias": "final_norm.bias",
    "output_layer.weight": "output_layer.weight",
}
LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# a multi-token prediction depth (megatron-core's MultiTokenPredictionLayer ``mtp.layers.{k}.``): its own
# tensors, and its transformer layer (``transformer_layer.``; Megatron-LM main's legacy files name the module
# ``mtp_model_layer.``, its torch_dist keys keep the older name)
MTP_KEY = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
MTP_DEPTH_KEYS = {"enorm.weight": "enorm.weight", "enorm.bias": "enorm.bias", "hnorm.weight": "hnorm.weight",
                  "hnorm.bias": "hnorm.bias", "eh_proj.weight": "eh_proj.weight",
                  "final_layernorm.weight": "final_norm.weight", "final_layernorm.bias": "final_norm.bias"}
OUR_MTP_DEPTH_KEYS = {ours: theirs for theirs, ours in MTP_DEPTH_KEYS.items()}
MTP_LAYER_MODULES = ("transformer_layer.", "mtp_model_layer.")
MTP_EXTRA_STATE_MODULES = ("eh_proj",)
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
STACKED_PREFIX = "decoder.layers."  # torch_dist: one key per layer tensor, the layers along a first axis


# ours -> Megatron's: the local spec's norm names (legacy files) or the fused ones (torch_dist, whatever
# the spec: megatron-core's own sharded state dict maps the local names onto them)
LOCAL_NORM_MODULES = ("input_layernorm.", "pre_mlp_layernorm.", "norm.")
FUSED_LAYER_KEYS = {ours: theirs for theirs, ours in LAYER_KEYS.items()
                    if not theirs.startswith(LOCAL_NORM_MODULES)}
# (the fused name where a layer has no other: a gated delta net's norm)
LOCAL_LAYER_KEYS = {**FUSED_LAYER_KEYS,
                    **{ours: theirs for theirs, ours in LAYER_KEYS.items() if ".layer_norm_" not in theirs}}
LOCAL_LATENT_KEYS = {**LOCAL_LAYER_KEYS, **{ours: theirs for theirs, ours in LATENT_LAYER_KEYS.items()
                                            if ".layer_norm_" not in theirs}}
OUR_MODEL_KEYS = {ours: theirs for theirs, ours in MODEL_KEYS.items()
                  if not theirs.startswith("decoder.final_norm.")}
# a HybridModel's (its final norm's name)
OUR_HYBRID_MODEL_KEYS = {ours: theirs for theirs, ours in MODEL_KEYS.items()
                         if not theirs.startswith("decoder.final_layernorm.")}
# the modules of megatron-core's local spec that keep an (empty) extra state in a state dict: a dense
# layer's attention (latent attention's: ``attention_extra_state_modules``), a dense MLP, a mixture of
# experts' shared expert, and each expert's own two (within the expert)
ATTENTION_EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj")
MLP_EXTRA_STATE_MODULES = ("mlp.linear_fc1", "mlp.linear_fc2")
SHARED_EXPERT_EXTRA_STATE_MODULES = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
EXPERT_EXTRA_STATE_MODULES = ("linear_fc1", "linear_fc2")
MAMBA_EXTRA_STATE_MODULES = ("mixer.in_proj", "mixer.out_proj")
GDN_EXTRA_STATE_MODULES = ("self_attention.in_proj", "self_attention.out_proj")


def extra_state_modules(entry: str, latent: bool, q_lora_rank: int | None, shared_experts: bool
                        ) -> tuple[str, ...]:
    """The local spec's modules with an extra state in a layer whose layer-list entry is ``entry`` (a
    pattern's symbol, or a GPT block's ``*-`` / ``*E``: each of its symbols' sublayers); a mixture of
    experts' own experts aside."""
    modules: tuple[str, ...] = ()
    for symbol in entry:
        modules += {"M": MAMBA_EXTRA_STATE_MODULES, "G": GDN_EXTRA_STATE_MODULES,
                    "-": MLP_EXTRA_STATE_MODULES,
                    "E": SHARED_EXPERT_EXTRA_STATE_MODULES if shared_experts else ()}.get(
                        symbol, attention_extra_state_modules(latent, q_lora_rank))
    return modules


def attention_extra_state_modules(latent: bool, q_lora_rank: int | None) -> tuple[str, ...]:
    """The attention's modules with an extra state: the dense layer's two, or latent attention's
    projections."""
    if not latent:
        return ATTENTION_EXTRA_STATE_MODULES
    queries = ("linear_q_proj",) if q_lora_rank is None else ("linear_q_down_proj", "linear_q_up_proj")
    return tuple(f"self_attention.{module}" for module in
                 ("linear_proj", *queries, "linear_kv_down_proj", "linear_kv_up_proj"))


def megatron_key(ours: str, fused_norms: bool, latent: bool = False, hybrid: bool = False
                 ) -> tuple[str, int | None, int | None]:
    """Megatron's key of our name ``ours``, its layer (None outside the layers) and expert (None outside
    the experts): within the layer for a layer's tensor (``decoder.layers.{layer}.`` to be prefixed),
    within the expert for an expert's (the format's expert prefix too). A latent-attention model's keys
    are the local spec's in both formats (its sharded state dict maps no norm); ``hybrid``: a
    HybridModel's (its final norm's name)."""
    model_keys = OUR_HYBRID_MODEL_KEYS if hybrid else OUR_MODEL_KEYS
    if ours in model_keys:
        return model_keys[ours], None, None
    if ours.startswith("mtp."):
        return _mtp_key(ours, fused_norms, latent)
    _, layer, inner = ours.split(".", 2)
    if inner.startswith("mlp.experts."):
        _, _, expert, within = inner.split(".", 3)
        return OUR_EXPERT_KEYS[within], int(layer), int(expert)
    keys = LOCAL_LATENT_KEYS if latent else FUSED_LAYER_KEYS if fused_norms else LOCAL_LAYER_KEYS
    return keys[inner], int(layer), None


def _mtp_key(ours: str, fused_norms: bool, latent: bool) -> tuple[str, None, int | None]:
    """Megatron's whole key of a prediction depth's tensor ``ours`` (``mtp.{k}.``; its one layer's under
    ``transformer_layer.``, an expert's with the format's expert prefix to be put after that), with no
    layer: depths sit outside the decoder's layers."""
    _, depth, inner = ours.split(".", 2)
    prefix = f"mtp.layers.{depth}."
    if inner in OUR_MTP_DEPTH_KEYS:
        return prefix + OUR_MTP_DEPTH_KEYS[inner], None, None
    key, _, expert = megatron_key("layers.0." + inner.split(".", 2)[2], fused_norms, latent)
    return (mtp_layer_prefix(ours) + key if expert is None else key), None, expert


def mtp_layer_prefix(ours: str) -> str:
    """Megatron's prefix of the transformer layer of the prediction depth our name ``ours`` is in."""
    return f"mtp.layers.{ours.split('.', 2)[1]}.transformer_layer."


# the order megatron-core's local spec registers a layer's modules in (its parameters', and so its
# optimizer's, order): attention's, then the MLP's or the mixture of experts'
LOCAL_MODULE_ORDER = ("input_layernorm", "self_attention.linear_proj", "self_attention.linear_q_proj",
                      "self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
                      "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj",
                      "self_attention.linear_qkv", "self_attention.q_layernorm", "self_attention.k_layernorm",
                      "self_attention.kv_layernorm", "pre_mlp_layernorm", "mlp.router", "mlp.experts",
                      "mlp.shared_experts.gate_weight", "mlp.shared_experts.linear_fc1",
                      "mlp.shared_experts.linear_fc2", "mlp.linear_fc1", "mlp.linear_fc2",
                      # a Mamba-2 layer's: the mixer's own tensors, its modules, then the layer's norm
                      "mixer.dt_bias", "mixer.A_log", "mixer.D", "mixer.in_proj", "mixer.conv1d",
                      "mixer.norm", "mixer.out_proj", "norm.",
                      # a gated delta net's (its own tensors, then its modules; its norm fused into in_proj)
                      "self_attention.dt_bias", "self_attention.A_log", "self_attention.in_proj",
                      "self_attention.conv1d", "self_attention.out_norm", "self_attention.out_proj")
_MODEL_ORDER = ("embedding.word_embeddings.", "embedding.position_embeddings.", "decoder.layers.",
                "decoder.final_layernorm.", "decoder.final_norm.", "mtp.", "output_layer.")
_MTP_ORDER = ("enorm.", "hnorm.", "eh_proj.", MTP_LAYER_MODULES, "final_layernorm.")


# torch_dist's fused norm names for the local spec's norm modules
LOCAL_NORMS = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
               "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}
_WITHIN_MODULE = ("layer_norm_weight", "layer_norm_bias", "weight", "bias")  # Transformer Engine's order


def registration_order(key: str, local_spec: bool = True) -> tuple:
    """A sort key putting a model chunk's Megatron keys in the order megatron-core registers their
    parameters: its local spec's (torch_dist's fused norm names taken for the local norm modules they
    stand for), or Transformer Engine's (``local_spec`` False: a fused norm's weight and bias before its
    linear's); a weight before its bias."""
    model = next(number for number, prefix in enumerate(_MODEL_ORDER) if key.startswith(prefix))
    last = key.rsplit(".", 1)[-1]
    within = _WITHIN_MODULE.index(last) if last in _WITHIN_MODULE else 2
    depth = MTP_KEY.match(key)
    if depth:  # a depth's own modules in its order, its layer's keys as a decoder layer's
        inner = depth.group(2)
        part = next(number for number, names in enumerate(_MTP_ORDER) if inner.startswith(names))
        within_layer = _in_depth_layer(inner)
        return (model, int(depth.group(1)), part,
                *(_layer_order(within_layer, within, local_spec) if within_layer else (0, within)))
    match = LAYER_KEY.match(key)
    if not match:
        return model, 0, 0, within
    return (model, int(match.group(1)), *_layer_order(match.group(2), within, local_spec))


def _layer_order(inner: str, within: int, local_spec: bool) -> tuple[int, int]:
    """(module, within it) of a layer's key ``inner`` in megatron-core's registration order."""
    for fused, local in LOCAL_NORMS.items():
        if local_spec and inner.startswith(fused):
            inner, within = local + inner[len(fused):], 2 + inner.endswith("bias")
    return next(number for number, name in enumerate(LOCAL_MODULE_ORDER) if inner.startswith(name)), within


class UnknownKey(ValueError):
    """A tensor of the checkpoint with no place in the model (another architecture)."""


def skipped(key: str) -> bool:
    """Whether ``key`` is state that is no parameter: Transformer Engine's extra state, rotary buffers."""
    return "_extra_state" in key or key.endswith(("inv_freq", "rotary_pos_emb.freqs"))


def ours_of(key: str, layer_offset: int = 0, expert_offset: int = 0, latent: bool = False) -> str:
    """Our name of Megatron's ``key`` (a model chunk's, its layers numbered from ``layer_offset``, its
    local experts from ``expert_offset``; ``latent``: a latent-attention model's); a torch_dist key of one
    layer's experts has ``{}`` for the expert (its first axis)."""
    if key in MODEL_KEYS:
        return MODEL_KEYS[key]
    match = LAYER_KEY.match(key)
    if match:
        layer = int(match.group(1)) + layer_offset
        inner = _within_layer(key, match.group(2), expert_offset, latent)
        return f"layers.{layer}.{inner}"
    match = MTP_KEY.match(key)
    if match:
        depth, inner = match.groups()
        if inner in MTP_DEPTH_KEYS:
            return f"mtp.{depth}.{MTP_DEPTH_KEYS[inner]}"
        within_layer = _in_depth_layer(inner)
        if within_layer:
            return f"mtp.{depth}.layers.0.{_within_layer(key, within_layer, expert_offset, latent)}"
    raise UnknownKey(key)


def _in_depth_layer(inner: str) -> str | None:
    """A depth's key ``inner`` (after ``mtp.layers.{k}.``) within its transformer layer, under either of
    the module's names; None for the depth's own tensors."""
    module = next((module for module in MTP_LAYER_MODULES if inner.startswith(module)), None)
    return None if module is None else inner[len(module):]


def ours_of_stacked(key: str, latent: bool = False) -> str:
    """Our name, with ``{}`` for the layer (and a second for the expert), of a torch_dist key whose
    first axis runs over the layers (and second over the experts)."""
    return "layers.{}." + _within_layer(key, key[len(STACKED_PREFIX):], 0, latent)


def _within_layer(key: str, inner: str, expert_offset: int, latent: bool) -> str:
    if latent and inner in LATENT_LAYER_KEYS:
        return LATENT_LAYER_KEYS[inner]
    if inner in LAYER_KEYS:
        return LAYER_KEYS[inner]
    local = _LOCAL_EXPERT.match(inner)
    if local and local.group(2) in EXPERT_KEYS:
        return f"mlp.experts.{int(local.group(1)) + expert_offset}.{EXPERT_KEYS[local.group(2)]}"
    if inner.startswith(STACKED_EXPERTS) and inner[len(STACKED_EXPERTS):] in EXPERT_KEYS:
        return "mlp.experts.{}." + EXPERT_KEYS[inner[len(STACKED_EXPERTS):]]
    raise UnknownKey(key)
