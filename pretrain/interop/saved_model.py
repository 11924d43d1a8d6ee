"""What a checkpoint of ours holds for conversion and loading outside training: its weights, whatever
the layout that saved them, its model config and its tokenizer."""

from __future__ import annotations

import os

from models.config import GPTConfig
from pretrain.checkpoint.catalog import (MODEL, RANK_FORMAT, WEIGHTS_FILE, check_format, open_rank_file,
                                         read_manifest, read_rank_files, verified)
from pretrain.checkpoint.reshard import LegacyPieces, PieceSource, SavedPieces, WeightsFile


def saved_weights(directory: str, step: int | None = None) -> tuple[str, dict, PieceSource]:
    """(the checkpoint's path, its manifest, its pieces: ``whole(name)``, ``stream(name, ...)``) of the
    newest complete checkpoint under ``directory`` (or of iteration ``step``): a weights file (an import)
    or the rank files' pieces, each checked against the manifest as it is read (CheckpointError naming the
    file)."""
    checkpoint, manifest = read_manifest(directory, step)
    if manifest.get("kind") == "weights":
        return checkpoint, manifest, WeightsFile(verified(checkpoint, manifest, WEIGHTS_FILE))
    check_format(checkpoint, manifest)
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
    from data.tokenizers.spec import TokenizerSpec, build_tokenizer

    recorded = manifest.get("tokenizer")
    if recorded is not None:  # an import: its files sit in the checkpoint
        files = {key: os.path.join(checkpoint, value) if key != "tokenizer_type" else value
                 for key, value in recorded.items()}
        return build_tokenizer(TokenizerSpec(**files))
    if manifest.get("kind") == "weights":
        raise ValueError(f"{checkpoint} was imported without tokenizer files (its Hugging Face directory had "
                         "none)")
    settings = manifest["config"]
    if (not settings.get("data_path") and not settings.get("train_data_path")
            and not settings.get("mock_data")):
        from data.default_corpus import ensure_default_corpus

        _, model = ensure_default_corpus(settings["data_cache_dir"], settings["default_corpus_vocab_size"],
                                         settings.get("default_corpus_max_bytes"))
        return build_tokenizer(TokenizerSpec("SentencePieceTokenizer", model))
    vocab = settings.get("vocab_size")
    kind = settings.get("tokenizer_type") or "SentencePieceTokenizer"
    return build_tokenizer(TokenizerSpec(kind, settings.get("tokenizer_model"), settings.get("vocab_file"),
                                         settings.get("merge_file"),
                                         vocab - 1 if kind == "NullTokenizer" else None))
