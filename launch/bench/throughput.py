"""One process, this project against transformers' own model of the same shape, eager and compiled:
tokens/s, MFU (on GPUs) and peak memory of a GPT-3-style and a Llama-style model, all in one run.

    python -m launch.bench.throughput [--size gpu|cpu|smoke] [--shapes gpt llama] [--iters 20]
                                      [--systems ours ours-compiled hf hf-compiled] [--extra-flags ...]
                                      [--output runs/bench/throughput.md]

Shapes (``--size gpu``): GPT-3 XL (24 x 2048, 16 heads, vocabulary 50,257, learned positions, LayerNorm,
GELU, tied) and a Llama-3.2-1B shape (16 x 2048, 32 query heads in 8 groups, FFN 8192, vocabulary 128,256,
RMSNorm, SwiGLU, rope base 500000, untied, no biases), micro-batch 4 x 2048 tokens; ``--size cpu`` the
same families at 4 layers x 512, 256 tokens; ``--size smoke`` tiny ones (CI runs it through gpu_check).

Systems, each in a process of its own: ``ours`` is ``python -m pretrain``'s trainer (models.gpt, ZeRO
stage 0, mock data; bf16 compute with fp32 masters on a GPU, fp32 on the CPU), ``ours-compiled`` the same
with ``--compile``; ``hf`` is transformers' GPT2LMHeadModel / LlamaForCausalLM built from the same shape
(``pretrain.interop.hf_config``), trained by the loop a user writes (fp32 weights under bf16 autocast on
a GPU, AdamW fused where the device has it, clipping at 1.0), ``hf-compiled`` that model under
``torch.compile``: the fastest thing a user could pick. The time of a step is the median of the last half
of the iterations (compilation and allocator warm-up fall in the first); tokens/s and MFU count the same
FLOPs for every system (``models.counting.flops_per_token``, Megatron's count; MFU against the data-sheet
peak of ``pretrain.observability.metrics``). ``--extra-flags`` go to ours (e.g. ``--reset-attention-mask
--reset-position-ids --eod-mask-loss`` for document masking); every row says which.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from launch.bench.world import write_table

GPT = ["--normalization", "LayerNorm"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--rotary-base",
         "500000", "--group-query-attention", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear"]
SIZES = {  # (layers, width, heads, query groups, FFN, vocabulary) per family, then tokens and micro-batch
    "gpu": {"gpt": (24, 2048, 16, 16, 8192, 50257), "llama": (16, 2048, 32, 8, 8192, 128256), "tokens": 2048,
            "micro_batch": 4},
    "cpu": {"gpt": (4, 512, 8, 8, 2048, 8192), "llama": (4, 512, 8, 2, 1536, 8192), "tokens": 256,
            "micro_batch": 4},
    "smoke": {"gpt": (2, 64, 4, 4, 256, 512), "llama": (2, 64, 4, 2, 192, 512), "tokens": 32,
              "micro_batch": 2},
}
SYSTEMS = ("ours", "ours-compiled", "hf", "hf-compiled")
DISTRIBUTED_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def shape_flags(size: str, shape: str) -> list[str]:
    """pretrain's flags for one of the shapes (NullTokenizer over mock data, no dropout)."""
    layers, width, heads, groups, ffn, vocab = SIZES[size][shape]
    tokens = SIZES[size]["tokens"]
    flags = ["--num-layers", str(layers), "--hidden-size", str(width), "--num-attention-heads", str(heads),
             "--ffn-hidden-size", str(ffn), "--seq-length", str(tokens), "--max-position-embeddings",
             str(tokens),
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab - 1),
             "--micro-batch-size", str(SIZES[size]["micro_batch"]), "--hidden-dropout", "0",
             "--attention-dropout", "0", "--lr", "1e-4", "--lr-warmup-iters", "1", "--sample-prompt", "",
             "--eval-iters", "0", "--log-interval", "1", "--seed", "1234", "--make-vocab-size-divisible-by",
             "1"]
    return flags + (LLAMA + ["--num-query-groups", str(groups)] if shape == "llama" else GPT)


def _shape_config(flags: list[str]):
    """pretrain's config of ``shape_flags``, its vocabulary as the model has it (a NullTokenizer's V + 1)."""
    from pretrain.config.arguments import parse_config

    config = parse_config(flags)
    config.model.vocab_size = int(flags[flags.index("--vocab-size") + 1]) + 1
    return config


def _device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _ours(flags: list[str], iters: int, workdir: str) -> list[tuple[float, int]]:
    """(step seconds, peak bytes) of each iteration of our trainer."""
    import torch

    from parallel.process_groups import init_distributed
    from pretrain.config.arguments import parse_config
    from pretrain.startup.validation import validate
    from pretrain.training.trainer import Trainer

    device = init_distributed()
    metrics = os.path.join(workdir, "metrics.jsonl")
    precision = ["--bf16"] if device.type == "cuda" else []
    config = parse_config(flags + precision + ["--train-iters", str(iters), "--metrics-file", metrics,
                                               "--data-cache-path", workdir])
    Trainer(config, validate(config, 1), device if device.type == "cuda" else torch.device("cpu")).train()
    with open(metrics) as handle:
        lines = [json.loads(line) for line in handle]
    return [(line["step_time_s"], max(r["peak_mem_bytes"] for r in line["per_rank"])) for line in lines]


def _theirs(flags: list[str], iters: int, compiled: bool) -> list[tuple[float, int]]:
    """(step seconds, peak bytes) of each iteration of transformers' model of the same shape, trained by a
    plain loop (random tokens: the data costs nothing on either side)."""
    import torch

    from parallel.tensor.fp8 import preload_torchao
    preload_torchao()  # transformers imports it
    from transformers import AutoConfig, AutoModelForCausalLM

    from pretrain.interop.hf_config import config_to_hf
    from pretrain.observability.metrics import peak_memory_bytes, reset_peak_memory

    config = _shape_config(flags)
    hf = config_to_hf(config.model, {})
    device = _device()
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf), attn_implementation="sdpa")
    model = model.to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                  **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    run = torch.compile(model) if compiled else model
    micro, tokens = config.training.micro_batch_size, config.model.seq_length
    generator = torch.Generator(device=device).manual_seed(0)
    steps = []
    for _ in range(iters):
        ids = torch.randint(0, config.model.vocab_size, (micro, tokens), device=device, generator=generator)
        reset_peak_memory(device)
        started = time.perf_counter()
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps.append((time.perf_counter() - started, peak_memory_bytes(device)))
    return steps


def _worker(args: argparse.Namespace) -> None:
    import torch

    flags = shape_flags(args.size, args.shape) + args.extra_flags
    with tempfile.TemporaryDirectory(prefix="throughput-") as workdir:
        if args.system.startswith("ours"):
            compiled = ["--compile"] if args.system == "ours-compiled" else []
            steps = _ours(flags + compiled, args.iters, workdir)
        else:
            steps = _theirs(flags, args.iters, args.system == "hf-compiled")
    timed = steps[len(steps) // 2:]
    from models.counting import flops_per_token
    from pretrain.observability.metrics import peak_flops

    config = _shape_config(flags)
    device = _device()
    peak = peak_flops(device, torch.bfloat16)
    step = statistics.median(seconds for seconds, _ in timed)
    tokens = config.training.micro_batch_size * config.model.seq_length / step
    print("RESULT " + json.dumps({
        "system": args.system, "shape": args.shape, "tokens_per_s": tokens,
        "first_step_s": steps[0][0], "step_s": step, "peak_bytes": max(peak for _, peak in timed),
        "mfu": tokens * flops_per_token(config.model) / peak if peak else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"}), flush=True)


def run_system(size: str, shape: str, system: str, iters: int, extra_flags: list[str]) -> dict:
    """One system's measurement, in a process of its own."""
    command = [sys.executable, "-m", "launch.bench.throughput", "--worker", "--size", size, "--shapes", shape,
               "--systems", system, "--iters", str(iters), "--extra-flags", *extra_flags]
    # a world of its own, whatever group the caller (gpu_check) has formed
    env = {name: value for name, value in os.environ.items() if name not in DISTRIBUTED_VARIABLES}
    env["WANDB_MODE"] = "disabled"
    run = subprocess.run(command, capture_output=True, text=True, env=env)
    found = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode or not found:
        return {"system": system, "shape": shape, "error": (run.stderr or run.stdout).strip()[-2000:]}
    return json.loads(found[-1][len("RESULT "):])


def table(results: list[dict], extra_flags: list[str]) -> list[str]:
    """The rows: per shape, each system's tokens/s, its ratio to ours and to the compiled peer."""
    rows = ["| shape | system | tokens/s | vs transformers compiled | MFU | peak GiB | first step s |",
            "|---|---|---|---|---|---|---|"]
    for shape in dict.fromkeys(r["shape"] for r in results):
        mine = {r["system"]: r for r in results if r["shape"] == shape}
        peer = mine.get("hf-compiled", {}).get("tokens_per_s")
        for system, r in mine.items():
            if "error" in r:
                rows.append(f"| {shape} | {system} | failed: {r['error'].splitlines()[-1][:120]} | | | | |")
                continue
            ratio = f"{r['tokens_per_s'] / peer:.2f}x" if peer else "n/a"
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "n/a"
            named = (f"{system} {' '.join(extra_flags)}" if extra_flags and system.startswith("ours")
                     else system)
            rows.append(f"| {shape} | {named} | {r['tokens_per_s']:,.0f} | {ratio} | {mfu} | "
                        f"{r['peak_bytes'] / 2**30:.2f} | {r['first_step_s']:.1f} |")
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.throughput",
                                     description="tokens/s, MFU and peak memory of ours against "
                                                 "transformers' model of the same shape, eager and compiled, "
                                                 "one process each")
    parser.add_argument("--size", choices=tuple(SIZES), default="gpu" if _cuda() else "cpu")
    parser.add_argument("--shapes", nargs="+", choices=("gpt", "llama"), default=["gpt", "llama"])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--iters", type=int, default=20, help="steps per system (default: 20)")
    parser.add_argument("--extra-flags", nargs=argparse.REMAINDER, default=[],
                        help="pretrain flags for ours (last on the line)")
    parser.add_argument("--output", default="runs/bench/throughput.md")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.shape, args.system = args.shapes[0], args.systems[0]
        _worker(args)
        return []
    results = []
    for shape in args.shapes:
        for system in args.systems:
            result = run_system(args.size, shape, system, args.iters, args.extra_flags)
            results.append(result)
            print(json.dumps(result), flush=True)
    rows = table(results, args.extra_flags)
    print("\n".join(rows))
    write_table(args.output, rows)
    return results


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
