"""One-shot check of a GPU machine (``--sections`` picks the checks; all take about 10 minutes on one H200):

    python -m launch.tools.gpu_check            # on a GPU: the shapes of GPT-3 XL and Llama-3.2-1B
    python -m launch.tools.gpu_check --smoke    # the same checks on tiny models on the CPU (CI runs this)

1. ``versions``: torch, CUDA and NCCL versions and the process-group backend;
2. ``throughput``: ``launch.bench.throughput``: ours eager and ``--compile`` against transformers' model of
   the same shape eager and under torch.compile, GPT-3 XL and the Llama-1B shape in bf16, micro-batch 4 x
   2048 tokens, each in a process of its own: tokens/s, MFU, peak memory; beside each of ours the
   planner's predicted peak (``launch.tools.planning.plan``);
3. ``documents``: packed documents (--reset-attention-mask ...) against the plain run, eager and compiled;
4. ``profiler``: ``--profile --use-pytorch-profiler`` writes a Chrome trace that parses, and (GPU)
   ``--record-memory-history`` a memory snapshot that loads;
5. ``zero``: ZeRO stages 0-3 and the optimizer offloaded to the CPU and to NVMe swap files, 5 iterations each,
   against the in-memory stage-0 run (bf16 losses within 1e-3 relative: other kernels step the offloaded
   masters);
6. ``flash``: the flash scaled-dot-product-attention kernel runs our attention, forward and backward;
7. ``fp8``: ``--fp8-format hybrid`` (torchao, tensorwise scales) against bf16 on the Llama shape, both
   compiled (emulated on the CPU: the check, not the speed);
8. ``moe``: the Llama shape with its MLPs as top-2 of 8 experts of half the width (the same active
   weights), the experts as one grouped product and as a loop, against the dense model, compiled (eager in
   the smoke run): tokens/s, and that the grouped product runs on the device;
9. ``rates``: ``launch.bench.device_rates``: the device's achieved product, attention and copy rates,
   written as a profile (runs/bench/device_profile.json) that ``launch.plan --device FILE`` reads.

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


def check_throughput(size: str, iters: int, shapes: list[str]) -> list[dict]:
    """``launch.bench.throughput``: ours eager and compiled against transformers' model eager and compiled,
    GPT-3 XL and the Llama-1B shape (``size`` gpu; tiny on --smoke), each in a process of its own."""
    from launch.bench.throughput import main as throughput

    return throughput(["--size", size, "--iters", str(iters), "--shapes", *shapes, "--output",
                       f"runs/bench/gpu_check_throughput_{'_'.join(shapes)}.md"])


def check_planner(size: str, results: list[dict]) -> None:
    """The planner's predicted peak beside the measured peak of ours, eager and compiled, per shape."""
    from launch.bench.throughput import shape_flags
    from launch.tools.planning.plan import Layout, plan_layout
    from pretrain.config.arguments import parse_config

    for shape in dict.fromkeys(r["shape"] for r in results):
        config = parse_config(shape_flags(size, shape) + ["--bf16"])
        predicted = plan_layout(config.model, Layout(1, 1, 1, 0, None, config.training.micro_batch_size),
                                config.training.micro_batch_size, 2).total_bytes
        for r in results:
            if r["shape"] == shape and r["system"].startswith("ours") and "peak_bytes" in r:
                print(f"planner {shape} {r['system']}: predicted {predicted / 2**30:.2f} GiB, measured "
                      f"{r['peak_bytes'] / 2**30:.2f} GiB ({predicted / r['peak_bytes'] - 1:+.1%})",
                      flush=True)


def check_documents(size: str, iters: int) -> None:
    """Packed documents (--reset-attention-mask --reset-position-ids --eod-mask-loss) against the plain run,
    ours eager and compiled, on the GPT shape."""
    from launch.bench.throughput import run_system

    documents = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
    for system in ("ours", "ours-compiled"):
        plain, masked = (run_system(size, "gpt", system, iters, flags) for flags in ([], documents))
        if "error" in plain or "error" in masked:
            error = plain.get("error") or masked.get("error")
            print(f"documents {system}: FAILED {error.splitlines()[-1]}", flush=True)
            continue
        print(f"documents {system}: {masked['tokens_per_s']:,.0f} tokens/s masked against "
              f"{plain['tokens_per_s']:,.0f} plain ({masked['tokens_per_s'] / plain['tokens_per_s']:.2f}x)",
              flush=True)


def check_fp8(size: str, iters: int) -> bool:
    """--fp8-format hybrid against bf16, both under --compile, on the Llama shape (tokens/s and loss)."""
    from launch.bench.throughput import run_system

    bf16_flags = ["--bf16"]  # on the GPU the benchmark's own dtype; on the CPU what fp8 runs inside
    fp8_flags = bf16_flags + ["--fp8-format", "hybrid"] + (["--fp8-emulate"] if size == "smoke" else [])
    bf16, float8 = (run_system(size, "llama", "ours-compiled", iters, flags)
                    for flags in (bf16_flags, fp8_flags))
    if "error" in bf16 or "error" in float8:
        print(f"fp8: FAILED {(bf16.get('error') or float8.get('error')).splitlines()[-1]}", flush=True)
        return False
    print(f"fp8: {float8['tokens_per_s']:,.0f} tokens/s against bf16's {bf16['tokens_per_s']:,.0f} "
          f"({float8['tokens_per_s'] / bf16['tokens_per_s']:.2f}x), peak {float8['peak_bytes'] / 2**30:.1f} "
          f"against {bf16['peak_bytes'] / 2**30:.1f} GiB", flush=True)
    return True


def check_moe(size: str, iters: int) -> bool:
    """A top-2-of-8 MoE of equal active weights against the dense Llama shape, grouped product and loop."""
    from launch.bench.throughput import SIZES, run_system

    width = SIZES[size]["llama"][4] // 2
    moe = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", str(width),
           "--moe-aux-loss-coeff", "1e-2"]
    system = "ours" if size == "smoke" else "ours-compiled"
    variants = (("dense", []), ("moe loop", moe), ("moe grouped", moe + ["--moe-grouped-gemm"]))
    runs = {name: run_system(size, "llama", system, iters, flags) for name, flags in variants}
    failed = [f"{name}: {r['error'].splitlines()[-1]}" for name, r in runs.items() if "error" in r]
    if failed:
        print(f"moe: FAILED {'; '.join(failed)}", flush=True)
        return False
    dense = runs["dense"]["tokens_per_s"]
    rates = [f"{name} {r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s'] / dense:.2f}x)"
             for name, r in runs.items()]
    print(f"moe ({system}): " + ", ".join(rates), flush=True)
    return True


def check_hybrid(size: str, iters: int) -> bool:
    """A Nemotron-H-like hybrid (Mamba-2 and MLP layers, one attention layer in eight), a Qwen3-Next-like
    one (gated delta nets and MLPs, attention in one layer of four) and a Kimi-Linear-like one (Kimi delta
    attention in their place) against the Llama shape of the same width, in the same run: tokens/s and
    peak, and the kernels the mixers use (``models.mamba.kernels``, ``models.gdn.kernels``,
    ``models.kda.kernels``: mamba-ssm's or fla's where installed, else the PyTorch references)."""
    from launch.bench.throughput import SIZES, run_system
    from models.gdn.kernels import delta_rule_backend
    from models.mamba.kernels import scan_backend

    layers = SIZES[size]["llama"][0]
    pattern = "".join("*-" if i % 4 == 0 else "M-" for i in range(layers))  # as many layers of two parts
    width = SIZES[size]["llama"][1]
    hybrid = ["--hybrid-layer-pattern", pattern, "--mamba-head-dim", str(min(64, width // 4)),
              "--mamba-num-groups", "2" if size == "smoke" else "8",
              "--mamba-state-dim", "16" if size == "smoke" else "128"]
    heads = 2 if size == "smoke" else 8
    gated = ["--hybrid-layer-pattern", "".join("*-" if i % 4 == 0 else "G-" for i in range(layers)),
             "--linear-num-key-heads", str(heads), "--linear-num-value-heads", str(2 * heads),
             "--linear-key-head-dim", str(min(128, width // heads)),
             "--linear-value-head-dim", str(min(128, width // heads))]
    kimi = ["--hybrid-layer-pattern", "".join("*-" if i % 4 == 0 else "K-" for i in range(layers)),
            *gated[4:6], *gated[8:]]  # (Kimi delta attention: the value heads and width)
    system = "ours" if size == "smoke" else "ours-compiled"
    runs = {name: run_system(size, "llama", system, iters, flags)
            for name, flags in (("llama", []), ("hybrid", hybrid), ("gated delta", gated),
                                ("kimi delta", kimi))}
    failed = [f"{name}: {r['error'].splitlines()[-1]}" for name, r in runs.items() if "error" in r]
    if failed:
        print(f"hybrid: FAILED {'; '.join(failed)}", flush=True)
        return False
    device = torch.device("cuda" if size != "smoke" else "cpu")
    backends = {"hybrid": f"scan: {scan_backend(device, documents=False)}",
                "gated delta": f"delta rule: {delta_rule_backend(device)}",
                "kimi delta": f"delta rule (per channel): {delta_rule_backend(device)}"}
    llama = runs["llama"]
    for name, kernel in backends.items():
        mixed = runs[name]
        ratio = mixed["tokens_per_s"] / llama["tokens_per_s"]
        print(f"{name} ({system}, {kernel}): {mixed['tokens_per_s']:,.0f} tokens/s against the Llama "
              f"shape's {llama['tokens_per_s']:,.0f} ({ratio:.2f}x), peak {mixed['peak_bytes'] / 2**30:.2f} "
              f"against {llama['peak_bytes'] / 2**30:.2f} GiB", flush=True)
    return True


def check_profiler(base: list[str], device: torch.device, workdir: str) -> bool:
    """--profile --use-pytorch-profiler writes a Chrome trace that parses; on a GPU --record-memory-history
    writes torch's memory snapshot, which loads."""
    import glob
    import pickle

    flags = base + ["--train-iters", "4", "--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                    "--profile-step-end", "3", "--tensorboard-dir", os.path.join(workdir, "tb")]
    snapshot = os.path.join(workdir, "snapshot.pickle")
    if device.type == "cuda":
        flags += ["--record-memory-history", "--memory-snapshot-path", snapshot]
    _train(flags, device, workdir, "profiled")
    traces = glob.glob(os.path.join(workdir, "tb", "*.pt.trace.json"))
    with open(traces[0]) as handle:
        events = json.load(handle)["traceEvents"]
    kernels = sum(1 for event in events if event.get("cat") == "kernel")
    line = f"profiler: {os.path.basename(traces[0])}, {len(events):,} events ({kernels:,} GPU kernels)"
    if device.type == "cuda":
        with open(snapshot, "rb") as handle:
            segments = pickle.load(handle)["segments"]
        line += f"; memory snapshot {os.path.getsize(snapshot) / 2**20:.1f} MiB, {len(segments)} segments"
    print(line + " ok", flush=True)
    return bool(events)


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


SECTIONS = ("versions", "throughput", "documents", "profiler", "zero", "flash", "fp8", "moe", "hybrid",
            "rates")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.tools.gpu_check",
                                     description="One-shot check of a GPU machine: speed against "
                                                 "transformers eager and compiled, document masking, the "
                                                 "profiler and the memory snapshot, ZeRO stages and offload, "
                                                 "flash attention, fp8, MoE, Mamba-2 and gated delta net "
                                                 "hybrids, the device's rates for the planner.")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny models on the CPU: the checks, not the numbers")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="the checks to run (default: all)")
    parser.add_argument("--iters", type=int, default=16, help="steps per throughput run (default: 16)")
    parser.add_argument("--shapes", nargs="+", choices=("gpt", "llama"), default=["gpt", "llama"],
                        help="the throughput check's shapes (default: both)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("error: no GPU here; run with --smoke for the CPU version of the checks")
    os.environ.setdefault("WANDB_MODE", "disabled")
    from parallel.process_groups import init_distributed, shutdown_distributed

    device = init_distributed()
    if args.smoke:  # on the CPU even where a GPU exists
        device = torch.device("cpu")
    size, iters = ("smoke", 4) if args.smoke else ("gpu", args.iters)
    started, ok = time.perf_counter(), True
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        if "versions" in args.sections:
            check_versions(device)
        if "throughput" in args.sections:
            results = check_throughput(size, iters, args.shapes)
            ok &= not any("error" in r for r in results)
            if device.type == "cuda":  # on the CPU a peak is the process's resident set, not the allocator's
                check_planner(size, results)
        if "documents" in args.sections:
            check_documents(size, iters)
        if "profiler" in args.sections:
            ok &= check_profiler(TINY if args.smoke else ZERO, device, workdir)
        if "zero" in args.sections:
            ok &= check_zero(TINY if args.smoke else ZERO, device, workdir)
        if "flash" in args.sections:
            ok &= check_flash_attention(device)
        if "fp8" in args.sections:
            ok &= check_fp8(size, iters)
        if "moe" in args.sections:
            ok &= check_moe(size, iters)
        if "hybrid" in args.sections:
            ok &= check_hybrid(size, iters)
        if "rates" in args.sections:
            from launch.bench.device_rates import main as device_rates

            device_rates(["--smoke"] if args.smoke else [])
    shutdown_distributed()
    print(f"gpu check {'passed' if ok else 'FAILED'} in {time.perf_counter() - started:.0f} s", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
