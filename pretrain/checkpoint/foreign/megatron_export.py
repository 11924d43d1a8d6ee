"""A model of ours written as a Megatron-LM checkpoint that Megatron-LM's own loader resumes: its legacy
rank files (``--ckpt-format torch``) at a chosen tp x pp, or megatron-core's ``torch_dist`` (global
tensors, layers stacked on a first axis; megatron-core re-cuts it to any layout as it loads).

The args are the inverse of the import's (``megatron_args.args_of``), the keys megatron-core's
(``megatron_names.megatron_key``: the local spec's norm names in legacy files, the fused ones in
torch_dist), the vocabulary tables padded as Megatron pads them (to --make-vocab-size-divisible-by x tp),
and the run's iteration, data position and learning-rate schedule go with them. Each of our tensors is
rebuilt whole once from the source's pieces; the files are written in a staging folder and renamed into
place with the tracker last, so a failed export leaves no checkpoint behind. Adam's states go with them
on request, as the distributed optimizer's ``distrib_optim.pt`` beside each legacy rank file (its
parameters in the order megatron-core's local spec registers them, laid out in one bucket: Megatron
resumes it whole, at any dp, without --overlap-grad-reduce); without them Megatron resumes with
--no-load-optim.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil

import torch

from models.config import GPTConfig
from pretrain.checkpoint.dcp_storage import save_in_one_process
from pretrain.checkpoint.foreign.megatron_args import MegatronLayout, args_of
from pretrain.checkpoint.errors import CheckpointError
from pretrain.checkpoint.foreign.megatron_checkpoint import (TRACKER, is_megatron, iteration_folder,
                                                             legacy_file, tracked_iteration)
from pretrain.checkpoint.foreign.megatron_parts import PARTS, split_parts, to_megatron
from pretrain.checkpoint.foreign.megatron_names import (EXPERT_EXTRA_STATE_MODULES, LEGACY_EXPERTS,
                                                        MTP_EXTRA_STATE_MODULES, ROW_SPLIT_DOWN,
                                                        STACKED_EXPERTS, extra_state_modules, megatron_key,
                                                        mtp_layer_prefix, registration_order)
from pretrain.checkpoint.foreign.megatron_optimizer import (DISTRIBUTED_OPTIMIZER_FILE,
                                                            distributed_state_dict, gathered_states)
from pretrain.checkpoint.foreign.megatron_pieces import our_slices
from pretrain.checkpoint.foreign.megatron_tokenizer import copy_tokenizer

CHECKPOINT_VERSION = 3.0
FORMATS = ("torch", "torch_dist")


def padded_vocabulary(config: GPTConfig, tp: int) -> int:
    """Megatron's padded vocabulary: rounded up to --make-vocab-size-divisible-by x tp."""
    multiple = config.make_vocab_size_divisible_by * tp
    return -(-config.vocab_size // multiple) * multiple


def _common(config: GPTConfig, layout: MegatronLayout, padded: int, manifest: dict) -> dict:
    progress = manifest.get("states", {}).get("progress") or {
        "iteration": manifest["iteration"], "consumed_samples": manifest.get("consumed_samples", 0)}
    saved = manifest.get("config", {})
    run = {name: saved[name] for name in ("global_batch_size", "micro_batch_size", "seq_length")
           if name in saved}
    run["consumed_train_samples"] = int(progress["consumed_samples"])
    run["data_parallel_size"] = int((manifest.get("layout") or {}).get("dp") or 1)  # the run's (any resumes)
    common = {"args": args_of(config, layout, padded, run), "checkpoint_version": CHECKPOINT_VERSION,
              "iteration": int(progress["iteration"]), "num_floating_point_operations_so_far": 0}
    scheduler = manifest.get("states", {}).get("opt_param_scheduler")
    if scheduler:  # Megatron's OptimizerParamScheduler.state_dict(): its position in samples with it
        state = {key: value for key, value in scheduler.items()
                 if not key.startswith("decoupled_") and key != "init_lr"}
        state["num_steps"] = int(scheduler.get("num_steps", progress["consumed_samples"]))
        train = saved.get("train_iters", 0) * saved.get("global_batch_size", 0)
        state.setdefault("wd_incr_steps", train or state.get("lr_decay_steps", 0))
        common["opt_param_scheduler"] = state
    return common


def _padded(whole: torch.Tensor, table: bool, padded: int) -> torch.Tensor:
    """A vocabulary table padded with zero rows to Megatron's padded vocabulary."""
    if table and whole.shape[0] < padded:
        return torch.cat([whole, whole.new_zeros(padded - whole.shape[0], *whole.shape[1:])])
    return whole


def _as_megatron(part: torch.Tensor, name: str) -> torch.Tensor:
    """One of our tensors ``name`` (or tp slices) as Megatron keeps it: a gated fc1's [2, f, h] as [2f, h]
    (the gate's rows, then the up matrix's)."""
    return part.reshape(-1, part.shape[-1]) if part.ndim == 3 and name.endswith("fc1.weight") else part


def write_megatron(source, config: GPTConfig, manifest: dict, directory: str, ckpt_format: str,
                   tp: int = 1, pp: int = 1, ep: int = 1, with_optimizer: bool = False,
                   tokenizer=None) -> str:
    """Write ``source``'s model (a ``reshard.PieceSource``) under ``directory`` as Megatron-LM's
    ``ckpt_format`` ("torch": rank files at ``tp`` x ``pp`` x ``ep``, the experts' tp their tp;
    "torch_dist"); ``with_optimizer``: Adam's states too, as the distributed optimizer's
    ``distrib_optim.pt`` beside each rank file; ``tokenizer`` (a ``TokenizerSpec``, or None): its files
    copied into the iteration folder and named in the args. Returns the iteration folder."""
    if ckpt_format not in FORMATS:
        raise ValueError(f"--ckpt-format {ckpt_format!r} is not one of {', '.join(FORMATS)}")
    unbuilt = [flag for flag, used in (("--post-norm-layers", config.post_norm_layers),
                                       ("--linear-allow-neg-eigval", config.linear_allow_neg_eigval),
                                       ("--linear-output-norm-epsilon",
                                        config.gdn_output_norm_epsilon != config.layernorm_epsilon),
                                       ("--latent-norm-epsilon", config.latent_norm_epsilon
                                        not in (None, config.layernorm_epsilon))) if used]
    if config.mtp_depths and config.hybrid_layer_pattern:
        raise ValueError(f"--to megatron: a hybrid's multi-token prediction depths ({config.uncut_pattern!r} "
                         "after /) are not written yet (no megatron-core release builds them to check "
                         "against); convert with --to consolidated")
    if unbuilt:  # (OLMo hybrid's parts; transformers' latent norms)
        raise ValueError(f"--to megatron: this model has {', '.join(unbuilt)}, which megatron-core builds no "
                         "layer with; convert with --to hf or --to consolidated")
    if "K" in config.layer_types():
        raise ValueError("--to megatron: Megatron-LM has no Kimi delta attention layer (K); convert with "
                         "--to consolidated")
    if with_optimizer:
        _check_optimizer_export(source, config, manifest, ckpt_format)
    if config.multi_latent_attention and config.position_embedding != "rope":
        raise ValueError("--to megatron: megatron-core's latent attention always rotates its rotary dims; "
                         "this model's latent attention has no positions (NoPE): convert with --to "
                         "consolidated")
    if config.multi_latent_attention and (not config.rotary_interleaved
                                          or config.rope_scaling not in ("none", "yarn")):
        raise ValueError("--to megatron: latent attention is written with rotary positions taken apart as "
                         "Megatron takes them (--rotary-interleaved), plain or yarn-scaled; this model's "
                         "are not")
    if config.num_layers % pp:
        raise ValueError(f"--target-pipeline-parallel-size {pp} does not divide the model's "
                         f"{config.num_layers} layers")
    if (config.num_experts or 1) % ep:
        raise ValueError(f"--target-expert-parallel-size {ep} does not divide the model's "
                         f"{config.num_experts or 0} experts")
    if ckpt_format == "torch_dist" and config.hybrid_layer_pattern and config.multi_latent_attention:
        raise ValueError("--to megatron --ckpt-format torch_dist: a hybrid with latent attention (+) is not "
                         "written yet (its norms' fused names are not settled); write --ckpt-format torch")
    moe = config.moe_layers(config.num_layers)
    if ckpt_format == "torch_dist" and any(moe) and not all(moe) and not config.hybrid_layer_pattern:
        raise ValueError("--to megatron --ckpt-format torch_dist: a model with dense and MoE layers is not "
                         "written yet (megatron-core keys such layers one by one); write --ckpt-format torch")
    layout = MegatronLayout(tp, pp, 1, ep, tp, config.num_layers)
    padded = padded_vocabulary(config, tp)
    common = _common(config, layout, padded, manifest)
    if with_optimizer:  # (one bucket: Megatron resumes it without --overlap-grad-reduce, at any dp)
        common["args"].use_distributed_optimizer = True
        common["optimizer"] = distributed_state_dict(manifest["config"], _adam_step(source))
    final = os.path.join(directory, iteration_folder(common["iteration"]))
    if os.path.exists(final):
        raise ValueError(f"{final} exists: an export never replaces a checkpoint; give a new --output")
    staging = final + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    slices = our_slices(config, tp)
    tied = not config.untie_embeddings_and_output_weights
    try:
        if tokenizer is not None:
            vars(common["args"]).update(copy_tokenizer(tokenizer, staging))
        if ckpt_format == "torch":
            _write_legacy(source, config, layout, slices, padded, common, staging, tied, with_optimizer)
        else:
            write = _write_hybrid_distributed if config.hybrid_layer_pattern else _write_distributed
            write(source, config, slices, padded, common, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    os.replace(staging, final)
    if _tracker_behind(directory, common["iteration"]):  # the tracker never moves back
        with open(os.path.join(directory, TRACKER + ".part"), "w") as handle:
            handle.write(str(common["iteration"]))
        os.replace(os.path.join(directory, TRACKER + ".part"), os.path.join(directory, TRACKER))
    return final


def _tracker_behind(directory: str, iteration: int) -> bool:
    """Whether ``directory``'s tracker may move on to ``iteration``: there is none, or it names an earlier
    one ("release" or unreadable text is never passed)."""
    if not is_megatron(directory):
        return True
    try:
        tracked = tracked_iteration(directory)
    except CheckpointError:
        return False
    return tracked is not None and tracked < iteration


def _check_optimizer_export(source, config: GPTConfig, manifest: dict, ckpt_format: str) -> None:
    if ckpt_format != "torch":
        raise ValueError("--to megatron --with-optimizer-states: written as the legacy files' "
                         "distrib_optim.pt (--ckpt-format torch); torch_dist's are not written yet")
    if config.num_experts or config.hybrid_layer_pattern or config.mtp_depths:
        what = ("a mixture of experts' (a buffer of their own)" if config.num_experts else
                "a HybridModel's" if config.hybrid_layer_pattern else "multi-token prediction depths'")
        raise ValueError(f"--to megatron --with-optimizer-states: {what} optimizer states are not written "
                         "yet")
    if "exp_avg" not in source.kinds or manifest.get("config", {}).get("optimizer", "adam") != "adam":
        raise ValueError("--to megatron --with-optimizer-states: the checkpoint holds no Adam states (a "
                         "weights-only one, or another optimizer's)")


def _adam_step(source) -> float:
    """Adam's step count (the same for every parameter of ours)."""
    return float(source.scalars("final_norm.weight").get("step", 0.0))


def _write_legacy(source, config, layout, slices, padded, common, folder, tied, with_optimizer) -> None:
    """One file per tp x pp x ep rank: an expert in its expert rank's files (numbered within them), the
    rest in every expert rank's; with ``with_optimizer``, each one's ``distrib_optim.pt`` beside it."""
    per_stage = config.num_layers // layout.pp
    per_rank = (config.num_experts or 1) // layout.ep
    moe, entries = config.moe_layers(config.num_layers), config.layer_types()
    hybrid = bool(config.hybrid_layer_pattern)
    models = {rank: {} for rank in itertools.product(range(layout.tp), range(layout.pp), range(layout.ep))}
    states: dict[tuple, dict[str, dict]] = {rank: {} for rank in models}
    for name in sorted(slices):
        _, dim, table = slices[name]
        key, layer, expert = megatron_key(name, fused_norms=False, latent=config.multi_latent_attention,
                                          hybrid=hybrid)
        inner, tensor = key, _padded(source.whole(name), table, padded)
        if key.endswith(ROW_SPLIT_DOWN):  # (the local spec's latent down projections: split by rows)
            dim = 0
        ranks = range(layout.ep)
        if layer is None and expert is not None:  # a prediction depth's expert (the depths: the last stage)
            stages, ranks = [layout.pp - 1], [expert // per_rank]
            key = f"{mtp_layer_prefix(name)}{LEGACY_EXPERTS}{expert % per_rank}.{key}"
        elif layer is None:  # (the depths' stage keeps a copy of the embedding, as Megatron's)
            stages = (sorted({0, layout.pp - 1 if config.mtp_depths else 0}) if key.startswith("embedding.")
                      else [layout.pp - 1])
        elif expert is None:
            stages, key = [layer // per_stage], f"decoder.layers.{layer % per_stage}.{key}"
        else:
            stages, ranks = [layer // per_stage], [expert // per_rank]
            key = f"decoder.layers.{layer % per_stage}.{LEGACY_EXPERTS}{expert % per_rank}.{key}"
        parts = _tp_parts(tensor, name, dim, layout.tp)
        parts = [to_megatron(inner, part, config, layout.tp) for part in parts]  # (a mixer rank's rows)
        moments = {kind: _tp_parts(_padded(source.whole(name, kind), table, padded), name, dim, layout.tp)
                   for kind in ("exp_avg", "exp_avg_sq")} if with_optimizer else {}
        for stage, t, e in itertools.product(stages, range(layout.tp), ranks):
            models[t, stage, e][key] = parts[t].clone()
            if with_optimizer:
                states[t, stage, e][key] = {"master": parts[t], **{kind: values[t]
                                                                   for kind, values in moments.items()}}
    for (t, p, e), model in models.items():
        if tied and p == layout.pp - 1 and layout.pp > 1:  # the last stage's copy of the tied embedding
            model["output_layer.weight"] = models[t, 0, e]["embedding.word_embeddings.weight"].clone()
            if with_optimizer:
                states[t, p, e]["output_layer.weight"] = states[t, 0, e]["embedding.word_embeddings.weight"]
        for layer in range(per_stage):
            prefix = f"decoder.layers.{layer}."
            model.update({f"{prefix}{module}._extra_state": None for module in _extra_state_modules(
                config, entries[p * per_stage + layer])})
            if moe[p * per_stage + layer]:
                model.update({f"{prefix}{LEGACY_EXPERTS}{local}.{module}._extra_state": None
                              for local in range(per_rank) for module in EXPERT_EXTRA_STATE_MODULES})
        if p == layout.pp - 1:
            model["output_layer._extra_state"] = None
            modules, expert_layers = _mtp_extra_state_modules(config)
            model.update({f"{module}._extra_state": None for module in modules})
            model.update({f"{layer}{LEGACY_EXPERTS}{local}.{module}._extra_state": None
                          for layer in expert_layers for local in range(per_rank)
                          for module in EXPERT_EXTRA_STATE_MODULES})
        path = legacy_file(folder, layout, t, p, e)
        os.makedirs(os.path.dirname(path))
        model = dict(sorted(model.items(), key=lambda item: registration_order(item[0])))  # as Megatron's
        torch.save({**common, "model": model}, path)
        if with_optimizer:
            shared = tied and layout.pp > 1
            ordered = [(key, states[t, p, e][key], shared and key in ("embedding.word_embeddings.weight",
                                                                     "output_layer.weight"))
                       for key in sorted(states[t, p, e], key=registration_order)]
            torch.save(gathered_states(ordered, common["args"], p),
                       os.path.join(os.path.dirname(path), DISTRIBUTED_OPTIMIZER_FILE))


def _tp_parts(tensor: torch.Tensor, name: str, dim: int | None, tp: int) -> list[torch.Tensor]:
    """Our ``tensor`` ``name``'s tp slices as Megatron keeps them (the whole on each rank where it is
    replicated)."""
    if dim is None:
        return [tensor] * tp
    return [_as_megatron(part, name) for part in tensor.chunk(tp, dim=dim)]


def _mtp_extra_state_modules(config: GPTConfig) -> tuple[list[str], list[str]]:
    """The prediction depths' modules with an extra state in the local spec (their eh_proj and their
    layer's), and the prefixes of the layers whose experts have theirs (a mixture of experts' layer)."""
    modules, expert_layers = [], []
    entries = config.mtp_layer_types()  # (one layer per depth: Megatron's GPT path)
    for depth in range(config.mtp_depths):
        entry = entries[0]
        layer = f"mtp.layers.{depth}.transformer_layer."
        modules += [f"mtp.layers.{depth}.{module}" for module in MTP_EXTRA_STATE_MODULES]
        modules += [layer + module for module in _extra_state_modules(config, entry)]
        expert_layers += [layer] if "E" in entry else []
    return modules, expert_layers


def _extra_state_modules(config: GPTConfig, entry: str) -> tuple[str, ...]:
    """The local spec's modules with an extra state in a layer of layer-list entry ``entry`` (its
    experts' own aside)."""
    return extra_state_modules(entry, config.multi_latent_attention, config.q_lora_rank,
                               bool(config.moe_shared_expert_intermediate_size))


def _write_distributed(source, config, slices, padded, common, folder) -> None:
    state: dict[str, torch.Tensor] = {}
    stacked: dict[str, list] = {}
    layers, experts = config.num_layers, config.num_experts or 0
    for name in sorted(slices, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")]):
        _, _, table = slices[name]
        key, layer, expert = megatron_key(name, fused_norms=True, latent=config.multi_latent_attention)
        tensor = _as_megatron(_padded(source.whole(name), table, padded), name)
        if layer is None and expert is not None:  # a prediction depth's expert: its layer's on one axis
            rows = stacked.setdefault(f"{mtp_layer_prefix(name)}{STACKED_EXPERTS}{key}", [None] * experts)
            rows[expert] = tensor
        elif layer is None:
            state[key] = tensor.contiguous()
        elif expert is None:
            stacked.setdefault(f"decoder.layers.{key}", [None] * layers)[layer] = tensor
        else:  # the experts along a second axis
            rows = stacked.setdefault(f"decoder.layers.{STACKED_EXPERTS}{key}", [[None] * experts
                                                                                for _ in range(layers)])
            rows[layer][expert] = tensor
    state.update({key: torch.stack([torch.stack(row) if isinstance(row, list) else row for row in rows])
                  for key, rows in stacked.items()})
    entry = config.layer_types()[0]  # (all alike: checked above)
    for layer in range(layers):  # the local spec's empty extra states, which its loader asks for: a
        for module in _extra_state_modules(config, entry):  # sharded object is stored as its data's list
            state[f"decoder.layers.{module}._extra_state/shard_{layer}_{layers}"] = [None]
        for expert, module in itertools.product(range(experts), EXPERT_EXTRA_STATE_MODULES):
            state[f"decoder.layers.{STACKED_EXPERTS}{module}._extra_state/shard_{layer}.{expert}_"
                  f"{layers}.{experts}"] = [None]
    modules, expert_layers = _mtp_extra_state_modules(config)  # (a depth's: one layer, no layer axis)
    state.update({f"{module}._extra_state/shard_0_1": [None] for module in modules})
    state.update({f"{layer}{STACKED_EXPERTS}{module}._extra_state/shard_{expert}_{experts}": [None]
                  for layer in expert_layers for expert in range(experts)
                  for module in EXPERT_EXTRA_STATE_MODULES})
    _save_distributed(state, common, folder)


def _write_hybrid_distributed(source, config, slices, padded, common, folder) -> None:
    """A HybridModel's torch_dist: each tensor keyed by its layer (no layer axis; a layer's experts on a
    first axis), a mixer's in_proj and convolution saved as their parts (``megatron_parts.PARTS``),
    the norms under Transformer Engine's fused names but a mixture of experts' pre-norm (which its spec
    never fuses)."""
    state: dict = {}
    experts, entries = config.num_experts or 0, config.layer_types()
    stacked: dict[str, list] = {}
    for name in slices:
        _, _, table = slices[name]
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        fused = layer is None or entries[layer] != "E"
        key, layer, expert = megatron_key(name, fused_norms=fused, latent=config.multi_latent_attention,
                                          hybrid=True)
        tensor = _as_megatron(_padded(source.whole(name), table, padded), name)
        if layer is None:
            state[key] = tensor.contiguous()
        elif expert is not None:
            rows = stacked.setdefault(f"decoder.layers.{layer}.{STACKED_EXPERTS}{key}", [None] * experts)
            rows[expert] = tensor
        elif key in PARTS:
            parts = split_parts(key, to_megatron(key, tensor, config, 1), config)
            state.update({f"decoder.layers.{layer}.{key}.{part}": value.contiguous()
                          for part, value in parts.items()})
        else:
            state[f"decoder.layers.{layer}.{key}"] = tensor.contiguous()
    state.update({key: torch.stack(rows) for key, rows in stacked.items()})
    for layer, entry in enumerate(entries):  # the local spec's empty extra states (see _write_distributed)
        for module in _extra_state_modules(config, entry):
            state[f"decoder.layers.{layer}.{module}._extra_state/shard_0_1"] = [None]
        if entry == "E":
            for expert, module in itertools.product(range(experts), EXPERT_EXTRA_STATE_MODULES):
                state[f"decoder.layers.{layer}.{STACKED_EXPERTS}{module}._extra_state/shard_{expert}_"
                      f"{experts}"] = [None]
    state["output_layer._extra_state/shard_0_1"] = [None]  # (a HybridModel's loader asks for it)
    _save_distributed(state, common, folder)


def _save_distributed(state: dict, common: dict, folder: str) -> None:
    """torch_dist's files: the Distributed Checkpoint, common.pt and the metadata naming the backend."""
    save_in_one_process(state, folder)
    torch.save(common, os.path.join(folder, "common.pt"))
    with open(os.path.join(folder, "metadata.json"), "w") as handle:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, handle)
