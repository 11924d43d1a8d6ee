"""Measure the pipeline bubble: the fraction of a step each stage spends waiting for its neighbours.

    python -m launch.bench.pipeline [--pp 2] [--micro-batches 4 8 16] [--output runs/bench/pipeline.md]

For each schedule (1f1b, and interleaved with --vp chunks) and micro-batch count m, a world of pp
processes runs forward + backward of a GPT on synthetic tokens (no optimizer); each stage times the
seconds it is blocked in receives and sends (``StageExchange.wait_seconds``) against the step time.
The table puts the measured idle fraction beside the ideal one for equal stages:
(p-1)/(m+p-1) for 1F1B and (p-1)/(v m+p-1) for interleaved. Run pp at most the core count: stages
sharing a core are not concurrent and the idle time they show is not a bubble.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from launch.bench.world import add_worker_arguments, run_world, write_result, write_table


def _worker(args: argparse.Namespace) -> None:
    import torch

    from parallel.process_groups import init_distributed, shutdown_distributed
    from parallel.saved_activations import SavedActivationMeter
    from pretrain.config.arguments import parse_config
    from pretrain.training.build import build_groups, build_model
    from pretrain.training.pipeline_runner import PipelineRunner
    from pretrain.startup.validation import validate

    flags = ["--num-layers", str(args.layers_per_chunk * args.pp * args.vp),
             "--hidden-size", str(args.hidden),
             "--num-attention-heads", "4", "--seq-length", str(args.seq), "--vocab-size", "128",
             "--default-corpus-vocab-size", "128",
             "--micro-batch-size", "2", "--global-batch-size", str(2 * args.m), "--hidden-dropout", "0",
             "--attention-dropout", "0",
             "--pipeline-model-parallel-size", str(args.pp), "--pipeline-schedule", args.schedule]
    if args.vp > 1:
        flags += ["--virtual-pipeline-size", str(args.vp)]
    config = parse_config(flags)
    topology = validate(config, int(os.environ["WORLD_SIZE"]))  # shape checks; the data is synthetic
    device = init_distributed()
    groups = build_groups(config, topology)
    chunks = build_model(config, groups, device)
    runner = PipelineRunner(config, groups, chunks, device, SavedActivationMeter())

    def synthetic_batches():
        generator = torch.Generator().manual_seed(0)
        while True:
            tokens = torch.randint(0, 128, (2, args.seq), generator=generator)
            yield {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, args.seq),
                   "position_ids": torch.arange(args.seq).expand(2, args.seq)}

    batches = synthetic_batches() if runner.reads_data else None
    idle = []
    for step in range(args.steps + 1):
        runner.executor.exchange.wait_seconds = 0.0
        started = time.perf_counter()
        runner.run(batches, args.m)
        elapsed = time.perf_counter() - started
        if step > 0:  # the first step warms up allocators and connections
            idle.append(runner.executor.exchange.wait_seconds / elapsed)
        chunks.zero_grad(set_to_none=True)
    write_result(args.worker_output, groups.rank, {"stage": groups.pp_rank, "idle": statistics.median(idle)})
    shutdown_distributed()


def _ideal(schedule: str, pp: int, m: int, vp: int) -> float:
    chunks = vp if schedule == "interleaved" else 1
    return (pp - 1) / (chunks * m + pp - 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.pipeline",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vp", type=int, default=2, help="model chunks per stage for the interleaved rows")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--layers-per-chunk", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output", default=os.path.join("runs", "bench", "pipeline.md"))
    add_worker_arguments(parser)
    parser.add_argument("--worker-schedule", dest="schedule", default="1f1b", help=argparse.SUPPRESS)
    parser.add_argument("--worker-micro-batches", dest="m", type=int, default=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    rows = ["| schedule | p | v | m | measured idle per stage | mean | ideal |",
            "|---|---|---|---|---|---|---|"]
    for m in args.micro_batches:
        for schedule, vp in (("1f1b", 1), ("interleaved", args.vp)):
            results = run_world("launch.bench.pipeline", args.pp, [
                "--worker", "--worker-schedule", schedule, "--worker-micro-batches", str(m),
                "--pp", str(args.pp),
                "--vp", str(vp), "--layers-per-chunk", str(args.layers_per_chunk),
                "--hidden", str(args.hidden),
                "--seq", str(args.seq), "--steps", str(args.steps)])
            idle = [r["idle"] for r in sorted(results, key=lambda r: r["stage"])]
            rows.append(f"| {schedule} | {args.pp} | {vp} | {m} | {' / '.join(f'{x:.3f}' for x in idle)} | "
                        f"{statistics.mean(idle):.3f} | {_ideal(schedule, args.pp, m, vp):.3f} |")
            print(rows[-1], flush=True)
    write_table(args.output, rows)


if __name__ == "__main__":
    main()
