"""Show a GPT that plain data parallelism cannot hold on this machine training at dp 8 with ZeRO-3.

    python -m launch.examples.stage3_fits [--hidden-size 1536 --num-layers 8] [--iters 2]

Prints the model-state bytes that dp 8 needs per machine without sharding (8 replicas of what
``parallel.zero.memory`` prices at stage 0 in fp32: parameters, gradients, Adam's two moments, 16 bytes
a parameter) against the machine's memory, then
trains the same GPT for a few iterations with --zero-stage 3 on 8 processes and reports what the
ranks measured (model-state bytes, peak resident memory), read from the metrics file.
"""

from __future__ import annotations

import argparse

from launch.pretrain_run import machine_memory_bytes, run_pretrain
from models.config import GPTConfig
from models.counting import num_parameters
from parallel.zero.memory import expected_model_state_bytes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.examples.stage3_fits",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=1536)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--dp", type=int, default=8)
    args = parser.parse_args(argv)
    config = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=16,
                       seq_length=128, vocab_size=4096)
    params, memory = num_parameters(config), machine_memory_bytes()
    replicas = expected_model_state_bytes(0, params, args.dp, 4) * args.dp
    per_rank = expected_model_state_bytes(3, params, args.dp, 4)
    print(f"GPT of {params / 1e6:.0f}M parameters; plain data parallelism at dp {args.dp} holds "
          f"{replicas / 2**30:.1f} GiB of model states on this machine ({memory / 2**30:.1f} GiB): "
          f"{'does not fit' if replicas > memory else 'fits'}; ZeRO-3 needs {per_rank * args.dp / 2**30:.1f} "
          "GiB in all")
    last = run_pretrain(args.dp, [
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", "16",
        "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", str(args.dp),
        "--train-iters", str(args.iters), "--zero-stage", "3", "--log-interval", "1",
        "--default-corpus-vocab-size", "4096", "--hidden-dropout", "0", "--attention-dropout", "0"])[-1]
    ranks = last["per_rank"]
    print(f"trained {args.iters} iterations at dp {args.dp} with ZeRO-3, {last['step_time_s']:.1f} "
          "s/iteration, "
          f"loss {last['loss']:.3f}: model states "
          f"{max(r['model_state_bytes'] for r in ranks) / 2**20:.0f} MiB "
          f"per rank (predicted {per_rank / 2**20:.0f} MiB), peak resident "
          f"{sum(r['peak_mem_bytes'] for r in ranks) / 2**30:.1f} GiB during the last iteration, summed "
          "over ranks")


if __name__ == "__main__":
    main()
