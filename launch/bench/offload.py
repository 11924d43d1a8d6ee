"""Peak memory and step time of ZeRO-2/3 with the optimizer and parameters in memory, on the CPU, or in
NVMe swap files, on a GPT whose optimizer states dominate its model states.

    python -m launch.bench.offload [--hidden-size 1024 --num-layers 16] [--zero-stage 2 3] [--dp 2]
                                   [--iters 4] [--nvme-path DIR]

Each configuration trains the same GPT from the same seed (so the losses must agree) on ``--dp``
processes, in bf16 with fp32 masters. Reported per rank, from the metrics of the last iteration: model
states held in memory, bytes in swap files, the share of those bytes that left memory (model states
in memory without offload minus with it, over the bytes in files), peak resident memory, and the mean
step time of the iterations after the first, as a ratio to the in-memory run measured in the same
invocation.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from launch.bench.world import write_table
from launch.pretrain_run import run_pretrain
from models.config import GPTConfig
from models.counting import num_parameters
from launch.help_text import help_description

SYSTEMS = {
    "in memory": [],
    "optimizer on CPU": ["--offload-optimizer", "cpu"],
    "optimizer on NVMe": ["--offload-optimizer", "nvme"],
    "optimizer + params on NVMe": ["--offload-optimizer", "nvme", "--offload-param", "nvme"],
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.offload",
                                     description=help_description(__doc__))
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, nargs="+", default=[3], choices=[2, 3])
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--sub-group-size", type=int, help="elements per optimizer sub-group (default: the "
                        "optimizer's, a twentieth of the rank's shard)")
    parser.add_argument("--nvme-path", help="where the swap files go (default: a temporary directory)")
    parser.add_argument("--output", default="runs/bench/offload.md")
    args = parser.parse_args(argv)
    if args.iters < 2:
        parser.error("--iters must be >= 2: the first iteration (which creates the states) is not timed")
    params = num_parameters(GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                      num_attention_heads=args.heads, seq_length=args.seq,
                                      vocab_size=args.vocab))
    rows = [f"GPT of {params / 1e6:.1f}M parameters, bf16 with fp32 masters and AdamW, dp {args.dp}, "
            f"{args.iters} iterations; per rank, last iteration", "",
            "| stage | system | step s | vs in memory | model states MiB | in swap files MiB | left memory "
            "| peak RSS MiB | final loss |", "|---|---|---|---|---|---|---|---|---|"]
    common = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
              "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq),
              "--micro-batch-size", "1",
              "--global-batch-size", str(args.dp), "--train-iters", str(args.iters), "--bf16",
              "--log-interval", "1", "--default-corpus-vocab-size", str(args.vocab),
              "--hidden-dropout", "0", "--attention-dropout", "0"]
    common += ["--zero-sub-group-size", str(args.sub_group_size)] if args.sub_group_size else []
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as swap:
        for stage in args.zero_stage:
            reference = None
            for name, flags in SYSTEMS.items():
                if "--offload-param" in flags and stage != 3:
                    continue
                nvme = ["--nvme-path", swap] if "nvme" in flags else []
                lines = run_pretrain(args.dp, common + ["--zero-stage", str(stage)] + flags + nvme)
                step = sum(line["step_time_s"] for line in lines[1:]) / len(lines[1:])
                ranks = lines[-1]["per_rank"]
                held, swapped, peak = (max(r[key] for r in ranks) for key in
                                       ("model_state_bytes", "offloaded_bytes", "peak_mem_bytes"))
                reference = reference or (step, held)
                left = f"{(reference[1] - held) / swapped:.0%}" if swapped else "-"
                rows.append(f"| {stage} | {name} | {step:.2f} | {step / reference[0]:.2f}x | "
                            f"{held / 2**20:.1f} | "
                            f"{swapped / 2**20:.1f} | {left} | {peak / 2**20:.0f} | "
                            f"{lines[-1]['loss']:.6f} |")
                print(rows[-1], flush=True)
        assert not os.listdir(swap), "a run left swap files behind"
    write_table(args.output, rows)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
