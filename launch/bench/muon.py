"""Muon against AdamW in this stack: the loss at equal tokens, the tokens Muon needs to reach AdamW's final
loss, and the step time and bytes sent per rank at dp 2 and dp 4, each run in its own world.

    python -m launch.bench.muon [--iters 300] [--hidden-size 256 --num-layers 4] [--lr 2e-3] [--dp 2 4]

Both runs read the default corpus (Python's standard library, which neither optimizer's settings were
tuned on) from the same seed and schedule. AdamW takes Megatron's defaults; Muon takes Moonlight's rule
(spectral scale x 0.2: the update's RMS matched to AdamW's, so both share --lr and --weight-decay) on the
layers' matrices and AdamW on the rest. The losses are averaged over a window of 10 iterations; "tokens
to AdamW's final" is where Muon's average first falls to AdamW's last one. Step times are the mean over
the iterations after the first, bytes those sent per rank in the last iteration (``all_to_all`` carries
Muon's gathers to each matrix's owner and back: under ZeRO 1-2 most matrices lie whole on their owner,
under ZeRO 3 every one is split over the ranks); ratios are Muon's over AdamW's in the same invocation.
On a CPU, Megatron's default bf16 iterations (medium) run slower than fp32 ones would.
"""

from __future__ import annotations

import argparse

from launch.bench.world import write_table
from launch.help_text import help_description
from launch.pretrain_run import run_pretrain

ADAMW = ["--optimizer", "adam"]
MUON = ["--optimizer", "muon", "--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2"]
WINDOW = 10


def _smoothed(losses: list[float]) -> list[float]:
    return [sum(losses[max(0, i - WINDOW + 1):i + 1]) / len(losses[max(0, i - WINDOW + 1):i + 1])
            for i in range(len(losses))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.muon",
                                     description=help_description(__doc__))
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cost-iters", type=int, default=6, help="iterations of each step-time run")
    parser.add_argument("--zero-stage", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--output", default="runs/bench/muon.md")
    args = parser.parse_args(argv)
    if args.iters < WINDOW or args.cost_iters < 2:
        parser.error(f"--iters must be >= {WINDOW} and --cost-iters >= 2 (the first step is not timed)")
    model = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
             "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq), "--log-interval", "1",
             "--lr", str(args.lr), "--min-lr", str(args.lr / 10), "--lr-decay-style", "cosine",
             "--lr-warmup-iters", str(max(1, args.iters // 20)), "--weight-decay", "0.1",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "1"]
    tokens = args.global_batch * args.seq
    runs = {name: run_pretrain(1, model + flags + ["--global-batch-size", str(args.global_batch),
                                                   "--train-iters", str(args.iters)])
            for name, flags in (("AdamW", ADAMW), ("Muon", MUON))}
    curves = {name: _smoothed([line["loss"] for line in lines]) for name, lines in runs.items()}
    target = curves["AdamW"][-1]
    reached = next((i + 1 for i, loss in enumerate(curves["Muon"]) if loss <= target), None)
    rows = [f"GPT {args.num_layers} x {args.hidden_size}, {args.iters} iterations of {tokens} tokens, lr "
            f"{args.lr}, one process; losses averaged over {WINDOW} iterations", "",
            "| optimizer | loss at 25% | 50% | 100% of the tokens | tokens to AdamW's final |",
            "|---|---|---|---|---|"]
    for name, curve in curves.items():
        marks = [curve[max(0, len(curve) * share // 4 - 1)] for share in (1, 2, 4)]
        to_target = f"{reached * tokens:,} ({reached / args.iters:.0%})" if name == "Muon" and reached \
            else ("not reached" if name == "Muon" else f"{args.iters * tokens:,}")
        rows.append(f"| {name} | " + " | ".join(f"{mark:.4f}" for mark in marks) + f" | {to_target} |")
    rows += ["", f"{args.cost_iters} iterations per run; per rank, Muon / AdamW", "",
             "| ZeRO | dp | AdamW step s | Muon step s | ratio | AdamW MiB sent | Muon MiB sent "
             "| of which all_to_all | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for stage, dp in ((stage, dp) for stage in args.zero_stage for dp in args.dp):
        measured = {}
        for name, flags in (("AdamW", ADAMW), ("Muon", MUON)):
            lines = run_pretrain(dp, model + flags + ["--global-batch-size", str(args.global_batch),
                                                      "--train-iters", str(args.cost_iters),
                                                      "--zero-stage", str(stage)])
            step = sum(line["step_time_s"] for line in lines[1:]) / len(lines[1:])
            sent = max(sum(rank["comm_bytes"].values()) for rank in lines[-1]["per_rank"])
            exchange = max(rank["comm_bytes"].get("all_to_all", 0) for rank in lines[-1]["per_rank"])
            measured[name] = (step, sent, exchange)
        (a_step, a_sent, _), (m_step, m_sent, m_exchange) = measured["AdamW"], measured["Muon"]
        rows.append(f"| {stage} | {dp} | {a_step:.3f} | {m_step:.3f} | {m_step / a_step:.2f}x | "
                    f"{a_sent / 2**20:.2f} | {m_sent / 2**20:.2f} | {m_exchange / 2**20:.2f} | "
                    f"{m_sent / a_sent:.2f}x |")
        print(rows[-1], flush=True)
    write_table(args.output, rows)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
