"""Context parallelism: activation bytes per rank, cp bytes per step and step time at cp 1, 2, 4.

    python -m launch.bench.context [--cp 1 2 4] [--seq 4096] [--output runs/bench/context.md]

For each cp, a world of cp processes runs the transformer layers of a small GPT (no embedding or loss,
so only layers count) forward and backward on one sequence of --seq tokens, each rank holding its
zig-zag share, with every --cp-comm-type (p2p ring attention, a2a Ulysses, allgather; cp 1 is plain
fused attention). Measured beside the planner's formulas (``launch.tools.planning.layout_price``): saved bytes
against ``layer_elements`` (what a rank keeps of its S / cp tokens), bytes sent over the cp group
(counted by ``parallel.comm``) against ``context_bytes``. Step times are medians, as ratios to cp 1 in
the same run; on a machine with fewer cores than ranks they measure oversubscription as much as cp.
"""

from __future__ import annotations

import argparse
import statistics
import time

from launch.bench.world import add_worker_arguments, run_world, write_result, write_table
from launch.help_text import help_description

KINDS = ("p2p", "a2a", "allgather")


def _config(args: argparse.Namespace):
    from models.config import GPTConfig

    return GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                     seq_length=args.seq, vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)


def _worker(args: argparse.Namespace) -> None:
    import torch

    from models.gpt import GPTModel
    from parallel.context import ContextParallel, shard_sequence
    from parallel.process_groups import create_process_groups, init_distributed, shutdown_distributed
    from parallel.saved_activations import SavedActivationMeter
    from parallel.topology import Topology

    init_distributed()
    cp = args.cp[0]
    groups = create_process_groups(Topology(cp, cp=cp))
    config, results = _config(args), {}
    local = args.seq // cp
    positions = shard_sequence(torch.arange(args.seq).expand(args.batch, args.seq), cp, groups.cp_rank)
    for kind in KINDS if cp > 1 else ("fused",):
        context = ContextParallel(groups.cp, (kind,)) if cp > 1 else None
        model = GPTModel(config, groups.tp, seed=0, pre_process=False, post_process=False, context=context)
        meter, times, sent = SavedActivationMeter(), [], 0
        for step in range(args.steps + 1):
            hidden = torch.randn(local, args.batch, args.hidden, requires_grad=True,
                                 generator=torch.Generator().manual_seed(step * cp + groups.cp_rank))
            meter.reset()
            groups.stats.reset()
            started = time.perf_counter()
            with meter.recording():
                out = model(None, positions, hidden=hidden)
            out.float().square().mean().backward()
            if step > 0:
                times.append(time.perf_counter() - started)
                sent = groups.stats.bytes_by_axis().get("cp", 0)
        results[kind] = {"bytes": meter.peak_bytes, "sent": sent, "step_s": statistics.median(times)}
    write_result(args.worker_output, groups.rank, results)
    shutdown_distributed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.context",
                                     description=help_description(__doc__))
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output", default="runs/bench/context.md")
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    from launch.tools.planning.activation_price import layer_elements
    from launch.tools.planning.layout import Layout
    from launch.tools.planning.layout_price import context_bytes

    config = _config(args)
    measured = {}
    for cp in args.cp:
        forwarded = ["--worker", "--cp", str(cp), "--layers", str(args.layers), "--hidden", str(args.hidden),
                     "--heads", str(args.heads), "--seq", str(args.seq), "--batch", str(args.batch),
                     "--steps", str(args.steps)]
        measured[cp] = run_world("launch.bench.context", cp, forwarded)
    base = measured[args.cp[0]][0]["fused"] if 1 in measured else None
    rows = [f"layers {args.layers}, h {args.hidden}, {args.heads} heads, sequence {args.seq}, "
            f"batch {args.batch}, fp32; per rank (the most loaded)", "",
            "| cp | comm type | saved MiB | planner MiB | vs cp 1 | cp MiB sent / step | planner MiB | "
            "step s | vs cp 1 |", "|---|---|---|---|---|---|---|---|---|"]
    for cp, ranks in measured.items():
        layout = Layout(1, 1, 1, 0, micro_batch_size=args.batch, cp=cp)
        predicted = layer_elements(config, layout) * args.layers * 4
        for kind in ranks[0]:
            saved = max(rank[kind]["bytes"] for rank in ranks)
            sent = max(rank[kind]["sent"] for rank in ranks)
            step = max(rank[kind]["step_s"] for rank in ranks)
            formula = (sum(context_bytes(config, layout, 4, kind)) * args.layers if cp > 1 else 0.0)
            rows.append(f"| {cp} | {kind} | {saved / 2**20:.2f} | {predicted / 2**20:.2f} | "
                        + (f"{saved / base['bytes']:.3f}x" if base else "-") + f" | {sent / 2**20:.2f} | "
                        f"{formula / 2**20:.2f} | {step:.3f} | "
                        + (f"{step / base['step_s']:.2f}x" if base else "-") + " |")
            print(rows[-1], flush=True)
    write_table(args.output, rows)


if __name__ == "__main__":
    main()
