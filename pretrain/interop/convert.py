"""Convert checkpoints: any layout of ours to one file or to Hugging Face, and Hugging Face to ours.

    python -m pretrain.convert --load DIR --output OUT.safetensors [--with-optimizer-states]
    python -m pretrain.convert --load DIR --output HF_DIR --to hf
    python -m pretrain.convert --from-hf HF_DIR --output CKPT_DIR

``consolidated`` (default): one safetensors file of the whole model's fp32 weights under their
layout-independent names (vocabulary padding removed; the names of a single-process GPTModel), with the
iteration and the model config as metadata, and optionally every per-element optimizer state
(``optimizer.<state>.<name>``). ``hf``: a directory that ``transformers`` loads as the class of the
model's family (the one it was imported from, else the first that expresses it: GPT-2, Llama, Mistral,
Qwen2, Qwen3, Phi-3, OLMo 2, Gemma 2, Gemma 3), with its tokenizer; refused, naming the flags, when
none expresses the model. ``--from-hf``: a Hugging Face directory of one of those families as a
weights-only checkpoint of ours (``pretrain.interop.hf_checkpoint``). All stream: one parameter is
rebuilt (or read) at a time.
"""
from __future__ import annotations

import argparse
import json
import sys

from models.config import GPTConfig
from parallel.zero.export import StreamedSafetensors
from pretrain.checkpoint.catalog import CheckpointError
from pretrain.checkpoint.reshard import CheckpointPieces, ReshardError
from pretrain.interop.saved_model import model_config, saved_tokenizer, saved_weights


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
        checkpoint, manifest, pieces = saved_weights(args.load)
        if args.to == "hf":
            try:
                tokenizer = saved_tokenizer(checkpoint, manifest)
            except ValueError as error:
                print(f"warning: no tokenizer files written ({error})", file=sys.stderr)
                tokenizer = None
            export_hf(pieces, model_config(manifest), tokenizer, args.output)
        else:
            write_consolidated(pieces, manifest, args.output, args.with_optimizer_states)
    except (CheckpointError, ReshardError) as error:
        sys.exit(f"error: {error}")
    print(f"wrote {args.output} from iteration {manifest['iteration']} of {args.load}")


if __name__ == "__main__":
    main()
