"""A mixture of experts against the dense model of equal active parameters, and the MoE layer's own choices,
each run in a torchrun world of its own on the built-in corpus (real text, the same samples for every run):

    python -m launch.bench.moe [--size cpu|gpu] [--iters 40] [--nproc 2] [--output runs/bench/moe.md]

Rows: ``dense`` (an MLP of k x the expert width: the same active weights per token, data parallel over the
world), ``moe`` top-k of E experts, expert parallel over the world (ep = world), alltoall dispatcher, one
product per expert; ``moe grouped`` the same with --moe-grouped-gemm; ``moe allgather`` with the allgather
dispatcher. Each reports the median step time of the second half of the iterations, tokens/s, its ratio to
the dense run's, the loss at the end (equal tokens for every row), the balancing loss and the expert load
(most tokens an expert received over the mean, worst layer), and the all-to-all bytes a rank sent per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from launch.bench.world import write_table
from launch.help_text import help_description

SIZES = {  # layers, width, heads, expert width, experts, top-k, tokens, micro-batch, global batch
    "cpu": (4, 256, 4, 256, 8, 2, 256, 4, 16),
    "gpu": (16, 2048, 16, 1024, 8, 2, 2048, 4, 64),
}


def flags(size: str) -> tuple[list[str], list[str]]:
    """(the dense run's flags, the MoE run's), the common shape first."""
    layers, width, heads, expert, experts, topk, tokens, micro, batch = SIZES[size]
    common = ["--num-layers", str(layers), "--hidden-size", str(width), "--num-attention-heads", str(heads),
              "--seq-length", str(tokens), "--micro-batch-size", str(micro), "--global-batch-size",
              str(batch),
              "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
              "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3",
              "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "0", "--sample-prompt", ""]
    dense = common + ["--ffn-hidden-size", str(topk * expert)]
    moe = common + ["--ffn-hidden-size", str(topk * expert), "--num-experts", str(experts),
                    "--moe-ffn-hidden-size", str(expert), "--moe-router-topk", str(topk),
                    "--moe-aux-loss-coeff", "1e-2"]
    return dense, moe


def run(nproc: int, argv: list[str], iters: int) -> dict:
    """One run in a world of its own: its metrics lines, summarised."""
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as directory:
        metrics = os.path.join(directory, "metrics.jsonl")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "pretrain", *argv, "--train-iters", str(iters), "--metrics-file", metrics]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)),
                   WANDB_MODE="disabled")
        job = subprocess.run(command, capture_output=True, text=True, env=env)
        if job.returncode:
            return {"error": job.stderr.strip()[-2000:]}
        with open(metrics) as handle:
            lines = [json.loads(line) for line in handle if '"loss"' in line]
    timed = lines[len(lines) // 2:]
    step = statistics.median(line["step_time_s"] for line in timed)
    return {"step_s": step, "tokens_per_s": lines[-1]["batch_size"] * _tokens(argv) / step,
            "loss": lines[-1]["loss"], "aux_loss": lines[-1].get("moe_aux_loss"),
            "load": lines[-1].get("moe_load_max_over_mean_worst"),
            "all_to_all_bytes": statistics.median(line["per_rank"][0]["comm_bytes"]["all_to_all"]
                                                  for line in timed)}


def _tokens(argv: list[str]) -> int:
    return int(argv[argv.index("--seq-length") + 1])


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.moe", description=help_description(__doc__))
    parser.add_argument("--size", choices=tuple(SIZES), default="cpu")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2, help="ranks per world (ep of the MoE runs)")
    parser.add_argument("--output", default="runs/bench/moe.md")
    args = parser.parse_args(argv)
    dense, moe = flags(args.size)
    ep = ["--expert-model-parallel-size", str(args.nproc)]
    systems = {"dense": dense,
               "moe": moe + ep + ["--moe-token-dispatcher-type", "alltoall"],
               "moe grouped": moe + ep + ["--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"],
               "moe allgather": moe + ep + ["--moe-token-dispatcher-type", "allgather"]}
    results = {name: run(args.nproc, system, args.iters) for name, system in systems.items()}
    base = results["dense"].get("tokens_per_s")
    rows = [f"| system ({args.size}, {args.nproc} ranks, {args.iters} iterations) | step s | tokens/s | "
            "vs dense | loss at the end | balancing loss | expert load max/mean | all-to-all MiB/rank/step |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {name} | failed: {r['error'].splitlines()[-1][:100]} | | | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "n/a"
        extra = [f"{r['aux_loss']:.4f}" if r["aux_loss"] is not None else "-",
                 f"{r['load']:.2f}" if r["load"] is not None else "-"]
        rows.append(f"| {name} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {ratio} | {r['loss']:.4f} | "
                    f"{' | '.join(extra)} | {r['all_to_all_bytes'] / 2**20:.2f} |")
    print("\n".join(rows))
    write_table(args.output, rows)
    return rows


if __name__ == "__main__":
    main()
