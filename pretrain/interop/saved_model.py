"""What a checkpoint of ours holds for conversion and loading outside training: its weights, whatever
the layout that saved them, its model config and its tokenizer."""

from __future__ import annotations

import os

from models.config import GPTConfig
from pretrain.checkpoint.catalog import (DCP_STORAGE, MODEL, RANK_FORMAT, WEIGHTS_FILE, check_format,
                                         open_rank_file, read_manifest, read_rank_files, verified)
from pretrain.checkpoint.dcp_storage import DCPPieces
from pretrain.checkpoint.foreign.megatron_checkpoint import MISSING_DISTRIBUTED
from pretrain.checkpoint.foreign.megatron_optimizer import DISTRIBUTED_OPTIMIZER_FILE
from pretrain.checkpoint.foreign.megatron_pieces import megatron_pieces
from pretrain.checkpoint.reshard import LegacyPieces, PieceSource, SavedPieces, WeightsFile


def saved_weights(directory: str, step: int | None = None) -> tuple[str, dict, PieceSource]:
    """(the checkpoint's path, its manifest, its pieces: ``whole(name)``, ``stream(name, ...)``) of the
    newest complete checkpoint under ``directory`` (or of iteration ``step``): a weights file (an import)
    or the rank files' pieces, each checked against the manifest as it is read (CheckpointError naming the
    file)."""
    checkpoint, manifest = read_manifest(directory, step)
    if manifest.get("kind") == "weights":
        return checkpoint, manifest, WeightsFile(verified(checkpoint, manifest, WEIGHTS_FILE))
    if manifest.get("kind") == "megatron":
        return checkpoint, manifest, megatron_pieces(manifest)
    check_format(checkpoint, manifest)
    if manifest.get("storage") == DCP_STORAGE:
        return checkpoint, manifest, DCPPieces(checkpoint, manifest)
    if manifest.get("format") == RANK_FORMAT:
        return checkpoint, manifest, SavedPieces(checkpoint, manifest, open_rank_file, strict=True)
    checkpoint, manifest, states = read_rank_files(directory)
    return checkpoint, manifest, LegacyPieces([rank_file[MODEL] for rank_file in states])


def model_config(manifest: dict) -> GPTConfig:
    """The model a checkpoint's manifest records."""
    fields = GPTConfig.__dataclass_fields__
    return GPTConfig(**{key: value for key, value in manifest["config"].items() if key in fields})


def saved_tokenizer(checkpoint: str, manifest: dict):
    """The tokenizer a checkpoint was trained or imported with (ValueError when its files are gone)."""
    from data.tokenizers.spec import build_tokenizer

    return build_tokenizer(tokenizer_spec(checkpoint, manifest))


def tokenizer_spec(checkpoint: str, manifest: dict):
    """The ``TokenizerSpec`` (type and files) a checkpoint was trained or imported with; ValueError when
    it keeps none."""
    from data.tokenizers.spec import TokenizerSpec

    recorded = manifest.get("tokenizer")
    if recorded is not None:  # an import or a Megatron export of ours: its files sit in the checkpoint
        files = {key: os.path.join(checkpoint, value) if key != "tokenizer_type" else value
                 for key, value in recorded.items()}
        return TokenizerSpec(**files)
    if manifest.get("kind") == "weights":
        raise ValueError(f"{checkpoint} was imported without tokenizer files (its source had none: a "
                         "torchtitan step keeps none)")
    if manifest.get("kind") == "megatron":
        raise ValueError(f"{checkpoint} is a Megatron-LM checkpoint without tokenizer files in it: give "
                         "the tokenizer flags it was trained with")
    settings = manifest["config"]
    if (not settings.get("data_path") and not settings.get("train_data_path")
            and not settings.get("mock_data")):
        from data.default_corpus import ensure_default_corpus

        _, model = ensure_default_corpus(settings["data_cache_dir"], settings["default_corpus_vocab_size"],
                                         settings.get("default_corpus_max_bytes"))
        return TokenizerSpec("SentencePieceTokenizer", model)
    vocab = settings.get("vocab_size")
    kind = settings.get("tokenizer_type") or "SentencePieceTokenizer"
    return TokenizerSpec(kind, settings.get("tokenizer_model"), settings.get("vocab_file"),
                         settings.get("merge_file"), vocab - 1 if kind == "NullTokenizer" else None)


OPTIMIZER_STATES = {"adam": "Adam's two moments", "sgd": "the momentum buffer",
                    "muon": "Muon's momentum on the hidden matrices, Adam's moments on the rest"}
MEGATRON_STATES = {None: "none",
                   "distributed": "the distributed optimizer's fp32 masters and Adam moments, re-cut with "
                                  "the weights",
                   "plain": "the plain optimizer's Adam moments, re-cut with the weights",
                   MISSING_DISTRIBUTED: f"the distributed optimizer's, but no {DISTRIBUTED_OPTIMIZER_FILE} "
                                        "beside the rank files (the weights load; a whole resume needs "
                                        "--no-load-optim)"}


def describe(checkpoint: str, manifest: dict) -> list[str]:
    """What a checkpoint (ours, an import, or Megatron-LM's) holds, as lines to print, from its manifest
    alone: where it came from, the iteration and data position, the layout, the model, its states."""
    config = model_config(manifest)
    progress = manifest.get("states", {}).get("progress") or manifest
    groups = config.query_groups
    layout = {axis: size for axis, size in (manifest.get("layout") or {}).items() if isinstance(size, int)}
    mlp = ("swiglu" if config.swiglu else "geglu" if config.geglu else "squared relu" if config.squared_relu
           else "gelu")
    source = manifest.get("source", "a checkpoint of this stack") + (
        ", stored as a PyTorch Distributed Checkpoint" if manifest.get("storage") == DCP_STORAGE else "")
    lines = [f"{checkpoint}: {source}",
             f"iteration {manifest['iteration']}, consumed samples {progress.get('consumed_samples', 0)}",
             f"saved at {' x '.join(f'{axis}{size}' for axis, size in layout.items()) or 'no layout'}",
             f"model: {config.num_layers} layers, hidden {config.hidden_size}, "
             f"{config.num_attention_heads} heads"
             + (f" in {groups} query groups" if groups != config.num_attention_heads else "")
             + f", ffn {config.ffn_size}, vocabulary {config.vocab_size}; {config.normalization}, {mlp}, "
             f"{config.position_embedding}, "
             f"{'untied' if config.untie_embeddings_and_output_weights else 'tied'}"
             + (", no biases" if config.disable_bias_linear else ", biases")
             + (f", {config.num_experts} experts" if config.num_experts else "")
             + (", latent attention" if config.multi_latent_attention else "")
             + (f", layers {config.uncut_pattern!r}" if config.hybrid_layer_pattern else "")]
    if manifest.get("kind") == "megatron":
        held = manifest["megatron"]["optimizer"]
        lines.append("optimizer states: " + MEGATRON_STATES.get(held, f"{held} (not read here: resume with "
                                                                      "--no-load-optim)"))
    elif manifest.get("kind") == "weights":
        lines.append("optimizer states: none (weights only)")
    else:
        # (adam's: a checkpoint of before the name was kept)
        name = manifest.get("states", {}).get("optimizer", {}).get("name", "adam")
        held = OPTIMIZER_STATES.get(name, "its states")
        lines.append(f"optimizer states: --optimizer {name}'s ({held}), per element, re-cut with the weights")
    scheduler = manifest.get("states", {}).get("opt_param_scheduler")
    if scheduler:
        lines.append(f"schedule: {scheduler.get('lr_decay_style')} from {scheduler.get('max_lr')} to "
                     f"{scheduler.get('min_lr')} over {scheduler.get('lr_decay_steps')} samples")
    return lines
