"""Convert checkpoints: any layout of ours to one file or to Hugging Face, and Hugging Face to ours.

    python -m pretrain.convert --load DIR --output OUT.safetensors [--with-optimizer-states]
    python -m pretrain.convert --load DIR --output HF_DIR --to hf
    python -m pretrain.convert --from-hf HF_DIR --output CKPT_DIR

``consolidated`` (default): one safetensors file of the whole model's fp32 weights under their
layout-independent names (vocabulary padding removed; the names of a single-process GPTModel), with the
iteration and the model config as metadata, and optionally every per-element optimizer state
(``optimizer.<state>.<name>``). ``hf``: a directory that ``transformers`` loads as GPT2LMHeadModel or
LlamaForCausalLM (Qwen2ForCausalLM with query/key/value biases), with its tokenizer; refused, naming the
option, when neither expresses the model. ``--from-hf``: a Hugging Face GPT-2, Llama, Mistral or Qwen2
directory as a weights-only checkpoint of ours (``pretrain.interop.hf_checkpoint``). All stream: one parameter
is rebuilt (or read) at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from models.config import GPTConfig
from parallel.zero.export import StreamedSafetensors
from pretrain.checkpoint.catalog import MODEL, WEIGHTS_FILE, CheckpointError, read_manifest, read_rank_files
from pretrain.checkpoint.reshard import CheckpointPieces, ReshardError, WeightsFile


def _model_config(manifest: dict) -> GPTConfig:
    fields = GPTConfig.__dataclass_fields__
    return GPTConfig(**{key: value for key, value in manifest["config"].items() if key in fields})


def _natural(name: str) -> list:
    """Sort key: embeddings, then blocks by number, then the final norm."""
    parts = name.split(".")
    rank = {"word_embedding": 0, "position_embedding": 1, "layers": 2}.get(parts[0], 3)
    return [rank] + [int(p) if p.isdigit() else p for p in parts[1:]]


def write_consolidated(pieces: CheckpointPieces, manifest: dict, output: str,
                       with_states: bool = False) -> None:
    names = sorted(pieces.by_name, key=_natural)
    kinds = ["master"] + (list(pieces.kinds) if with_states else [])
    entries = [(name if kind == "master" else f"optimizer.{kind}.{name}", pieces.shape(name))
               for kind in kinds for name in names]
    config = {key: value for key,
              value in manifest["config"].items() if key in GPTConfig.__dataclass_fields__}
    metadata = {"iteration": str(manifest["iteration"]), "model": json.dumps(config)}
    writer = StreamedSafetensors(output, entries, metadata=metadata)
    try:
        for kind in kinds:
            for name in names:
                writer.write(name if kind == "master" else f"optimizer.{kind}.{name}",
                             pieces.whole(name, kind))
    except BaseException:
        writer.abort()
        raise
    writer.close()


def _checkpoint_tokenizer(checkpoint: str, manifest: dict):
    """The tokenizer a checkpoint was trained or imported with, or None when it names none."""
    from data.tokenizers.spec import TokenizerSpec, build_tokenizer

    recorded = manifest.get("tokenizer")
    if recorded is not None:  # an import: its files sit in the checkpoint
        files = {key: os.path.join(checkpoint, value) if key != "tokenizer_type" else value
                 for key, value in recorded.items()}
        return build_tokenizer(TokenizerSpec(**files))
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.convert", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="checkpoint directory (its newest complete checkpoint)")
    source.add_argument("--from-hf", help="a Hugging Face model directory to import as a checkpoint of ours")
    parser.add_argument("--output", required=True,
                        help="the .safetensors file, the directory for --to hf, or the "
                                                        "checkpoint directory for --from-hf")
    parser.add_argument("--to", choices=["consolidated", "hf"], default="consolidated")
    parser.add_argument("--with-optimizer-states", action="store_true",
                        help="consolidated: add the optimizer states")
    args = parser.parse_args(argv)
    from pretrain.interop.hf_checkpoint import export_hf, import_hf

    try:
        if args.from_hf:
            path = import_hf(args.from_hf, args.output)
            print(f"wrote {path} from {args.from_hf}")
            return
        checkpoint, manifest = read_manifest(args.load)
        if manifest.get("kind") == "weights":
            pieces = WeightsFile(os.path.join(checkpoint, WEIGHTS_FILE))
        else:
            _, manifest, states = read_rank_files(args.load)
            pieces = CheckpointPieces([rank_file[MODEL] for rank_file in states])
        if args.to == "hf":
            try:
                tokenizer = _checkpoint_tokenizer(checkpoint, manifest)
            except ValueError as error:
                print(f"warning: no tokenizer files written ({error})", file=sys.stderr)
                tokenizer = None
            export_hf(pieces, _model_config(manifest), tokenizer, args.output)
        else:
            write_consolidated(pieces, manifest, args.output, args.with_optimizer_states)
    except (CheckpointError, ReshardError) as error:
        sys.exit(f"error: {error}")
    print(f"wrote {args.output} from iteration {manifest['iteration']} of {args.load}")


if __name__ == "__main__":
    main()
