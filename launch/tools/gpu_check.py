"""One-shot check of a GPU machine, in one process (under 8 minutes on one H200):

    python -m launch.tools.gpu_check            # on a GPU: 1.3B GPT, ZeRO stages and offload, flash attention
    python -m launch.tools.gpu_check --smoke    # the same checks on a tiny GPT on the CPU (CI runs this)

1. torch, CUDA and NCCL versions and the process-group backend;
2. a 1.3B GPT (GPT-3 XL) in bf16, dp = tp = pp = 1, micro-batch 4, 20 iterations on mock data: tokens/s,
   MFU against the device's data-sheet peak, and peak memory beside the planner's prediction
   (``launch.tools.planning.plan``);
3. ZeRO stages 0-3 and the optimizer offloaded to the CPU and to NVMe swap files, 5 iterations each, against
   the in-memory stage-0 run (bf16 losses within 1e-3 relative: other kernels step the offloaded masters);
4. the flash scaled-dot-product-attention kernel runs our attention, forward and backward.

Prints one line per check and exits non-zero if one fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

FULL = ["--config", "launch/configs/presets/gpt-1.3b.yaml", "--micro-batch-size", "4",
        "--global-batch-size", "4",
        "--zero-stage", "0", "--recompute-granularity", "selective", "--train-iters", "20",
        "--lr-warmup-iters", "2"]
ZERO = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
        "--max-position-embeddings", "1024", "--micro-batch-size", "2", "--global-batch-size", "4", "--bf16",
        "--lr-warmup-iters", "1"]  # about 100M parameters: 11 runs of 5 iterations, NVMe included, in minutes
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--bf16",
        "--train-iters", "3", "--lr-warmup-iters", "1"]
COMMON = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257", "--lr", "1e-4",
          "--log-interval", "1", "--sample-prompt", "", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--eval-iters", "0", "--seed", "1234"]


def _train(flags: list[str], device: torch.device, workdir: str, name: str) -> list[dict]:
    """Train with ``flags`` in this process; return the metrics lines."""
    from pretrain.config.arguments import parse_config
    from pretrain.training.trainer import Trainer
    from pretrain.startup.validation import validate

    metrics = os.path.join(workdir, f"{name}.jsonl")
    config = parse_config(COMMON + flags + ["--metrics-file", metrics, "--data-cache-path", workdir])
    Trainer(config, validate(config, 1), device).train()
    with open(metrics) as handle:
        return [json.loads(line) for line in handle]


def check_versions(device: torch.device) -> None:
    import torch.distributed as dist

    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__} | CUDA {torch.version.cuda} | NCCL {nccl} | backend "
          f"{dist.get_backend()} "
          f"| device {name}", flush=True)


def check_throughput(base: list[str], device: torch.device, workdir: str) -> None:
    from launch.tools.planning.plan import Layout, plan_layout
    from pretrain.config.arguments import parse_config

    records = _train(base, device, workdir, "throughput")
    timed = records[len(records) // 4:] or records  # past the first iterations (allocator, autotuning)
    step = sorted(r["step_time_s"] for r in timed)[len(timed) // 2]
    last = records[-1]
    config = parse_config(COMMON + base)
    train = config.training
    predicted = plan_layout(config.model, Layout(1, 1, 1, 0, config.recompute.recompute_granularity,
                                                 train.micro_batch_size), train.global_batch_size, 2)
    peak = max(r["peak_mem_bytes"] for r in last["per_rank"])
    mfu = (f"MFU {sorted(r['mfu'] for r in timed)[len(timed) // 2]:.1%}" if "mfu" in last
           else "MFU n/a (peak unknown)")
    print(f"throughput: {last['per_rank'][0]['parameters']:,} "
          f"parameters, median step {step:.3f} s, "
          f"{train.global_batch_size * config.model.seq_length / step:,.0f} "
          f"tokens/s, {mfu}; loss {records[0]['loss']:.3f} -> {last['loss']:.3f}; peak memory "
          f"{peak / 2**30:.2f} GiB "
          f"(planner {predicted.total_bytes / 2**30:.2f} GiB)", flush=True)


def check_zero(base: list[str], device: torch.device, workdir: str) -> bool:
    runs = {"stage 0": ["--zero-stage", "0"]}
    for stage in (1, 2, 3):
        runs[f"stage {stage}"] = ["--zero-stage", str(stage)]
        runs[f"stage {stage} + cpu offload"] = ["--zero-stage", str(stage), "--offload-optimizer", "cpu"]
        runs[f"stage {stage} + nvme offload"] = ["--zero-stage", str(stage), "--offload-optimizer", "nvme",
                                                 "--nvme-path", workdir]
    runs["stage 3 + nvme parameters"] = ["--zero-stage", "3", "--offload-optimizer", "nvme",
                                         "--offload-param", "nvme",
                                         "--nvme-path", workdir]
    reference, ok = None, True
    for name, flags in runs.items():
        started = time.perf_counter()
        records = _train(base + flags + ["--train-iters", "5"], device, workdir, name.replace(" ", "_"))
        losses = [r["loss"] for r in records]
        reference = reference or losses
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        ok &= worst <= 1e-3
        print(f"zero {name:<28} losses {' '.join(f'{x:.4f}' for x in losses)} | worst relative difference to "
              "stage 0 "
              f"{worst:.1e} {'ok' if worst <= 1e-3 else 'FAILED'} ({time.perf_counter() - started:.0f} s)",
              flush=True)
    return ok


def check_flash_attention(device: torch.device) -> bool:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.config import GPTConfig
    from models.gpt import GPTModel
    from parallel.comm import AxisGroup, CommStats

    alone = AxisGroup("tp", (0,), None, CommStats())
    config = GPTConfig(num_layers=1, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=128,
                       max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = GPTModel(config, alone, seed=0).to(device, dtype)
    tokens = torch.randint(0, 128, (2, 128), device=device)
    positions = torch.arange(128, device=device).expand(2, 128)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            model(tokens, positions, labels=tokens).float().mean().backward()
    except RuntimeError as error:
        print(f"flash attention: FAILED ({str(error).splitlines()[0]})", flush=True)
        return False
    print(f"flash attention: ok (our GPT's forward and backward with only the flash kernel allowed, {dtype})",
          flush=True)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.tools.gpu_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny GPT on the CPU: the checks, not the numbers")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("error: no GPU here; run with --smoke for the CPU version of the checks")
    os.environ.setdefault("WANDB_MODE", "disabled")
    from parallel.process_groups import init_distributed, shutdown_distributed

    device = init_distributed()
    if args.smoke:  # on the CPU even where a GPU exists
        device = torch.device("cpu")
    base = TINY if args.smoke else FULL
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        check_versions(device)
        check_throughput(base, device, workdir)
        ok = check_zero(TINY if args.smoke else ZERO, device, workdir)
        ok &= check_flash_attention(device)
    shutdown_distributed()
    print(f"gpu check {'passed' if ok else 'FAILED'} in {time.perf_counter() - started:.0f} s", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
