"""Saved-activation bytes per micro-batch and step time for each recompute policy, beside the formulas.

    python -m launch.bench.activations [--tp 2] [--layers 4 8 16] [--output runs/bench/activations.md]

On a tensor-parallel world of --tp processes, the transformer layers of a GPT (no embedding or loss,
so only layers count) run forward + backward on one micro-batch under: no recompute, selective
(attention core), selective --recompute-modules mlp layernorm (the MLP checkpointed, the norms' outputs
dropped: 4sbh(3 + 4/t)), full (every layer input kept), full with partitioned inputs. Measured bytes come
from saved-tensor hooks. Beside them: Korthikanti et al.'s per-layer formulas, written for 16-bit
activations with dropout and an unfused attention (sbh(10 + 24/t + 5as/(ht)) without recompute,
2sbh with full recompute, 2sbh/t partitioned), and the same accounting for what this run does (fp32,
no dropout, fused attention that keeps no s x s matrix: 4sbh(4 + 12/t), 4sbh, 4sbh/t).
"""

from __future__ import annotations

import argparse
import statistics
import time

from launch.bench.world import add_worker_arguments, run_world, write_result, write_table
from launch.help_text import help_description

POLICIES = ("none", "selective", "mlp+layernorm", "full", "full+partitioned")


def _worker(args: argparse.Namespace) -> None:
    import torch

    from models.config import GPTConfig
    from models.gpt import GPTModel
    from parallel.recompute import RecomputePolicy, apply_recompute
    from parallel.process_groups import create_process_groups, init_distributed, shutdown_distributed
    from parallel.saved_activations import SavedActivationMeter
    from parallel.topology import Topology

    init_distributed()
    groups = create_process_groups(Topology(args.tp, tp=args.tp))
    policies = {"none": RecomputePolicy(), "selective": RecomputePolicy("selective"),
                "mlp+layernorm": RecomputePolicy("selective", modules=("mlp", "layernorm")),
                "full": RecomputePolicy("full", 1, "uniform"),
                "full+partitioned": RecomputePolicy("full", 1, "uniform", partition=True)}
    results = {}
    for layers in args.layers:
        config = GPTConfig(num_layers=layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                           seq_length=args.seq, vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)
        for name, policy in policies.items():
            model = GPTModel(config, groups.tp, seed=0, pre_process=False, post_process=False)
            apply_recompute(torch.nn.ModuleList([model]), policy, groups.tp)
            meter, times = SavedActivationMeter(), []
            positions = torch.arange(args.seq).expand(args.batch, args.seq)
            for step in range(args.steps + 1):
                hidden = torch.randn(args.seq, args.batch, args.hidden, requires_grad=True,
                                     generator=torch.Generator().manual_seed(step))
                meter.reset()
                started = time.perf_counter()
                with meter.recording():
                    out = model(None, positions, hidden=hidden)
                out.float().square().mean().backward()
                if step > 0:
                    times.append(time.perf_counter() - started)
            results[f"{layers}/{name}"] = {"bytes": meter.peak_bytes, "step_s": statistics.median(times)}
    write_result(args.worker_output, groups.rank, results)
    shutdown_distributed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.activations",
                                     description=help_description(__doc__))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output", default="runs/bench/activations.md")
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    forwarded = ["--worker", "--tp", str(args.tp), "--hidden", str(args.hidden), "--heads", str(args.heads),
                 "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
                 "--layers", *map(str, args.layers)]
    result = run_world("launch.bench.activations", args.tp, forwarded)[0]
    s, b, h, a, t = args.seq, args.batch, args.hidden, args.heads, args.tp
    sbh = s * b * h
    korthikanti = {"none": sbh * (10 + 24 / t + 5 * a * s / (h * t)), "selective": sbh * (10 + 24 / t),
                   "mlp+layernorm": None, "full": 2 * sbh, "full+partitioned": 2 * sbh / t}
    ours = {"none": 4 * sbh * (4 + 12 / t), "selective": 4 * sbh * (4 + 12 / t),
            "mlp+layernorm": 4 * sbh * (3 + 4 / t), "full": 4 * sbh, "full+partitioned": 4 * sbh / t}
    rows = [f"s={s} b={b} h={h} a={a} tp={t}, fp32, per micro-batch (MiB)", "",
            "| layers | policy | measured | this run's accounting | Korthikanti (16-bit, dropout) | step s | "
            "time vs none |", "|---|---|---|---|---|---|---|"]
    for layers in args.layers:
        base = result[f"{layers}/none"]["step_s"]
        for name in POLICIES:
            entry = result[f"{layers}/{name}"]
            rows.append(f"| {layers} | {name} | {entry['bytes'] / 2**20:.2f} | "
                        f"{layers * ours[name] / 2**20:.2f} | "
                        + (f"{layers * korthikanti[name] / 2**20:.2f}" if korthikanti[name] else "n/a")
                        + f" | {entry['step_s']:.3f} | "
                        f"{entry['step_s'] / base:.2f}x |")
            print(rows[-1], flush=True)
    write_table(args.output, rows)


if __name__ == "__main__":
    main()
