"""Convert checkpoints: any layout of ours to one file or to Hugging Face, and Hugging Face to ours.

    python -m pretrain.convert --load DIR [--ckpt-step N] --output OUT.safetensors [--with-optimizer-states]
                               [--max-shard-size 5GB] [--workers N]
    python -m pretrain.convert --load DIR --output HF_DIR --to hf [--max-shard-size 5GB]
    python -m pretrain.convert --from-hf HF_DIR --output CKPT_DIR
    python -m pretrain.convert --load DIR --list
    python -m pretrain.convert --from-torchtitan STEP_DIR --output CKPT_DIR --num-attention-heads H
                               [--num-query-groups G --rotary-base B --norm-epsilon E --seq-length S]
    python -m pretrain.convert --load DIR --output STEP_DIR --to torchtitan [--torchtitan-keys 0.3|0.2]
    python -m pretrain.convert --load DIR --output MEGATRON_DIR --to megatron --ckpt-format torch|torch_dist
                               [--target-tensor-parallel-size T --target-pipeline-parallel-size P
                                --target-expert-parallel-size E]

``consolidated`` (default): the whole model's fp32 weights under their layout-independent names
(vocabulary padding removed; the names of a single-process GPTModel), with the iteration and the model
config as metadata, and optionally every per-element optimizer state (``optimizer.<state>.<name>``):
one safetensors file, or with ``--max-shard-size`` shards beside ``OUT.safetensors.index.json`` (Hugging
Face's layout), written by ``--workers`` processes. Each tensor is written straight from the saved
pieces, one piece at a time: the extra memory is one piece, never a whole tensor. ``hf``: a directory
that ``transformers`` loads as the class of the model's family (the one it was imported from, else the
first that expresses it: GPT-2, Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, Gemma 2, Gemma 3), with its
tokenizer, sharded as ``--max-shard-size`` says; refused, naming the flags, when none expresses the
model; one of our tensors is rebuilt at a time (its Hugging Face tensors are cut from it).
``--from-hf``: a Hugging Face directory of one of those families as a weights-only checkpoint of ours
(``pretrain.interop.hf_checkpoint``). ``--load`` also takes a Megatron-LM checkpoint directory (legacy
``torch`` or ``torch_dist``, ``pretrain.checkpoint.foreign``); ``--list`` says what a checkpoint holds (its
source, iteration, layout, model and states) from its args or manifest, before any weight is read.
``--from-torchtitan`` / ``torchtitan``: a torchtitan Llama step folder in and out
(``pretrain.interop.torchtitan``).
``megatron``: a Megatron-LM checkpoint directory its own loader resumes (with --no-load-optim: no optimizer
state is written), legacy rank files at the target tp x pp or torch_dist
(``pretrain.checkpoint.foreign.megatron_export``).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys

from models.config import GPTConfig
from parallel.zero.export import StreamedSafetensors
from pretrain.checkpoint.catalog import CheckpointError, latest_name, read_manifest, run_states
from pretrain.checkpoint.directory_contents import check_output
from pretrain.checkpoint.reshard import PieceSource, ReshardError
from pretrain.interop.safetensors_shards import parse_size, plan_shards, write_index
from pretrain.interop.saved_model import (describe, model_config, saved_tokenizer, saved_weights,
                                          tokenizer_spec)


def _natural(name: str) -> list:
    """Sort key: embeddings, then blocks by number, then the final norm."""
    parts = name.split(".")
    rank = {"word_embedding": 0, "position_embedding": 1, "layers": 2}.get(parts[0], 3)
    return [rank] + [int(p) if p.isdigit() else p for p in parts[1:]]


def _entry(kind: str, name: str) -> str:
    return name if kind == "master" else f"optimizer.{kind}.{name}"


def write_shard(source: PieceSource, path: str, entries: list[tuple[str, str, tuple]],
                metadata: dict) -> None:
    """One safetensors file of (kind, name, shape) entries, streamed from ``source``'s pieces."""
    writer = StreamedSafetensors(path, [(_entry(kind, name), shape) for kind, name, shape in entries],
                                 metadata=metadata)
    try:
        for kind, name, _ in entries:
            source.stream(name, kind, lambda offset, values, entry=_entry(kind, name):
                          writer.write_at(entry, offset, values))
    except BaseException:
        writer.abort()
        raise
    writer.close()


def _worker(directory: str, step: int | None, jobs: list[tuple[str, list, dict]]) -> None:
    """A conversion process: its own view of the checkpoint, its shards."""
    _, _, source = saved_weights(directory, step)
    for path, entries, metadata in jobs:
        write_shard(source, path, entries, metadata)


def write_consolidated(source: PieceSource, manifest: dict, output: str, with_states: bool = False,
                       max_shard_bytes: int | None = None, workers: int = 1,
                       directory: str | None = None, step: int | None = None) -> int:
    """Write the consolidated file (or its shards and index); returns the number of files. With
    ``workers`` > 1 the shards are shared among that many processes, each reading ``directory`` (its
    checkpoint of iteration ``step``, or the newest)."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    names = sorted(source.by_name, key=_natural)
    kinds = ["master"] + (list(source.kinds) if with_states else [])
    shapes = {name: source.shape(name) for name in names}
    config = {key: value for key,
              value in manifest["config"].items() if key in GPTConfig.__dataclass_fields__}
    metadata = {"iteration": str(manifest["iteration"]), "model": json.dumps(config)}
    by_entry = {_entry(kind, name): (kind, name) for kind in kinds for name in names}
    shards = plan_shards(output, [(_entry(kind, name), shapes[name]) for kind in kinds for name in names], 4,
                         max_shard_bytes)
    jobs = [(path, [(*by_entry[entry], shape) for entry, shape in entries], metadata)
            for path, entries in shards]
    if workers > 1 and len(jobs) > 1 and directory is not None:
        context = multiprocessing.get_context("spawn")
        processes = [context.Process(target=_worker, args=(directory, step, jobs[number::workers]))
                     for number in range(min(workers, len(jobs)))]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        failed = [process.exitcode for process in processes if process.exitcode]
        if failed:
            raise CheckpointError(f"--workers: {len(failed)} conversion processes failed (exit codes "
                                  f"{failed}); see their messages above")
    else:
        for path, entries, shard_metadata in jobs:
            write_shard(source, path, entries, shard_metadata)
    if len(shards) > 1:
        write_index(output, shards, 4)
    return len(shards)


def _meaningful(args) -> dict:
    """The flags that mean something in some modes only, {dest: (spelling, what gives it meaning, whether
    this run has that)}: given outside them, a flag is refused, not ignored."""
    titan_in = ("--from-torchtitan", bool(args.from_torchtitan))
    megatron = ("--to megatron", args.to == "megatron")
    legacy = ("--to megatron --ckpt-format torch", megatron[1] and args.ckpt_format == "torch")
    return {"num_attention_heads": ("--num-attention-heads", *titan_in),
            "num_query_groups": ("--num-query-groups", *titan_in),
            "rotary_base": ("--rotary-base", *titan_in), "norm_epsilon": ("--norm-epsilon", *titan_in),
            "seq_length": ("--seq-length", *titan_in),
            "torchtitan_keys": ("--torchtitan-keys", "--to torchtitan", args.to == "torchtitan"),
            "ckpt_format": ("--ckpt-format", *megatron),
            "target_tensor_parallel_size": ("--target-tensor-parallel-size", *legacy),
            "target_pipeline_parallel_size": ("--target-pipeline-parallel-size", *legacy),
            "target_expert_parallel_size": ("--target-expert-parallel-size", *legacy),
            "with_optimizer_states": ("--with-optimizer-states", "--load with --to consolidated or megatron",
                                      bool(args.load) and args.to in (None, "consolidated", "megatron")),
            "max_shard_size": ("--max-shard-size", "--load with --to consolidated or hf",
                               bool(args.load) and args.to in (None, "consolidated", "hf")),
            "workers": ("--workers", "--load with --to consolidated",
                        bool(args.load) and args.to in (None, "consolidated")),
            "add_to_output": ("--add-to-output", "--from-hf, --from-torchtitan or --to megatron",
                              bool(args.from_hf or args.from_torchtitan) or megatron[1])}


def _unmeant_flag(args) -> str | None:
    """The first flag given where it means nothing, named with what gives it meaning (None: none)."""
    if args.list:
        given = [flag for flag, value in (("--output", args.output), ("--to", args.to)) if value]
        if given:
            return (f"{given[0]} with --list: --list only describes --load and writes nothing; drop "
                    f"{given[0]}, or drop --list to convert")
    if args.to and not args.load:
        return (f"--to {args.to} converts a checkpoint of ours: give --load DIR (not --from-hf / "
                "--from-torchtitan)")
    for name, (flag, meaning, meant) in _meaningful(args).items():
        if getattr(args, name) not in (None, False) and not meant:
            return f"{flag} means something with {meaning} only: drop it, or give {meaning}"
    return None


def _output_kind(args) -> str | None:
    """What the conversion writes at --output, as ``directory_contents.check_output`` names it (None: a
    consolidated file, not a directory)."""
    if args.from_hf or args.from_torchtitan:
        return "ours"
    return {"megatron": "megatron", "torchtitan": "dcp", "hf": "hf"}.get(args.to)


def _imported(path: str, source: str, output: str) -> None:
    print(f"wrote {path} from {source}")
    pointer = latest_name(output)
    if pointer != os.path.basename(path):
        print(f"note: {output}'s latest stays {pointer} (newer); train from the import with --load {output} "
              "--ckpt-step 0 --finetune", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.convert", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="checkpoint directory (its newest complete checkpoint)")
    source.add_argument("--from-hf", help="a Hugging Face model directory to import as a checkpoint of ours")
    source.add_argument("--from-torchtitan", help="a torchtitan Llama step folder (Distributed Checkpoint) "
                                                  "to import as a checkpoint of ours (give its head layout)")
    titan = parser.add_argument_group("torchtitan's Llama (its checkpoints keep no model config: an export "
                                      "of ours records it in the step folder's model_args.json, which "
                                      "the import reads; a flag that contradicts it is refused)")
    titan.add_argument("--num-attention-heads", type=int, help="--from-torchtitan: the model's heads "
                                                               "(default: the recorded ones)")
    titan.add_argument("--num-query-groups", type=int, help="--from-torchtitan: its key/value heads "
                                                             "(default: the recorded ones, else the heads)")
    titan.add_argument("--rotary-base", type=float, help="--from-torchtitan: rope theta (default: the "
                                                         "recorded one, else 500000)")
    titan.add_argument("--norm-epsilon", type=float, help="--from-torchtitan: RMSNorm epsilon (default: the "
                                                          "recorded one, else 1e-5)")
    titan.add_argument("--seq-length", type=int, help="--from-torchtitan: the sequence length (default: the "
                                                      "recorded one, else 2048)")
    titan.add_argument("--torchtitan-keys", choices=["0.3", "0.2"],
                       help="--to torchtitan: its key spelling (0.3: qkv_linear, lm_head; 0.2: wq, output; "
                            "default 0.3)")
    parser.add_argument("--list", action="store_true",
                        help="--load: print what the checkpoint holds and stop (no --output)")
    parser.add_argument("--output", required=False,
                        help="the .safetensors file, the directory for --to hf, or the "
                                                        "checkpoint directory for --from-hf")
    parser.add_argument("--add-to-output", action="store_true",
                        help="--from-hf, --from-torchtitan, --to megatron: add the checkpoint to an --output "
                             "directory that already holds checkpoints of the same kind (its newest stays "
                             "'latest' unless the new one is newer; default: such an --output is refused)")
    parser.add_argument("--ckpt-step", type=int, default=None,
                        help="--load: the checkpoint of this iteration (default: the newest complete one)")
    parser.add_argument("--to", choices=["consolidated", "hf", "megatron", "torchtitan"],
                        help="what --load is converted to (default: consolidated)")
    parser.add_argument("--ckpt-format", choices=["torch", "torch_dist"],
                        help="--to megatron: Megatron-LM's legacy rank files or megatron-core's torch_dist "
                             "(default torch_dist)")
    parser.add_argument("--target-tensor-parallel-size", type=int,
                        help="--to megatron --ckpt-format torch: the tp of the rank files (default 1)")
    parser.add_argument("--target-pipeline-parallel-size", type=int,
                        help="--to megatron --ckpt-format torch: the pp of the rank files (default 1)")
    parser.add_argument("--target-expert-parallel-size", type=int,
                        help="--to megatron --ckpt-format torch: the ep of the rank files, a mixture of "
                             "experts' (default 1)")
    parser.add_argument("--with-optimizer-states", action="store_true",
                        help="consolidated: add the optimizer states; --to megatron --ckpt-format torch: "
                             "Adam's states as the distributed optimizer's distrib_optim.pt")
    parser.add_argument("--max-shard-size", default=None,
                        help="cut the safetensors output into shards of at most this size (5GB, 500MB, "
                             "2GiB) with Hugging Face's index; default: one file")
    parser.add_argument("--workers", type=int,
                        help="consolidated: processes writing the shards at once (default 1)")
    args = parser.parse_args(argv)
    if args.to == "megatron" and args.ckpt_format is None:
        args.ckpt_format = "torch_dist"
    unmeant = _unmeant_flag(args)
    if unmeant:
        sys.exit(f"error: {unmeant}")
    args.to = args.to or "consolidated"
    if args.list:
        if not args.load:
            sys.exit("error: --list describes a checkpoint: give --load DIR")
        try:
            checkpoint, manifest = read_manifest(args.load, args.ckpt_step)
        except CheckpointError as error:
            sys.exit(f"error: {error}")
        print("\n".join(describe(checkpoint, manifest)))
        return
    if not args.output:
        sys.exit("error: --output is required (or --list to describe --load)")
    try:  # each bad value in one line naming its flag, before anything is read
        max_shard_bytes = parse_size(args.max_shard_size) if args.max_shard_size else None
    except ValueError as error:
        sys.exit(f"error: {error}")
    args.workers = 1 if args.workers is None else args.workers
    if args.workers < 1:
        sys.exit(f"error: --workers {args.workers}: give 1 or more processes")
    for flag in ("target_tensor_parallel_size", "target_pipeline_parallel_size",
                 "target_expert_parallel_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            sys.exit(f"error: --{flag.replace('_', '-')} {value}: give 1 or more ranks")
    if args.ckpt_step is not None and args.ckpt_step < 0:
        sys.exit(f"error: --ckpt-step {args.ckpt_step}: give an iteration a checkpoint was saved at (>= 0)")
    if args.load and args.to == "consolidated" and not args.output.endswith(".safetensors"):
        sys.exit(f"error: --output {args.output}: the consolidated model is a safetensors file: give "
                 f"--output {args.output.rstrip('/')}/model.safetensors (or --to hf for a Hugging Face "
                 "directory)")
    writes = _output_kind(args)
    if writes is not None:
        try:
            check_output(args.output, writes, "--output", args.add_to_output)
        except ValueError as error:
            sys.exit(f"error: {error}")
    from pretrain.interop.hf_checkpoint import export_hf, import_hf

    try:
        if args.from_torchtitan:
            from pretrain.interop.torchtitan import import_torchtitan

            path = import_torchtitan(args.from_torchtitan, args.output, heads=args.num_attention_heads,
                                     query_groups=args.num_query_groups, rotary_base=args.rotary_base,
                                     norm_epsilon=args.norm_epsilon, seq_length=args.seq_length)
            _imported(path, args.from_torchtitan, args.output)
            return
        if args.from_hf:
            path = import_hf(args.from_hf, args.output)
            _imported(path, args.from_hf, args.output)
            if not os.path.isdir(os.path.join(path, "tokenizer")):
                print(f"note: {args.from_hf} has no tokenizer files (tokenizer.json, tokenizer.model or "
                      "vocab.json + merges.txt): the checkpoint has none; training with it needs a tokenizer "
                      "flag and --data-path of data it tokenized (or --mock-data), and an export writes the "
                      "weights and config alone", file=sys.stderr)
            return
        checkpoint, manifest, pieces = saved_weights(args.load, args.ckpt_step)
        if args.to == "torchtitan":
            from pretrain.interop.torchtitan import export_torchtitan

            try:
                export_torchtitan(pieces, model_config(manifest), args.output, args.torchtitan_keys or "0.3")
            except ValueError as error:
                sys.exit(f"error: {error}")
            print(f"wrote {args.output} (torchtitan {args.torchtitan_keys or '0.3'} keys) from iteration "
                  f"{manifest['iteration']} of {args.load}")
            return
        if args.to == "megatron":
            from pretrain.checkpoint.foreign.megatron_export import write_megatron

            tp, pp, ep = (args.target_tensor_parallel_size or 1, args.target_pipeline_parallel_size or 1,
                          args.target_expert_parallel_size or 1)
            try:
                tokenizer = tokenizer_spec(checkpoint, manifest)
            except ValueError as error:
                print(f"note: no tokenizer files written: {error}", file=sys.stderr)
                tokenizer = None
            try:
                written = write_megatron(pieces, model_config(manifest), manifest, args.output,
                                         args.ckpt_format, tp, pp, ep, args.with_optimizer_states, tokenizer)
            except ValueError as error:
                sys.exit(f"error: {error}")
            print(f"wrote {written} ({args.ckpt_format}) from iteration {manifest['iteration']} of "
                  f"{args.load}")
            return
        if args.to == "hf":
            try:
                tokenizer = saved_tokenizer(checkpoint, manifest)
            except ValueError as error:
                print(f"note: no tokenizer files written: {error}", file=sys.stderr)
                tokenizer = None
            export_hf(pieces, model_config(manifest), tokenizer, args.output, max_shard_bytes,
                      run_states(manifest))
        else:
            files = write_consolidated(pieces, manifest, args.output, args.with_optimizer_states,
                                       max_shard_bytes, args.workers, args.load, args.ckpt_step)
            if max_shard_bytes and files == 1:
                print(f"the model fits in one shard of --max-shard-size {args.max_shard_size}: one file, no "
                      "index (as Hugging Face writes it)")
    except (CheckpointError, ReshardError) as error:
        sys.exit(f"error: {error}")
    print(f"wrote {args.output} from iteration {manifest['iteration']} of {args.load}")


if __name__ == "__main__":
    main()
