"""Each of our parameters as Hugging Face names it, for GPT-2 and the decoder families ``hf_config`` maps,
both ways (the hybrid families': ``hf_hybrid_names``; the dispatch: ``hf_tensor_plan``).

One table of ``Rule``s per model: our tensor, the Hugging Face tensors it is made of, how to join them
into ours (import) and split ours back into them (export), so that the two directions cannot disagree.
Our fused QKV holds, group by group, that group's query heads, then its key and its value head (see
``models.attention``); Hugging Face keeps q, k and v apart (Llama-like), as q | k | v rows of one
``qkv_proj`` (Phi-3) or q | k | v columns of one Conv1D (GPT-2, whose weights are [in, out]). Gated MLPs'
gate and up are our ``fc1`` stacked [2, f, h] (Phi-3's ``gate_up_proj`` is them as rows). The norms
are named by where they sit (``--norm-placement``), the same in every family; Gemma stores norm
weights as offsets from 1, like ``--apply-layernorm-1p``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from models.config import GPTConfig
from pretrain.interop.hf_config import hf_kind
from pretrain.interop.hf_moe import GATE_UP_DOWN, MOE_FAMILIES

PRE, POST = ("attention_norm", "input_layernorm"), ("attention_post_norm", "post_attention_layernorm")
FFN_PRE, FFN_POST = ("mlp_norm", "pre_feedforward_layernorm"), ("mlp_post_norm", "post_feedforward_layernorm")
NORMS = {"pre": (PRE, ("mlp_norm", "post_attention_layernorm")), "sandwich": (PRE, POST, FFN_PRE, FFN_POST),
         "post": (POST, FFN_POST)}


@dataclass(frozen=True)
class Rule:
    """Our tensor ``ours`` is ``join(*theirs)``; ``split(ours)`` gives ``theirs`` back, in order.
    ``copy``: ``theirs`` is a copy the family keeps of a tensor another rule reads (written, never read)."""

    ours: str
    theirs: tuple[str, ...]
    join: Callable[..., torch.Tensor]
    split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    copy: bool = False


@dataclass(frozen=True)
class StackedRule:
    """Expert e's tensor ``ours[e]`` is ``take(theirs, e)`` of one Hugging Face tensor holding the layer's
    experts stacked (gpt-oss); ``stack(*ours)`` gives it back."""

    ours: tuple[str, ...]
    theirs: str
    take: Callable[[torch.Tensor, int], torch.Tensor]
    stack: Callable[..., torch.Tensor]


def same(ours: str, theirs: str) -> Rule:
    return Rule(ours, (theirs,), lambda x: x, lambda x: (x,))


def _transposed(ours: str, theirs: str) -> Rule:  # GPT-2's Conv1D keeps [in, out]
    return Rule(ours, (theirs,), lambda x: x.t(), lambda x: (x.t(),))


def qkv_from(config: GPTConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [a d, ...], k, v [G d, ...] -> ours [(a + 2G) d, ...], group by group."""
    groups, d = config.query_groups, config.head_dim
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
                     dim=1).reshape(-1, *rest)


def qkv_to(config: GPTConfig, ours: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = config.query_groups, config.head_dim
    rest = ours.shape[1:]
    grouped = ours.reshape(groups, -1, *rest)
    queries = grouped.shape[1] - 2 * d
    return (grouped[:, :queries].reshape(-1, *rest), grouped[:, queries:queries + d].reshape(-1, *rest),
            grouped[:, queries + d:].reshape(-1, *rest))


def _qkv_rows(config: GPTConfig, fused: torch.Tensor) -> torch.Tensor:
    """A q | k | v row-stacked projection (Phi-3) -> ours."""
    q_rows, kv_rows = config.num_attention_heads * config.head_dim, config.query_groups * config.head_dim
    return qkv_from(config, *fused.split([q_rows, kv_rows, kv_rows]))


def norm_rule(config: GPTConfig, ours: str, theirs: str, offsets: bool) -> Rule:
    """A norm weight; ``offsets``: the family stores it as an offset from 1 (Gemma)."""
    shift = (1.0 if config.apply_layernorm_1p else 0.0) - (1.0 if offsets else 0.0)  # theirs = ours + shift
    if shift == 0:
        return same(ours, theirs)
    return Rule(ours, (theirs,), lambda x: x - shift, lambda x: (x + shift,))


def gpt2_rules(config: GPTConfig) -> Iterator[Rule]:
    def joined_qkv(weight):  # [h, 3h] (q | k | v columns) or a bias [3h]
        return qkv_from(config, *(weight.t() if weight.dim() == 2 else weight).chunk(3, dim=0))

    def split_qkv(ours):
        joined = torch.cat(qkv_to(config, ours), dim=0)
        return (joined.t() if joined.dim() == 2 else joined,)

    yield same("word_embedding.weight", "transformer.wte.weight")
    yield same("position_embedding.weight", "transformer.wpe.weight")
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        for kind in ("weight", "bias"):
            linear = _transposed if kind == "weight" else same
            norm = ((lambda mine, hf_name: norm_rule(config, mine, hf_name, False)) if kind == "weight"
                    else same)
            yield norm(f"{ours}.attention_norm.{kind}", f"{theirs}.ln_1.{kind}")
            yield Rule(f"{ours}.attention.qkv.{kind}", (f"{theirs}.attn.c_attn.{kind}",), joined_qkv,
                       split_qkv)
            yield linear(f"{ours}.attention.proj.{kind}", f"{theirs}.attn.c_proj.{kind}")
            yield norm(f"{ours}.mlp_norm.{kind}", f"{theirs}.ln_2.{kind}")
            yield linear(f"{ours}.mlp.fc1.{kind}", f"{theirs}.mlp.c_fc.{kind}")
            yield linear(f"{ours}.mlp.fc2.{kind}", f"{theirs}.mlp.c_proj.{kind}")
    yield norm_rule(config, "final_norm.weight", "transformer.ln_f.weight", False)
    yield same("final_norm.bias", "transformer.ln_f.bias")
    if config.untie_embeddings_and_output_weights:
        yield same("output_layer.weight", "lm_head.weight")


def gated_mlp(ours: str, theirs: str, names: tuple[str, str, str]) -> Iterator[Rule]:
    """A gated MLP: our fc1 [2, f, h] is their gate and up stacked, our fc2 their down."""
    gate, up, down = names
    yield Rule(f"{ours}.fc1.weight", (f"{theirs}.{gate}.weight", f"{theirs}.{up}.weight"),
               lambda g, u: torch.stack([g, u]), lambda x: (x[0], x[1]))
    yield same(f"{ours}.fc2.weight", f"{theirs}.{down}.weight")


def moe_rules(config: GPTConfig, kind: str, ours: str, theirs: str) -> Iterator[Rule]:
    """A MoE layer: the router, every expert (ours by its index in the layer), Qwen2-MoE's shared expert
    and its gate (``hf_moe.MOE_FAMILIES`` says where the family keeps them)."""
    family = MOE_FAMILIES[kind]
    block = f"{theirs}.{family.prefix}"
    yield same(f"{ours}.mlp.router.weight", f"{block}.{family.router}.weight")
    if not config.disable_bias_linear:
        yield same(f"{ours}.mlp.router.bias", f"{block}.{family.router}.bias")
    if family.stacked:
        yield from _stacked_experts(config, f"{ours}.mlp.experts", f"{block}.experts")
    else:
        for expert in range(config.num_experts):
            yield from gated_mlp(f"{ours}.mlp.experts.{expert}", f"{block}.experts.{expert}",
                                 family.projections)
    if config.moe_shared_expert_intermediate_size:
        yield from gated_mlp(f"{ours}.mlp.shared_experts", f"{block}.{family.shared}", GATE_UP_DOWN)
    if config.moe_shared_expert_gate:
        yield same(f"{ours}.mlp.shared_gate.weight", f"{block}.shared_expert_gate.weight")


def _interleaved(parts: torch.Tensor) -> torch.Tensor:
    """Our gate and up [2, f, ...] as gpt-oss's columns [..., 2f], gate and up alternating."""
    return torch.stack([parts[0], parts[1]], dim=1).flatten(0, 1).movedim(0, -1)


def _stacked_experts(config: GPTConfig, ours: str, theirs: str) -> Iterator[StackedRule]:
    """gpt-oss's experts: gate_up_proj [E, h, 2f] (gate and up columns alternating) and its bias [E, 2f],
    down_proj [E, f, h] and its bias [E, h], cut into each expert's fc1 [2, f, h] / [2, f] and fc2
    [h, f] / [h]."""
    def each(part: str) -> tuple[str, ...]:
        return tuple(f"{ours}.{e}.{part}" for e in range(config.num_experts))

    yield StackedRule(each("fc1.weight"), f"{theirs}.gate_up_proj",
                      lambda t, e: torch.stack([t[e][:, 0::2].t(), t[e][:, 1::2].t()]),
                      lambda *xs: torch.stack([_interleaved(x) for x in xs]))
    yield StackedRule(each("fc1.bias"), f"{theirs}.gate_up_proj_bias",
                      lambda t, e: torch.stack([t[e][0::2], t[e][1::2]]),
                      lambda *xs: torch.stack([_interleaved(x) for x in xs]))
    yield StackedRule(each("fc2.weight"), f"{theirs}.down_proj", lambda t, e: t[e].t(),
                      lambda *xs: torch.stack([x.t() for x in xs]))
    yield StackedRule(each("fc2.bias"), f"{theirs}.down_proj_bias", lambda t, e: t[e],
                      lambda *xs: torch.stack(xs))


LATENT = {"q_proj": "q_proj", "q_down": "q_a_proj", "q_latent_norm": "q_a_layernorm", "q_up": "q_b_proj",
          "kv_down": "kv_a_proj_with_mqa", "kv_latent_norm": "kv_a_layernorm", "kv_up": "kv_b_proj"}


def latent_rules(config: GPTConfig, ours: str, theirs: str) -> Iterator[Rule]:
    """Latent attention's projections and norms (DeepSeek-V3's names; the same layouts: each head's rows
    [qk | rope] and [qk | v], the key/value latent then the shared rotary key)."""
    parts = ("q_proj",) if config.q_lora_rank is None else ("q_down", "q_latent_norm", "q_up")
    for part in (*parts, "kv_down", "kv_latent_norm", "kv_up"):
        yield same(f"{ours}.attention.{part}.weight", f"{theirs}.self_attn.{LATENT[part]}.weight")


def nemotron_depth_blocks(config: GPTConfig) -> Iterator[tuple[int, int, str]]:
    """(depth, its block, Nemotron-H's name of it) of each prediction depth's block: the steps' blocks
    numbered in one run under ``mtp.layers`` (vLLM's NemotronH MTP), depth by depth."""
    blocks = config.mtp_layer_types()
    for depth in range(config.mtp_depths):
        for block in range(len(blocks)):
            yield depth, block, f"mtp.layers.{depth * len(blocks) + block}"


def expert_bias_names(config: GPTConfig, kind: str | None = None) -> dict[int, str]:
    """Layer -> the Hugging Face tensor holding its expert biases (DeepSeek-V3's score-correction bias),
    for the MoE layers of a model with --moe-router-enable-expert-bias; our side keeps them as the
    checkpoint's expert-bias table (a run state), not as parameters."""
    kind = kind or hf_kind(config)
    if kind == "nemotron_h" and config.moe_router_enable_expert_bias:  # (its MTP blocks' numbered past)
        blocks = [f"backbone.layers.{i}" for i in range(config.num_layers)] + [
            theirs for _, _, theirs in nemotron_depth_blocks(config)]
        return {i: f"{block}.mixer.gate.e_score_correction_bias"
                for i, (block, moe) in enumerate(zip(blocks, config.moe_layers_with_depths())) if moe}
    if kind not in MOE_FAMILIES or not config.moe_router_enable_expert_bias:
        return {}
    family = MOE_FAMILIES[kind]
    paired = 2 if kind == "kimi_linear" else 1  # (a Kimi Linear layer is two of ours: mixer, then MoE)
    return {i: f"model.layers.{i // paired}.{family.prefix}.{family.router}.e_score_correction_bias"
            for i, moe in enumerate(config.moe_layers_with_depths()) if moe}  # (DeepSeek's MTP layers' too)


def decoder_rules(config: GPTConfig, kind: str) -> Iterator[Rule]:
    offsets = kind.startswith("gemma")
    moe = config.moe_layers_with_depths()
    yield same("word_embedding.weight", "model.embed_tokens.weight")
    for i in range(config.num_layers):
        yield from _decoder_layer_rules(config, kind, f"layers.{i}", f"model.layers.{i}", moe[i])
    for depth in range(config.mtp_depths):  # DeepSeek-V3's MTP layers: numbered past the model's there too
        ours, theirs = f"mtp.{depth}", f"model.layers.{config.num_layers + depth}"
        for mine, hf_name in (("enorm", "enorm"), ("hnorm", "hnorm"), ("final_norm", "shared_head.norm")):
            yield norm_rule(config, f"{ours}.{mine}.weight", f"{theirs}.{hf_name}.weight", offsets)
        yield same(f"{ours}.eh_proj.weight", f"{theirs}.eh_proj.weight")
        # (DeepSeek's release keeps the embedding and the head in each MTP layer too; vLLM reads them there)
        yield replace(same("word_embedding.weight", f"{theirs}.embed_tokens.weight"), copy=True)
        head = ("output_layer.weight" if config.untie_embeddings_and_output_weights
                else "word_embedding.weight")
        yield replace(same(head, f"{theirs}.shared_head.head.weight"), copy=True)
        yield from _decoder_layer_rules(config, kind, f"{ours}.layers.0", theirs,
                                        moe[config.num_layers + depth])
    yield norm_rule(config, "final_norm.weight", "model.norm.weight", offsets)
    if config.untie_embeddings_and_output_weights:
        yield same("output_layer.weight", "lm_head.weight")


def _decoder_layer_rules(config: GPTConfig, kind: str, ours: str, theirs: str, moe: bool) -> Iterator[Rule]:
    """One decoder layer's tensors (our block ``ours``, their layer ``theirs``)."""
    offsets, fused = kind.startswith("gemma"), kind == "phi3"
    for mine, hf_name in NORMS[config.norm_placement]:
        yield norm_rule(config, f"{ours}.{mine}.weight", f"{theirs}.{hf_name}.weight", offsets)
    attention = f"{theirs}.self_attn"
    if config.multi_latent_attention:
        yield from latent_rules(config, ours, theirs)
    elif fused:
        yield Rule(f"{ours}.attention.qkv.weight", (f"{attention}.qkv_proj.weight",),
                   lambda w: _qkv_rows(config, w), lambda x: (torch.cat(qkv_to(config, x)),))
    for part in ("weight", "bias") if not fused and not config.multi_latent_attention else ():
        if part == "weight" or config.add_qkv_bias or not config.disable_bias_linear:
            yield Rule(f"{ours}.attention.qkv.{part}",
                       tuple(f"{attention}.{p}_proj.{part}" for p in "qkv"),
                       lambda q, k, v: qkv_from(config, q, k, v), lambda x: qkv_to(config, x))
    if config.qk_layernorm:
        for p in "qk":
            yield norm_rule(config, f"{ours}.attention.{p}_norm.weight", f"{attention}.{p}_norm.weight",
                        offsets)
    yield same(f"{ours}.attention.proj.weight", f"{attention}.o_proj.weight")
    if not config.disable_bias_linear:
        yield same(f"{ours}.attention.proj.bias", f"{attention}.o_proj.bias")
    if config.softmax_type == "learnable":
        yield same(f"{ours}.attention.sinks", f"{attention}.sinks")
    if moe:
        yield from moe_rules(config, kind, ours, theirs)
    elif fused:
        yield Rule(f"{ours}.mlp.fc1.weight", (f"{theirs}.mlp.gate_up_proj.weight",),
                   lambda w: torch.stack(w.chunk(2)), lambda x: (x.flatten(0, 1),))
        yield same(f"{ours}.mlp.fc2.weight", f"{theirs}.mlp.down_proj.weight")
    else:
        yield from gated_mlp(f"{ours}.mlp", f"{theirs}.mlp", GATE_UP_DOWN)
