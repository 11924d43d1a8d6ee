"""One process, the project against a 60-line plain torch loop, on nanoGPT's CPU recipe for shakespeare_char.

    python -m launch.bench.one_process [--iters 2000] [--pairs 2] [--sequential] [--output
    runs/bench/one_process.md]

The recipe (nanoGPT's config/train_shakespeare_char.py with its CPU overrides): 4 layers, 4 heads, width
128, block 64, batch 12, no dropout, AdamW (lr 1e-3, betas 0.9 / 0.99, weight decay 0.1 on matrices),
100 warm-up iterations, cosine decay to 1e-4 at the last iteration, gradient clipping at 1.0, fp32, one
thread. The text is the built-in stdlib corpus (about shakespeare's size, no download), tokenized once by
a small sentencepiece vocabulary; both sides read the same token file, train on the same first 90% of
its tokens (whole documents) and are evaluated on the rest (20 batches at the end).

"ours" is ``python -m pretrain`` in a world of one (models.gpt, the ZeRO optimizer, the trainer); "plain"
is ``launch.bench.plain_gpt`` trained by ``_plain_loop`` below, what a newcomer writes. Each runs in its own
process. This machine's speed drifts by 10-20% within minutes, so by default the two run at the same
time, each pinned to a core of its own, and the second pair swaps the cores (``--sequential`` runs them
one after the other). The time per iteration is the loop's wall time (batches, forward, backward,
clipping, step, logging) from iteration 100 to the last log line before the final evaluation, divided
by the iterations; the table gives ours / plain for each pair.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

from launch.bench.world import write_table
from launch.help_text import help_description

RECIPE = {"layers": 4, "heads": 4, "width": 128, "block": 64, "batch": 12, "lr": 1e-3, "min_lr": 1e-4,
          "beta2": 0.99, "weight_decay": 0.1, "warmup": 100, "clip": 1.0, "eval_iters": 20}


def _plain_loop(args: argparse.Namespace) -> dict:
    """nanoGPT's training loop, in plain torch, on ``launch.bench.plain_gpt``."""
    import time

    import numpy
    import torch

    from launch.bench.plain_gpt import PlainGPT

    torch.manual_seed(1337)
    r = RECIPE
    tokens = numpy.memmap(args.data + ".bin", dtype=numpy.dtype(args.dtype), mode="r")
    train, valid = tokens[:args.valid_start], tokens[args.valid_start:]

    def batch(split):
        starts = torch.randint(len(split) - r["block"] - 1, (r["batch"],))
        window = [torch.from_numpy(split[i:i + r["block"] + 1].astype(numpy.int64)) for i in starts.tolist()]
        window = torch.stack(window)
        return window[:, :-1], window[:, 1:]

    def learning_rate(it):
        if it < r["warmup"]:
            return r["lr"] * (it + 1) / (r["warmup"] + 1)
        ratio = (it - r["warmup"]) / max(1, args.iters - r["warmup"])
        return r["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (r["lr"] - r["min_lr"])

    model = PlainGPT(args.vocab, r["width"], r["layers"], r["heads"], r["block"], seed=1337)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": r["weight_decay"]},
                                   {"params": others, "weight_decay": 0.0}],
                                  lr=r["lr"], betas=(0.9, r["beta2"]))
    timed_from = timed_to = None
    for it in range(args.iters):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(it)
        x, y = batch(train)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r["clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (it + 1) % args.log_interval == 0:
            print(f"iter {it + 1}: loss {loss.item():.4f}", flush=True)
            timed_from = timed_from or (it + 1, time.perf_counter())
            timed_to = (it + 1, time.perf_counter())
    model.eval()
    with torch.no_grad():
        valid_loss = sum(model(*batch(valid)).item() for _ in range(r["eval_iters"])) / r["eval_iters"]
    return {"iteration_s": (timed_to[1] - timed_from[1]) / (timed_to[0] - timed_from[0]),
            "valid_loss": valid_loss, "timed": timed_to[0] - timed_from[0]}


def _our_command(args: argparse.Namespace, corpus_flags: list[str], metrics: str) -> list[str]:
    """``python -m pretrain`` in a world of one on the recipe, writing its metrics lines to ``metrics``."""
    r = RECIPE
    flags = ["--num-layers", r["layers"], "--num-attention-heads", r["heads"], "--hidden-size", r["width"],
             "--seq-length", r["block"], "--micro-batch-size", r["batch"], "--global-batch-size", r["batch"],
             "--hidden-dropout", 0.0, "--attention-dropout", 0.0, "--lr", r["lr"], "--min-lr", r["min_lr"],
             "--adam-beta2", r["beta2"], "--weight-decay", r["weight_decay"],
             "--lr-warmup-iters", r["warmup"],
             "--lr-decay-style", "cosine", "--clip-grad", r["clip"], "--train-iters", args.iters,
             "--split", args.split, "--eval-interval", args.iters, "--eval-iters", r["eval_iters"],
             "--log-interval", args.log_interval, "--metrics-file", metrics, "--seed", 1337, *corpus_flags]
    return [sys.executable, "-m", "launch.torchrun", "--nproc", "1", *map(str, flags)]


def _our_result(metrics: str, log_interval: int) -> dict:
    """The loop's time per iteration from the metrics lines' wall clock, and the final validation loss."""
    with open(metrics) as handle:
        lines = [json.loads(line) for line in handle]
    timed = [line for line in lines if line["iteration"] % log_interval == 0 and "valid_loss" not in line]
    first, last = timed[0], timed[-1]
    return {"iteration_s": ((last["elapsed_s"] - first["elapsed_s"])
                            / (last["iteration"] - first["iteration"])),
            "valid_loss": lines[-1]["valid_loss"], "timed": last["iteration"] - first["iteration"]}


def _start(command: list[str], core: int | None) -> subprocess.Popen:
    pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=pin)


def _finish(name: str, process: subprocess.Popen) -> str:
    out, err = process.communicate()
    if process.returncode:
        sys.exit(f"{name} failed:\n{out[-2000:]}\n{err[-4000:]}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.one_process",
                                     description=help_description(__doc__))
    parser.add_argument("--iters", type=int, default=2000, help="training iterations (the recipe: 2000)")
    parser.add_argument("--pairs", type=int, default=2,
                        help="times to run both (the second swaps their cores)")
    parser.add_argument("--sequential", action="store_true", help="run the two one after the other, unpinned")
    parser.add_argument("--log-interval", type=int, default=100,
                        help="iterations between log lines (timed between)")
    parser.add_argument("--vocab", type=int, default=512, help="sentencepiece vocabulary of the corpus")
    parser.add_argument("--corpus-bytes", type=int, default=1_100_000, help="text size (shakespeare: 1.1 MB)")
    parser.add_argument("--cache-dir", default=os.path.join(".cache", "data"))
    parser.add_argument("--output", default="runs/bench/one_process.md")
    parser.add_argument("--plain-worker", action="store_true",
                        help="internal: run the plain loop, print JSON")
    parser.add_argument("--data", help="internal: the token file's prefix")
    parser.add_argument("--dtype", help="internal: its numpy dtype")
    parser.add_argument("--valid-start", type=int, help="internal: the first validation token")
    args = parser.parse_args(argv)
    if args.plain_worker:
        print("RESULT " + json.dumps(_plain_loop(args)))
        return
    if args.iters < 3 * args.log_interval:
        parser.error("--iters must be >= 3 x --log-interval: the loop is timed between its log lines")

    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from data.default_corpus import ensure_default_corpus

    prefix, _ = ensure_default_corpus(args.cache_dir, args.vocab, args.corpus_bytes)
    documents = IndexedDataset(prefix)
    # both split at the same document boundary, the first past 90% of the tokens (documents differ in size
    # by orders of magnitude: the last 10% of the documents can hold almost nothing)
    ends = numpy.cumsum(numpy.asarray(documents.sequence_lengths, dtype=numpy.int64))
    train_documents = min(len(ends) - 1, int(numpy.searchsorted(ends, 0.9 * ends[-1])) + 1)
    valid_start = int(ends[train_documents - 1])
    if ends[-1] - valid_start <= RECIPE["block"] + 1:
        parser.error(f"the corpus's last documents hold {ends[-1] - valid_start} tokens: too few to "
                     "validate on; "
                     "give a larger --corpus-bytes")
    args.split = f"{train_documents},{len(ends) - train_documents},0"  # Megatron's split: documents in order
    corpus_flags = ["--default-corpus-vocab-size", args.vocab,
                    "--default-corpus-max-bytes", args.corpus_bytes,
                    "--data-cache-dir", args.cache_dir]
    plain_command = [sys.executable, "-m", "launch.bench.one_process", "--plain-worker",
                     "--iters", str(args.iters),
                     "--log-interval", str(args.log_interval),
                     "--vocab", str(args.vocab), "--data", prefix, "--dtype", documents.index.dtype.__name__,
                     "--valid-start", str(valid_start)]
    rows = [f"nanoGPT's shakespeare_char CPU recipe on the stdlib corpus ({args.corpus_bytes:,} bytes, "
            "vocabulary "
            f"{args.vocab}), {args.iters} iterations, one process, one thread each, "
            f"{'sequential' if args.sequential else 'at the same time on cores of their own'}; time per "
            f"iteration of the whole loop after iteration {args.log_interval}\n",
            "| pair | ours ms/iter | plain ms/iter | ours / plain | ours valid loss | plain valid loss |",
            "|---|---|---|---|---|---|"]
    cores = sorted(os.sched_getaffinity(0))
    together = not args.sequential and len(cores) >= 2
    for pair in range(args.pairs):
        with tempfile.TemporaryDirectory() as directory:
            metrics = os.path.join(directory, "metrics.jsonl")
            ours_core, plain_core = (cores[pair % 2], cores[1 - pair % 2]) if together else (None, None)
            ours = _start(_our_command(args, corpus_flags, metrics), ours_core)
            if not together:
                _finish("our run", ours)
            plain = _start(plain_command, plain_core)
            plain = json.loads(_finish("the plain loop", plain).split("RESULT ", 1)[1])
            if together:
                _finish("our run", ours)
            ours = _our_result(metrics, args.log_interval)
        rows.append(f"| {pair + 1} | {ours['iteration_s'] * 1e3:.1f} | {plain['iteration_s'] * 1e3:.1f} | "
                    f"{ours['iteration_s'] / plain['iteration_s']:.3f}x | {ours['valid_loss']:.4f} | "
                    f"{plain['valid_loss']:.4f} |")
        print(rows[-1], flush=True)
    write_table(args.output, rows)


if __name__ == "__main__":
    main()
