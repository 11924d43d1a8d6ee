"""Train a GPT whose model states exceed this machine's memory: ZeRO-3 with the optimizer states, fp32
masters and parameter shards in NVMe swap files (ZeRO-Infinity).

    python -m launch.examples.infinity_fits [--hidden-size 2560 --num-layers 24] [--iters 3] [--nvme-path DIR]

Prints the model-state bytes the GPT needs (``parallel.zero.memory``'s price in bf16: the parameter, an fp32
main gradient, an fp32 master and Adam's two moments, 18 bytes a parameter)
against the machine's memory, trains it for a few iterations and reports, per iteration, the step
time, peak resident memory, model states held in memory and bytes in swap files.
"""

from __future__ import annotations

import argparse
import tempfile

from launch.pretrain_run import machine_memory_bytes, run_pretrain
from models.config import GPTConfig
from models.counting import num_parameters
from parallel.zero.memory import expected_model_state_bytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.examples.infinity_fits",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=2560)
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--sub-group-size", type=int, default=100_000_000)
    parser.add_argument("--nvme-path", help="where the swap files go (default: a temporary directory)")
    args = parser.parse_args(argv)
    config = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.heads,
                       seq_length=128, vocab_size=4096)
    params, memory = num_parameters(config), machine_memory_bytes()
    states = expected_model_state_bytes(0, params, 1,
                                        2)  # bf16, whole: what all ranks hold together at stage 3
    print(f"GPT of {params / 1e9:.2f}B parameters: model states {states / 2**30:.1f} GiB "
          f"({states / params:.0f} "
          f"bytes per parameter), this machine has {memory / 2**30:.1f} GiB of memory", flush=True)
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as swap:
        lines = run_pretrain(args.nproc, [
            "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.heads), "--seq-length", "128", "--micro-batch-size", "1",
            "--global-batch-size", str(args.nproc), "--train-iters", str(args.iters),
            "--zero-stage", "3", "--bf16",
            "--offload-optimizer", "nvme", "--offload-param", "nvme", "--nvme-path", swap,
            "--zero-sub-group-size", str(args.sub_group_size), "--log-interval", "1",
            "--lr", "2e-5", "--lr-warmup-iters", "1", "--min-lr", "2e-6",
            "--default-corpus-vocab-size", "4096", "--hidden-dropout", "0", "--attention-dropout", "0"])
    for line in lines:
        ranks = line["per_rank"]
        print(f"iteration {line['iteration']}: {line['step_time_s']:.1f} s, loss {line['loss']:.4f}, "
              f"model states in memory {sum(r['model_state_bytes'] for r in ranks) / 2**30:.2f} GiB, in "
              "swap files "
              f"{sum(r['offloaded_bytes'] for r in ranks) / 2**30:.2f} GiB, peak resident "
              f"{sum(r['peak_mem_bytes'] for r in ranks) / 2**30:.2f} GiB (summed over {len(ranks)} ranks)")


if __name__ == "__main__":
    main()
