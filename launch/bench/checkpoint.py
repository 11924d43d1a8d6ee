"""What a checkpoint costs the training: the step's stall per save, synchronous against ``--async-save``,
the bytes each rank writes against the total over the world, and the time a resume takes to verify and
read a rank's files.

    python -m launch.bench.checkpoint [--hidden-size 1024 --num-layers 8] [--zero-stage 1 3] [--tp 2]
                                      [--dp 2] [--iters 6] [--save-interval 2] [--save-dir DIR]

Each stage trains the same GPT (fp32, dp x tp processes) twice from the same seed, saving every
``--save-interval`` iterations: synchronously, then in the background; the two runs' losses must agree
bit for bit. Reported: the mean stall per save (the time the step waited in ``Trainer.save``, from the
metrics' ``save_stall_s``) and its ratio, async over sync; the largest rank's file against the
model's state written once and spread evenly (fp32 parameters and AdamW's two moments, 12 bytes a
parameter, over the world: what a save that writes each replicated piece once would give); and for
one rank's files of the last checkpoint, the seconds to verify and read them with one hash pass (as a
resume does now) against two (the start-up check and the read each hashing the files, as before).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from launch.bench.world import write_table
from launch.pretrain_run import run_pretrain
from models.config import GPTConfig
from models.counting import num_parameters


def _resume_read_seconds(directory: str, rank: int, passes: int) -> float:
    """Seconds to verify and read ``rank``'s file of the newest checkpoint, hashing it ``passes`` times."""
    from pretrain.checkpoint import catalog

    catalog._sha256.cache_clear()
    checkpoint, manifest = catalog.read_manifest(directory)
    entry = f"rank_{rank:05d}.pt"
    descriptor = os.open(os.path.join(checkpoint, entry), os.O_RDONLY)
    os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the disk, not the page cache
    os.close(descriptor)
    started = time.perf_counter()
    catalog.verified(checkpoint, manifest, entry)  # the start-up check
    if passes == 2:
        catalog._sha256.cache_clear()
    content = catalog.read_rank_file(checkpoint, manifest, entry)
    for state in content.values():  # touch every tensor: a memory-mapped load reads lazily
        _touch(state)
    return time.perf_counter() - started


def _touch(value) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        value.sum()
    elif isinstance(value, dict):
        for item in value.values():
            _touch(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _touch(item)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.checkpoint",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--save-interval", type=int, default=2)
    parser.add_argument("--save-dir", help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--output", default="runs/bench/checkpoint.md")
    args = parser.parse_args(argv)
    params = num_parameters(GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                      num_attention_heads=args.heads, seq_length=args.seq,
                                      vocab_size=args.vocab))
    world = args.tp * args.dp
    rows = [f"GPT of {params / 1e6:.1f}M parameters, fp32, dp {args.dp} x tp {args.tp}, a save every "
            f"{args.save_interval} of {args.iters} iterations", "",
            "| stage | save | stall per save s | async / sync | largest rank file MiB "
            "| vs 12 B x params / world | resume read s, 1 hash pass | 2 passes | final loss |",
            "|---|---|---|---|---|---|---|---|---|"]
    common = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
              "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
              "--vocab-size", str(args.vocab), "--mock-data", "--tokenizer-type", "NullTokenizer",
              "--micro-batch-size", "1",
              "--global-batch-size", str(2 * args.dp), "--tensor-model-parallel-size", str(args.tp),
              "--train-iters", str(args.iters), "--lr", "1e-4", "--log-interval", "1",
              "--save-interval", str(args.save_interval), "--hidden-dropout", "0", "--attention-dropout", "0"]
    root = args.save_dir or tempfile.mkdtemp(prefix="bench-checkpoint-")
    for stage in args.zero_stage:
        stalls, losses = {}, {}
        for mode in ("sync", "async"):
            directory = os.path.join(root, f"stage{stage}-{mode}")
            shutil.rmtree(directory, ignore_errors=True)
            flags = [*common, "--zero-stage", str(stage), "--save", directory,
                     "--data-cache-path", os.path.join(root, "cache")]
            lines = run_pretrain(world, flags + (["--async-save"] if mode == "async" else []))
            saved = [line["save_stall_s"] for line in lines[1:]  # the line after a save carries its stall
                     if (line["iteration"] - 1) % args.save_interval == 0]
            stalls[mode], losses[mode] = sum(saved) / len(saved), [line["loss"] for line in lines]
            from pretrain.checkpoint.catalog import read_manifest

            sizes = [file["bytes"] for file in read_manifest(directory)[1]["files"].values()]
            largest, fair = max(sizes), 12 * params / world
            one, two = (_resume_read_seconds(directory, 0, passes) for passes in (1, 2))
            rows.append(f"| {stage} | {mode} | {stalls[mode]:.3f} | "
                        + (f"{stalls['async'] / stalls['sync']:.3f}x" if mode == "async" else "1.000x")
                        + f" | {largest / 2**20:.1f} | {largest / fair:.2f}x | {one:.2f} | {two:.2f} | "
                          f"{losses[mode][-1]:.6f} |")
        assert losses["sync"] == losses["async"], "the background save changed the trajectory"
        print("\n".join(rows), flush=True)
    write_table(args.output, rows)
    if not args.save_dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
