"""Each of our parameters as the Hugging Face hybrid families name them (``hf_hybrid`` maps their configs):
Nemotron-H and Mamba2 (one norm and one mixer per layer), Granite 4.0-H, Qwen3-Next, OLMo hybrid and Kimi
Linear (a mixer then a feed-forward part per layer: two of our layers each).

Mamba-2's fused in_proj rows and convolution channels are part-major there, group-major here
(``models.linear_mixing.layout``). Qwen3-Next's gated delta net keeps its q, k, v, z and b, a projections key
head by key head (our rows, joined per key head) and its convolution's channels part-major [q | k | v]; its
attention's q_proj holds each head's query then its output gate (ours: each group's queries, then their
gates); its norms are offsets from 1 (``--apply-layernorm-1p``) except the delta net's output norm. Kimi
Linear's delta attention keeps q, k, v, b and their three convolutions apart (ours: joined head by head)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from models.config import GPTConfig
from models.linear_mixing.layout import group_major, to_group_major, to_part_major
from models.mamba.layout import group_major_channels, group_major_rows
from pretrain.interop.hf_moe import GATE_UP_DOWN
from pretrain.interop.hf_names import (Rule, StackedRule, gated_mlp, latent_rules, moe_rules,
                                      nemotron_depth_blocks, norm_rule, qkv_from, qkv_to, same)


def _mamba_rules(config: GPTConfig, ours: str, theirs: str) -> Iterator[Rule]:
    """A Mamba-2 mixer: its fused in_proj rows and convolution channels part-major there, group-major here
    (``models.linear_mixing.layout``); the rest as they are."""
    inner, groups, state = config.mamba_inner, config.mamba_num_groups, config.mamba_state_dim
    for name, order in (("in_proj.weight", group_major_rows(inner, groups, state, config.mamba_heads)),
                        ("conv1d.weight", group_major_channels(inner, groups, state)),
                        ("conv1d.bias", group_major_channels(inner, groups, state))):
        yield Rule(f"{ours}.{name}", (f"{theirs}.{name}",), lambda t, order=order: to_group_major(t, order),
                   lambda x, order=order: (to_part_major(x, order),))
    for name in ("A_log", "D", "dt_bias", "norm.weight", "out_proj.weight"):
        yield same(f"{ours}.{name}", f"{theirs}.{name}")


def _attention_rules(config: GPTConfig, ours: str, theirs: str) -> Iterator[Rule]:
    """Separate q, k, v and o projections without biases (the hybrid families')."""
    yield Rule(f"{ours}.qkv.weight", tuple(f"{theirs}.{p}_proj.weight" for p in "qkv"),
               lambda q, k, v: qkv_from(config, q, k, v), lambda x: qkv_to(config, x))
    yield same(f"{ours}.proj.weight", f"{theirs}.o_proj.weight")


def _plain(ours: str, theirs: str, up: str, down: str) -> Iterator[Rule]:
    yield same(f"{ours}.fc1.weight", f"{theirs}.{up}.weight")
    yield same(f"{ours}.fc2.weight", f"{theirs}.{down}.weight")


NORM_OF = {"M": "mamba_norm", "G": "gdn_norm", "K": "kda_norm", "*": "attention_norm",
           "+": "attention_norm", "-": "mlp_norm", "E": "mlp_norm"}


def _nemotron_moe(config: GPTConfig, ours: str, theirs: str) -> Iterator[Rule]:
    yield same(f"{ours}.mlp.router.weight", f"{theirs}.gate.weight")
    for expert in range(config.num_experts):
        yield from _plain(f"{ours}.mlp.experts.{expert}", f"{theirs}.experts.{expert}", "up_proj",
                          "down_proj")
    yield from _plain(f"{ours}.mlp.shared_experts", f"{theirs}.shared_experts", "up_proj", "down_proj")


# each layer-registry symbol's tensors in Nemotron-H / Mamba2 (our layer, their mixer); a test holds the
# tables to the registry
NEMOTRON_LAYERS = {"M": lambda config, ours, theirs: _mamba_rules(config, f"{ours}.mamba", theirs),
                   "*": lambda config, ours, theirs: _attention_rules(config, f"{ours}.attention", theirs),
                   "-": lambda config, ours, theirs: _plain(f"{ours}.mlp", theirs, "up_proj", "down_proj"),
                   "E": _nemotron_moe}


def nemotron_rules(config: GPTConfig, kind: str, prefix: str = "backbone") -> Iterator[Rule]:
    """Nemotron-H (and, all its layers Mamba-2, Mamba2): one norm and one mixer per layer, as written to
    disk (``backbone.``, each expert apart); its output layer always a tensor of its own."""
    tied = not config.untie_embeddings_and_output_weights
    if tied and kind == "nemotron_h":  # Nemotron-H never ties: the embedding written twice
        yield Rule("word_embedding.weight", (f"{prefix}.embeddings.weight", "lm_head.weight"),
                   lambda embedding, head: embedding, lambda x: (x, x))
    else:
        yield same("word_embedding.weight", f"{prefix}.embeddings.weight")
    for i, symbol in enumerate(config.layer_types()):
        yield from _nemotron_block(config, symbol, f"layers.{i}", f"{prefix}.layers.{i}")
    yield same("final_norm.weight", f"{prefix}.norm_f.weight")
    if not tied:
        yield same("output_layer.weight", "lm_head.weight")
    yield from _nemotron_depth_rules(config)


def _nemotron_block(config: GPTConfig, symbol: str, ours: str, theirs: str) -> Iterator[Rule]:
    yield same(f"{ours}.{NORM_OF[symbol]}.weight", f"{theirs}.norm.weight")
    yield from NEMOTRON_LAYERS[symbol](config, ours, f"{theirs}.mixer")


def _nemotron_depth_rules(config: GPTConfig) -> Iterator[Rule]:
    """Nemotron-H's multi-token prediction: each step's blocks under ``mtp.layers`` (norm and mixer, as the
    model's), its first block holding enorm, hnorm and eh_proj, its last the final norm
    (``final_layernorm``)."""
    blocks = config.mtp_layer_types()
    for depth, block, theirs in nemotron_depth_blocks(config):
        ours = f"mtp.{depth}"
        if block == 0:
            for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
                yield same(f"{ours}.{name}", f"{theirs}.{name}")
        yield from _nemotron_block(config, blocks[block], f"{ours}.layers.{block}", theirs)
        if block == len(blocks) - 1:
            yield same(f"{ours}.final_norm.weight", f"{theirs}.final_layernorm.weight")


def _granite_gated(ours: str, theirs: str) -> Iterator[Rule]:
    """Granite's gated MLP: input_linear's rows the gate then the up part (our fc1 stacked [2, f, h])."""
    yield Rule(f"{ours}.fc1.weight", (f"{theirs}.input_linear.weight",), lambda w: torch.stack(w.chunk(2)),
               lambda x: (x.flatten(0, 1),))
    yield same(f"{ours}.fc2.weight", f"{theirs}.output_linear.weight")


# a Granite layer's mixer symbols (its feed-forward part: the shared MLP alone for -, beside experts for E)
GRANITE_MIXERS = {"M": lambda config, ours, theirs: _mamba_rules(config, f"{ours}.mamba", f"{theirs}.mamba"),
                  "*": lambda config, ours, theirs: _attention_rules(config, f"{ours}.attention",
                                                                     f"{theirs}.self_attn")}


def granite_rules(config: GPTConfig) -> Iterator[Rule | StackedRule]:
    """Granite 4.0-H: HF layer l is our layers 2l (its mixer, Mamba-2 or attention) and 2l + 1 (its
    feed-forward part: the shared MLP alone, or experts beside it), experts stacked as IBM writes them."""
    yield same("word_embedding.weight", "model.embed_tokens.weight")
    layers = config.layer_types()

    for hf_layer in range(len(layers) // 2):
        mixer, feed = 2 * hf_layer, 2 * hf_layer + 1
        theirs = f"model.layers.{hf_layer}"
        yield same(f"layers.{mixer}.{NORM_OF[layers[mixer]]}.weight", f"{theirs}.input_layernorm.weight")
        yield from GRANITE_MIXERS[layers[mixer]](config, f"layers.{mixer}", theirs)
        yield same(f"layers.{feed}.mlp_norm.weight", f"{theirs}.post_attention_layernorm.weight")
        if layers[feed] == "-":
            yield from _granite_gated(f"layers.{feed}.mlp", f"{theirs}.shared_mlp")
            continue
        moe = f"{theirs}.block_sparse_moe"
        yield same(f"layers.{feed}.mlp.router.weight", f"{moe}.router.layer.weight")
        each = [f"layers.{feed}.mlp.experts.{e}" for e in range(config.num_experts)]
        yield StackedRule(tuple(f"{e}.fc1.weight" for e in each), f"{moe}.input_linear.weight",
                          lambda t, e: torch.stack(t[e].chunk(2)),
                          lambda *xs: torch.stack([x.flatten(0, 1) for x in xs]))
        yield StackedRule(tuple(f"{e}.fc2.weight" for e in each), f"{moe}.output_linear.weight",
                          lambda t, e: t[e], lambda *xs: torch.stack(xs))
        yield from _granite_gated(f"layers.{feed}.mlp.shared_experts", f"{theirs}.shared_mlp")
    yield same("final_norm.weight", "model.norm.weight")
    if config.untie_embeddings_and_output_weights:
        yield same("output_layer.weight", "lm_head.weight")


def _gdn_rules(config: GPTConfig, ours: str, theirs: str) -> Iterator[Rule]:
    """Qwen3-Next's gated delta net: in_proj_qkvz and in_proj_ba, each [rows of one key head] x Hk, joined
    key head by key head into our in_proj; the convolution's channels [q | k | v] made group-major."""
    keys, key_dim = config.linear_num_key_heads, config.linear_key_head_dim
    width = 2 * key_dim + 2 * config.gdn_value_width // keys  # q, k, v, z of one key head

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grouped = x.unflatten(0, (keys, -1))
        return grouped[:, :width].flatten(0, 1), grouped[:, width:].flatten(0, 1)

    yield Rule(f"{ours}.in_proj.weight", (f"{theirs}.in_proj_qkvz.weight", f"{theirs}.in_proj_ba.weight"),
               lambda qkvz, ba: torch.cat([qkvz.unflatten(0, (keys, -1)), ba.unflatten(0, (keys, -1))],
                                          dim=1).flatten(0, 1), split)
    order = group_major([keys * key_dim, keys * key_dim, config.gdn_value_width], keys)
    yield Rule(f"{ours}.conv1d.weight", (f"{theirs}.conv1d.weight",), lambda t: to_group_major(t, order),
               lambda x: (to_part_major(x, order),))
    for name in ("A_log", "dt_bias", "out_proj.weight"):
        yield same(f"{ours}.{name}", f"{theirs}.{name}")
    yield norm_rule(config, f"{ours}.out_norm.weight", f"{theirs}.norm.weight", offsets=False)


def _gated_queries(config: GPTConfig, q_proj: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's q_proj, head by head [query, gate] -> each group's queries then their gates."""
    heads = q_proj.reshape(config.query_groups, -1, 2, config.head_dim, *q_proj.shape[1:])
    return heads.transpose(1, 2).reshape(-1, *q_proj.shape[1:])


def _per_head(config: GPTConfig, queries: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_gated_queries``."""
    grouped = queries.reshape(config.query_groups, 2, -1, config.head_dim, *queries.shape[1:])
    return grouped.transpose(1, 2).reshape(-1, *queries.shape[1:])


def _gated_attention_rules(config: GPTConfig, ours: str, theirs: str) -> Iterator[Rule]:
    """Qwen3-Next's attention: q_proj with the output gate, k, v, o and per-head q, k norms (offsets)."""
    def split(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = qkv_to(config, x)
        return _per_head(config, q), k, v

    yield Rule(f"{ours}.qkv.weight", tuple(f"{theirs}.{p}_proj.weight" for p in "qkv"),
               lambda q, k, v: qkv_from(config, _gated_queries(config, q), k, v), split)
    yield same(f"{ours}.proj.weight", f"{theirs}.o_proj.weight")
    for p in "qk":
        yield norm_rule(config, f"{ours}.{p}_norm.weight", f"{theirs}.{p}_norm.weight", offsets=True)


# a Qwen3-Next layer's mixer symbols (its feed-forward part: an MLP for -, experts and a gated shared one
# for E)
QWEN3_NEXT_MIXERS = {"G": lambda config, ours, theirs: _gdn_rules(config, f"{ours}.gdn",
                                                                  f"{theirs}.linear_attn"),
                     "*": lambda config, ours, theirs: _gated_attention_rules(config, f"{ours}.attention",
                                                                              f"{theirs}.self_attn")}


PRE_NORMS = ("input_layernorm", "post_attention_layernorm")  # a layer's norm before its mixer, its MLP


def _mixer_then_feed_rules(config: GPTConfig, kind: str, mixers: dict, offsets: bool,
                           norms: dict | None = None) -> Iterator[Rule | StackedRule]:
    """A family whose HF layer l is our layers 2l (its mixer, by ``mixers``) and 2l + 1 (its MLP or
    experts, ``kind``'s MoE names); ``offsets``: its norms stored as offsets from 1; ``norms``: the HF
    names of the mixer's and the MLP's norm by mixer symbol (default ``PRE_NORMS``)."""
    yield same("word_embedding.weight", "model.embed_tokens.weight")
    layers = config.layer_types()
    for hf_layer in range(len(layers) // 2):
        mixer, feed = 2 * hf_layer, 2 * hf_layer + 1
        yield from _paired_layer_rules(config, kind, mixers, offsets, norms, layers[mixer:feed + 1],
                                       (f"layers.{mixer}", f"layers.{feed}"), f"model.layers.{hf_layer}")
    yield norm_rule(config, "final_norm.weight", "model.norm.weight", offsets)
    if config.untie_embeddings_and_output_weights:
        yield same("output_layer.weight", "lm_head.weight")


def _paired_layer_rules(config: GPTConfig, kind: str, mixers: dict, offsets: bool, norms: dict | None,
                        symbols: list[str], ours: tuple[str, str], theirs: str
                        ) -> Iterator[Rule | StackedRule]:
    """One HF layer ``theirs`` of a mixer-then-feed family: our layers ``ours`` (its mixer and its MLP or
    experts, of layer-list ``symbols``)."""
    mixer_norm, feed_norm = (norms or {}).get(symbols[0], PRE_NORMS)
    yield norm_rule(config, f"{ours[0]}.{NORM_OF[symbols[0]]}.weight", f"{theirs}.{mixer_norm}.weight",
                    offsets)
    yield from mixers[symbols[0]](config, ours[0], theirs)
    yield norm_rule(config, f"{ours[1]}.mlp_norm.weight", f"{theirs}.{feed_norm}.weight", offsets)
    if symbols[1] == "-":
        yield from gated_mlp(f"{ours[1]}.mlp", f"{theirs}.mlp", GATE_UP_DOWN)
    else:
        yield from moe_rules(config, kind, ours[1], theirs)


def qwen3_next_rules(config: GPTConfig) -> Iterator[Rule | StackedRule]:
    """Qwen3-Next: HF layer l is our layers 2l (its mixer, a gated delta net or gated attention) and 2l + 1
    (its MLP or experts); every norm but the delta nets' output norms stored as an offset from 1. Its MTP
    layer (``mtp.``: ``fc`` our eh_proj, its ``pre_fc_norm_embedding`` / ``_hidden`` our enorm / hnorm,
    ``layers.0`` one HF layer, ``norm`` our final norm) is our one depth."""
    yield from _mixer_then_feed_rules(config, "qwen3_next", QWEN3_NEXT_MIXERS, offsets=True)
    if not config.mtp_depths:
        return
    for mine, hf_name in (("enorm", "pre_fc_norm_embedding"), ("hnorm", "pre_fc_norm_hidden"),
                          ("final_norm", "norm")):
        yield norm_rule(config, f"mtp.0.{mine}.weight", f"mtp.{hf_name}.weight", offsets=True)
    yield same("mtp.0.eh_proj.weight", "mtp.fc.weight")
    yield from _paired_layer_rules(config, "qwen3_next", QWEN3_NEXT_MIXERS, True, None,
                                   config.mtp_layer_types(), ("mtp.0.layers.0", "mtp.0.layers.1"),
                                   "mtp.layers.0")


def _olmo_gdn_rules(config: GPTConfig, ours: str, theirs: str) -> Iterator[Rule]:
    """OLMo hybrid's gated delta net: q, k, v, g (our z), b and a projections apart, part-major as
    megatron-core's fused rows are (``gdn_projection_parts``), made key-head-major; its three convolutions
    (q, k, v) likewise; its gated output norm ``o_norm``."""
    keys, parts = config.linear_num_key_heads, list(config.gdn_projection_parts.values())

    def joined(order: torch.Tensor):
        return lambda *t: to_group_major(torch.cat(t), order)

    def parted(order: torch.Tensor, widths: list[int]):
        return lambda x: to_part_major(x, order).split(widths)

    for name, hf_names, widths in (("in_proj", [f"{p}_proj" for p in "qkvgba"], parts),
                                   ("conv1d", [f"{p}_conv1d" for p in "qkv"], parts[:3])):
        order = group_major(widths, keys)
        yield Rule(f"{ours}.{name}.weight", tuple(f"{theirs}.{hf_name}.weight" for hf_name in hf_names),
                   joined(order), parted(order, widths))
    for mine, hf_name in (("A_log", "A_log"), ("dt_bias", "dt_bias"), ("out_proj.weight", "o_proj.weight")):
        yield same(f"{ours}.{mine}", f"{theirs}.{hf_name}")
    yield norm_rule(config, f"{ours}.out_norm.weight", f"{theirs}.o_norm.weight", offsets=False)


def _olmo_attention_rules(config: GPTConfig, ours: str, theirs: str) -> Iterator[Rule]:
    """OLMo hybrid's attention: separate q, k, v, o and OLMo 2's norms over the whole q and k projections."""
    yield from _attention_rules(config, f"{ours}.attention", f"{theirs}.self_attn")
    for p in "qk":
        yield norm_rule(config, f"{ours}.attention.{p}_norm.weight", f"{theirs}.self_attn.{p}_norm.weight",
                        offsets=False)


# an OLMo hybrid layer's mixer symbols, and the names its checkpoints give its norms (transformers renames
# them as it loads: attention_layer_norm is its input_layernorm, feedforward_layer_norm its
# post_attention_layernorm): the attention layers post-norm (after the attention, after the MLP), the
# delta nets' pre-norm
OLMO_MIXERS = {"G": lambda config, ours, theirs: _olmo_gdn_rules(config, f"{ours}.gdn",
                                                                 f"{theirs}.linear_attn"),
               "*": _olmo_attention_rules}
OLMO_NORMS = {"G": ("attention_layer_norm", "feedforward_layer_norm"),
              "*": ("feedforward_layer_norm", "post_feedforward_layernorm")}


def olmo_hybrid_rules(config: GPTConfig) -> Iterator[Rule | StackedRule]:
    """OLMo hybrid: HF layer l is our layers 2l (a gated delta net or attention) and 2l + 1 (its MLP)."""
    return _mixer_then_feed_rules(config, "olmo_hybrid", OLMO_MIXERS, offsets=False, norms=OLMO_NORMS)


def _kimi_delta_rules(config: GPTConfig, ours: str, theirs: str) -> Iterator[Rule]:
    """Kimi Linear's delta attention: q, k, v and b projections joined head by head into our in_proj, its
    three convolutions into our head-major one, the low-rank decay and gate projections, A_log [1, 1, H,
    1] as ours [H]."""
    heads = config.linear_num_value_heads

    def joined(*parts: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.unflatten(0, (heads, -1)) for part in parts], dim=1).flatten(0, 1)

    def parted(widths: list[int]):
        return lambda x: tuple(part.flatten(0, 1)
                               for part in x.unflatten(0, (heads, -1)).split(widths, dim=1))

    d = config.linear_value_head_dim
    yield Rule(f"{ours}.in_proj.weight", tuple(f"{theirs}.{p}_proj.weight" for p in "qkvb"), joined,
               parted([d, d, d, 1]))
    yield Rule(f"{ours}.conv1d.weight", tuple(f"{theirs}.{p}_conv1d.weight" for p in "qkv"), joined,
               parted([d, d, d]))
    for mine, hf_name in (("f_down", "f_a_proj"), ("f_up", "f_b_proj"), ("g_down", "g_a_proj"),
                          ("g_up", "g_b_proj"), ("out_proj", "o_proj")):
        yield same(f"{ours}.{mine}.weight", f"{theirs}.{hf_name}.weight")
    yield Rule(f"{ours}.A_log", (f"{theirs}.A_log",), lambda t: t.reshape(-1),
               lambda x: (x.reshape(1, 1, -1, 1),))
    yield same(f"{ours}.dt_bias", f"{theirs}.dt_bias")
    yield same(f"{ours}.out_norm.weight", f"{theirs}.o_norm.weight")


def _kimi_latent_rules(config: GPTConfig, ours: str, theirs: str) -> Iterator[Rule]:
    """Kimi Linear's latent attention: DeepSeek-V3's names (``theirs`` is its layer)."""
    yield from latent_rules(config, ours, theirs)
    yield same(f"{ours}.attention.proj.weight", f"{theirs}.self_attn.o_proj.weight")


# a Kimi Linear layer's mixer symbols (its feed-forward part: an MLP for -, experts for E)
KIMI_MIXERS = {"K": lambda config, ours, theirs: _kimi_delta_rules(config, f"{ours}.kda",
                                                                  f"{theirs}.self_attn"),
               "+": _kimi_latent_rules}


def kimi_linear_rules(config: GPTConfig) -> Iterator[Rule | StackedRule]:
    """Kimi Linear: HF layer l is our layers 2l (its mixer, Kimi delta attention or latent attention) and
    2l + 1 (its MLP, ``mlp``, or experts, ``block_sparse_moe``, as Moonshot's checkpoints name them;
    ``kimi_stored_name`` reads transformers' own saves, which put the MLP under ``block_sparse_moe``); plain
    norm weights."""
    return _mixer_then_feed_rules(config, "kimi_linear", KIMI_MIXERS, offsets=False)


_KIMI_DENSE = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.weight")


def kimi_stored_name(name: str) -> str:
    """A Kimi Linear tensor's name as ``kimi_linear_rules`` has it: transformers saves a dense layer's MLP
    under ``block_sparse_moe`` (its load-time renaming reversed), Moonshot's checkpoints under ``mlp``."""
    return _KIMI_DENSE.sub(r"\1.mlp.\2.weight", name)
