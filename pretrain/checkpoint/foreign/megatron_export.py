"""A model of ours written as a Megatron-LM checkpoint that Megatron-LM's own loader resumes: its legacy
rank files (``--ckpt-format torch``) at a chosen tp x pp, or megatron-core's ``torch_dist`` (global
tensors, layers stacked on a first axis; megatron-core re-cuts it to any layout as it loads).

The args are the inverse of the import's (``megatron_args.args_of``), the keys megatron-core's
(``megatron_names.megatron_key``: the local spec's norm names in legacy files, the fused ones in
torch_dist), the vocabulary tables padded as Megatron pads them (to --make-vocab-size-divisible-by x tp),
and the run's iteration, data position and learning-rate schedule go with them. Each of our tensors is
rebuilt whole once from the source's pieces; the files are written in a staging folder and renamed into
place with the tracker last, so a failed export leaves no checkpoint behind. No optimizer state is written
(Megatron resumes it with --no-load-optim).
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from models.config import GPTConfig
from pretrain.checkpoint.foreign.megatron_args import MegatronLayout, args_of
from pretrain.checkpoint.foreign.megatron_checkpoint import TRACKER, iteration_folder, legacy_file
from pretrain.checkpoint.foreign.megatron_names import EXTRA_STATE_MODULES, megatron_key
from pretrain.checkpoint.foreign.megatron_pieces import our_slices

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
    common = {"args": args_of(config, layout, padded, run), "checkpoint_version": CHECKPOINT_VERSION,
              "iteration": int(progress["iteration"]), "num_floating_point_operations_so_far": 0}
    scheduler = manifest.get("states", {}).get("opt_param_scheduler")
    if scheduler:
        common["opt_param_scheduler"] = {key: value for key, value in scheduler.items()
                                         if not key.startswith("decoupled_")}
    return common


def _padded(whole: torch.Tensor, table: bool, padded: int) -> torch.Tensor:
    """A vocabulary table padded with zero rows to Megatron's padded vocabulary."""
    if table and whole.shape[0] < padded:
        return torch.cat([whole, whole.new_zeros(padded - whole.shape[0], *whole.shape[1:])])
    return whole


def _as_megatron(part: torch.Tensor) -> torch.Tensor:
    """One of our tensors (or tp slices) as Megatron keeps it: a gated fc1's [2, f, h] as [2f, h] (the
    gate's rows, then the up matrix's)."""
    return part.reshape(-1, part.shape[-1]) if part.ndim == 3 else part


def write_megatron(source, config: GPTConfig, manifest: dict, directory: str, ckpt_format: str,
                   tp: int = 1, pp: int = 1) -> str:
    """Write ``source``'s model (a ``reshard.PieceSource``) under ``directory`` as Megatron-LM's
    ``ckpt_format`` ("torch": rank files at ``tp`` x ``pp``; "torch_dist"); returns the iteration folder."""
    if ckpt_format not in FORMATS:
        raise ValueError(f"--ckpt-format {ckpt_format!r} is not one of {', '.join(FORMATS)}")
    if config.num_experts or config.multi_latent_attention:
        raise ValueError("--to megatron: mixtures of experts and latent attention are not written yet")
    if config.num_layers % pp:
        raise ValueError(f"--target-pipeline-parallel-size {pp} does not divide the model's "
                         f"{config.num_layers} layers")
    layout = MegatronLayout(tp, pp, 1, 1, tp, config.num_layers)
    padded = padded_vocabulary(config, tp)
    common = _common(config, layout, padded, manifest)
    final = os.path.join(directory, iteration_folder(common["iteration"]))
    staging = final + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    slices = our_slices(config, tp)
    tied = not config.untie_embeddings_and_output_weights
    try:
        if ckpt_format == "torch":
            _write_legacy(source, config, layout, slices, padded, common, staging, tied)
        else:
            _write_distributed(source, config, slices, padded, common, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    with open(os.path.join(directory, TRACKER + ".part"), "w") as handle:
        handle.write(str(common["iteration"]))
    os.replace(os.path.join(directory, TRACKER + ".part"), os.path.join(directory, TRACKER))
    return final


def _write_legacy(source, config, layout, slices, padded, common, folder, tied) -> None:
    per_stage = config.num_layers // layout.pp
    models = {(t, p): {} for t in range(layout.tp) for p in range(layout.pp)}
    for name in sorted(slices):
        _, dim, table = slices[name]
        key, layer = megatron_key(name, fused_norms=False)
        tensor = _padded(source.whole(name), table, padded)
        if layer is None:
            stages = [0] if key.startswith("embedding.") else [layout.pp - 1]
        else:
            stages, key = [layer // per_stage], f"decoder.layers.{layer % per_stage}.{key}"
        parts = [_as_megatron(part) for part in tensor.chunk(layout.tp, dim=dim)] if dim is not None \
            else [tensor] * layout.tp
        for stage in stages:
            for t in range(layout.tp):
                models[t, stage][key] = parts[t].clone()
    for (t, p), model in models.items():
        if tied and p == layout.pp - 1 and layout.pp > 1:  # the last stage's copy of the tied embedding
            model["output_layer.weight"] = models[t, 0]["embedding.word_embeddings.weight"].clone()
        for layer in range(per_stage):
            for module in EXTRA_STATE_MODULES:
                model[f"decoder.layers.{layer}.{module}._extra_state"] = None
        if p == layout.pp - 1:
            model["output_layer._extra_state"] = None
        path = legacy_file(folder, layout, t, p, 0)
        os.makedirs(os.path.dirname(path))
        torch.save({**common, "model": model}, path)


def _write_distributed(source, config, slices, padded, common, folder) -> None:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    state: dict[str, torch.Tensor] = {}
    stacked: dict[str, list[torch.Tensor]] = {}
    for name in sorted(slices, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")]):
        _, _, table = slices[name]
        key, layer = megatron_key(name, fused_norms=True)
        tensor = _as_megatron(_padded(source.whole(name), table, padded))
        if layer is None:
            state[key] = tensor.contiguous()
        else:
            stacked.setdefault(f"decoder.layers.{key}", [None] * config.num_layers)[layer] = tensor
    state.update({key: torch.stack(layers) for key, layers in stacked.items()})
    for layer in range(config.num_layers):  # the local spec's empty extra states, which its loader asks for:
        for module in EXTRA_STATE_MODULES:  # a sharded object is stored as the list of its data
            state[f"decoder.layers.{module}._extra_state/shard_{layer}_{config.num_layers}"] = [None]
    dcp_save(state, storage_writer=FileSystemWriter(folder), no_dist=True)
    torch.save(common, os.path.join(folder, "common.pt"))
    with open(os.path.join(folder, "metadata.json"), "w") as handle:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, handle)
