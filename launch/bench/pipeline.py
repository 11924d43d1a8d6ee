"""Measure each pipeline schedule: the bubble (the fraction of a step each stage waits for its neighbours),
the peak activation bytes per stage and the step time, beside torch.distributed.pipelining's schedule of
the same name on a plain-torch GPT of the same shape (its own world).

    python -m launch.bench.pipeline [--pp 2] [--micro-batches 4 8 16] [--output runs/bench/pipeline.md]

Ours: 1F1B, interleaved (--vp chunks), ZB-H1 and ZBV on this project's GPT (untied, so that ZBV runs the
same model), forward and backward of synthetic tokens, no optimizer; a stage's waiting is the time it is
blocked in its exchanges (``StageExchange.wait_seconds``), its activations the meter's peak (saved tensors,
and what split backwards keep for their weight passes). torch's: Schedule1F1B, ScheduleInterleavedZeroBubble
with one stage per rank (its ZB-H1, "ZB1P") and ScheduleZBVZeroBubble on ``launch.bench.plain_gpt`` cut into
stages (the head untied); its waiting is the time in its point-to-point waits, its activations the tensors
autograd keeps (``torch_pipeline``). The predicted bubble is the planner's (``schedule_price``: the stages'
orders laid out with our layers' costs). Run pp at most the core count: stages sharing a core are not
concurrent and the idle time they show is not a bubble.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from launch.bench.world import add_worker_arguments, run_world, write_result, write_table
from launch.help_text import help_description

OURS = ("1f1b", "interleaved", "zb-h1", "zbv")


def _worker(args: argparse.Namespace) -> None:
    import torch

    from launch.tools.planning.schedule_price import pipeline_bubble
    from parallel.process_groups import init_distributed, shutdown_distributed
    from parallel.saved_activations import SavedActivationMeter
    from pretrain.config.arguments import parse_config
    from pretrain.training.build import build_groups, build_model
    from pretrain.training.pipeline_runner import PipelineRunner
    from pretrain.startup.validation import validate

    chunks = {"interleaved": args.vp, "zbv": 2}.get(args.schedule, 1)
    flags = ["--num-layers", str(args.layers_per_stage * args.pp), "--hidden-size", str(args.hidden),
             "--num-attention-heads", "4", "--seq-length", str(args.seq), "--vocab-size", "128",
             "--default-corpus-vocab-size", "128", "--untie-embeddings-and-output-weights",
             "--micro-batch-size", "2", "--global-batch-size", str(2 * args.m), "--hidden-dropout", "0",
             "--attention-dropout", "0",
             "--pipeline-model-parallel-size", str(args.pp), "--pipeline-schedule", args.schedule]
    if args.schedule == "interleaved":
        flags += ["--virtual-pipeline-size", str(chunks)]
    config = parse_config(flags)
    topology = validate(config, int(os.environ["WORLD_SIZE"]))  # shape checks; the data is synthetic
    device = init_distributed()
    groups = build_groups(config, topology)
    model = build_model(config, groups, device)
    meter = SavedActivationMeter()
    runner = PipelineRunner(config, groups, model, device, meter)

    def synthetic_batches():
        generator = torch.Generator().manual_seed(0)
        while True:
            tokens = torch.randint(0, 128, (2, args.seq), generator=generator)
            yield {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, args.seq),
                   "position_ids": torch.arange(args.seq).expand(2, args.seq)}

    batches = synthetic_batches() if runner.reads_data else None
    idle, seconds, peaks = [], [], []
    for step in range(args.steps + 1):
        runner.executor.exchange.wait_seconds = 0.0
        meter.reset()
        started = time.perf_counter()
        runner.run(batches, args.m)
        elapsed = time.perf_counter() - started
        if step > 0:  # the first step warms up allocators and connections
            idle.append(runner.executor.exchange.wait_seconds / elapsed)
            seconds.append(elapsed)
            peaks.append(meter.peak_bytes)
        model.zero_grad(set_to_none=True)
    predicted = pipeline_bubble(config.model, args.schedule if args.schedule != "interleaved" else "1f1b",
                                args.pp, args.m * (chunks if args.schedule == "interleaved" else 1), None)
    write_result(args.worker_output, groups.rank, {
        "stage": groups.pp_rank, "idle": statistics.median(idle), "seconds": statistics.median(seconds),
        "peak": max(peaks), "predicted": predicted})
    shutdown_distributed()


def _row(system: str, schedule: str, pp: int, m: int, results: list[dict], baseline: float | None) -> str:
    results = sorted(results, key=lambda r: r["stage"])
    idle = [r["idle"] for r in results]
    mean = statistics.mean(idle)
    versus = f"{mean / baseline:.2f}" if baseline else "-"
    predicted = f"{results[0]['predicted']:.3f}" if "predicted" in results[0] else "-"
    peaks = " / ".join(f"{r['peak'] / 2**20:.2f}" for r in results)
    return (f"| {system} | {schedule} | {pp} | {m} | {' / '.join(f'{x:.3f}' for x in idle)} | {mean:.3f} | "
            f"{versus} | {predicted} | {peaks} | {max(r['seconds'] for r in results):.3f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.pipeline",
                                     description=help_description(__doc__))
    parser.add_argument("--pp", type=int, nargs="+", default=[2])
    parser.add_argument("--vp", type=int, default=2, help="model chunks per stage for the interleaved rows")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--layers-per-stage", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedules", nargs="+", default=list(OURS), choices=OURS)
    parser.add_argument("--no-peer", action="store_true", help="leave out torch.distributed.pipelining")
    parser.add_argument("--output", default=os.path.join("runs", "bench", "pipeline.md"))
    add_worker_arguments(parser)
    parser.add_argument("--worker-schedule", dest="schedule", default="1f1b", help=argparse.SUPPRESS)
    parser.add_argument("--worker-micro-batches", dest="m", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--worker-pp", dest="worker_pp", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.pp = args.worker_pp
        _worker(args)
        return
    rows = ["| system | schedule | p | m | idle fraction per stage | mean | / 1F1B's | predicted | "
            "peak activations MiB per stage | step s |", "|---|---|---|---|---|---|---|---|---|---|"]
    shape = ["--layers-per-stage", str(args.layers_per_stage), "--hidden", str(args.hidden), "--seq",
             str(args.seq), "--steps", str(args.steps)]
    for pp in args.pp:
        for m in args.micro_batches:
            baselines: dict[str, float] = {}
            for schedule in args.schedules:
                if schedule == "interleaved" and m % pp:
                    continue
                results = run_world("launch.bench.pipeline", pp, [
                    "--worker", "--worker-schedule", schedule, "--worker-micro-batches", str(m),
                    "--worker-pp", str(pp), "--vp", str(args.vp), *shape])
                rows.append(_row("ours", schedule, pp, m, results, baselines.get("ours")))
                if schedule == "1f1b":
                    baselines["ours"] = statistics.mean(r["idle"] for r in results)
                print(rows[-1], flush=True)
                if args.no_peer or schedule == "interleaved":
                    continue
                results = run_world("launch.bench.torch_pipeline", pp, [
                    "--worker", "--worker-schedule", schedule, "--worker-micro-batches", str(m),
                    "--worker-pp", str(pp), *shape])
                rows.append(_row("torch.distributed.pipelining", schedule, pp, m, results,
                                 baselines.get("torch")))
                if schedule == "1f1b":
                    baselines["torch"] = statistics.mean(r["idle"] for r in results)
                print(rows[-1], flush=True)
    write_table(args.output, rows)


if __name__ == "__main__":
    main()
