"""A chaos harness: ``python -m launch.chaos [--faults 20] [--iterations 300] [--seed 0] [--out runs/chaos]``.

Runs a dp2 x tp2 ZeRO-2 job on a tiny GPT (the stdlib corpus, no download) twice, each in its own world:
once uninterrupted, once under ``torchrun --max-restarts`` with ``--save`` and ``--load`` on one
directory while random faults strike, one per start (``launch.tools.faults.fault_injection``): SIGKILL of a
worker as a step begins, inside a collective (the others waiting in it) and right after it wrote its
file of a checkpoint, SIGSTOP of a worker (alive but silent) as a step begins and inside a collective,
and a full disk (RLIMIT_FSIZE) as a save is written. The job must finish by itself; then every tensor of
the final checkpoint (parameters, optimizer states, random states) must equal the uninterrupted run's
bit for bit. Writes ``chaos.md`` (a table per fault: when it struck, how long until a rank said it, how
long until the job trained again, the iterations done again, the lines that named it) and
``chaos.json`` under ``--out``, and exits non-zero when the job failed, a hang outlived the timeout by
more than a minute, a fault went unnamed, or the parameters differ.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

from launch.torchrun import IN_PROCESS
from launch.help_text import help_description

REPOSITORY = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # the repository
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "1",
         "--sample-prompt", "", "--tensor-model-parallel-size", "2", "--zero-stage", "2"]
# (fault as launch.tools.faults.fault_injection names it, what it is, whether it strikes at a save)
KINDS = [("iteration", "SIGKILL as a step begins", False),
         ("collective", "SIGKILL inside a collective", False),
         ("save", "SIGKILL right after writing its checkpoint file", True),
         ("hang", "SIGSTOP as a step begins", False),
         ("hangcollective", "SIGSTOP inside a collective", False),
         ("fullsave", "disk full while writing a checkpoint", True)]
HANGS = ("hang", "hangcollective")


def plan(faults: int, iterations: int, save_interval: int, world: int, seed: int) -> list[dict]:
    """``faults`` faults at strictly increasing iterations (each start reaches its fault: it resumes
    from a checkpoint before the previous one), a save fault at a save, every kind at least once when
    there is room, random ranks."""
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(faults)]
    rng.shuffle(kinds)
    chosen, iteration = [], 0
    spacing = max(2, (iterations - save_interval * (faults // 3 + 2)) // max(faults, 1))
    for kind, what, at_save in kinds:
        iteration += rng.randint(1, spacing)
        if at_save:
            iteration = -(-iteration // save_interval) * save_interval
        if iteration >= iterations:
            raise ValueError(f"{faults} faults do not fit in {iterations} iterations: give more --iterations")
        chosen.append({"fault": f"{kind}:{iteration}", "kind": kind, "what": what, "iteration": iteration,
                       "rank": rng.randrange(world)})
    return chosen


def _read(stream, lines: list, started: float) -> None:
    for line in stream:
        lines.append((time.time() - started, line.rstrip("\n")))


def run_job(directory: str, flags: list[str], faults: list[dict], log: str, timeout_s: float) -> dict:
    """Run the job under torchrun, restarted once per fault; return its exit status, its output lines
    (seconds since its start, text; stdout and stderr merged in time order) and its start time."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", FAULT_LOG=log,
               DIE_AT=",".join(f"{f['fault']}@{f['rank']}" for f in faults) or "never:0@0", DIE_RANK="0")
    command = [sys.executable, "-c", IN_PROCESS, "--standalone", "--nproc-per-node=4",
               f"--max-restarts={len(faults)}", "-m", "launch.tools.faults.fault_injection", *flags,
               "--save", directory, "--load", directory]
    started = time.time()
    job = subprocess.Popen(command, cwd=REPOSITORY, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    lines: list[tuple[float, str]] = []
    readers = [threading.Thread(target=_read, args=(stream, lines, started)) for stream in (job.stdout,
                                                                                             job.stderr)]
    for reader in readers:
        reader.start()
    try:
        status = job.wait(timeout_s)
    except subprocess.TimeoutExpired:
        job.kill()
        status = job.wait()
    for reader in readers:
        reader.join()
    return {"status": status, "lines": sorted(lines, key=lambda pair: pair[0]), "started": started}


def tabulate(faults: list[dict], run: dict, log: str) -> list[dict]:
    """Per fault: when it struck, the first error line after it, the next resume, the iterations redone."""
    struck = [json.loads(line) for line in open(log)] if os.path.exists(log) else []
    lines, rows, times = run["lines"], [], []
    for fault in faults:
        event = next((e for e in struck if (e["fault"], e["rank"]) == (fault["fault"], fault["rank"])), None)
        times.append(None if event is None else event["time"] - run["started"])
    for number, (fault, at) in enumerate(zip(faults, times)):
        row = dict(fault, struck=None, detected_s=None, back_s=None, resumed_from=None, redone=None, named=[])
        rows.append(row)
        if at is None:
            continue
        until = next((t for t in times[number + 1:] if t is not None), float("inf"))
        row["struck"] = round(at, 1)
        after = [(t, text) for t, text in lines if at <= t < until]
        errors = [(t, text) for t, text in after if text.startswith("error: ")]
        resumed = next(((t, text) for t, text in after
                        if text.startswith(("resumed from", "no checkpoint under --load"))), None)
        done = [int(text.split()[1].split("/")[0]) for t, text in lines
                if t < at and text.startswith("iter ")]
        if errors:
            row["detected_s"] = round(errors[0][0] - at, 1)
        if resumed:
            row["back_s"] = round(resumed[0] - at, 1)
            row["resumed_from"] = (int(resumed[1].split("at iteration ")[1].split(",")[0])
                                   if resumed[1].startswith("resumed") else 0)
            row["redone"] = max(done, default=0) - row["resumed_from"]
            errors = [(t, text) for t, text in errors if t < resumed[0]]
        row["named"] = list(dict.fromkeys(text[len("error: "):] for _, text in errors))
    return rows


def tensor_differences(first: str, second: str) -> list[str]:
    """The differences between two checkpoints' rank files, tensor by tensor (empty: bit for bit equal)."""
    import torch

    def leaves(value, path=""):
        if isinstance(value, torch.Tensor):
            yield path, value
        elif isinstance(value, dict):
            for key, item in value.items():
                yield from leaves(item, f"{path}/{key}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                yield from leaves(item, f"{path}/{index}")

    differences = []
    names = sorted(name for name in os.listdir(first) if name.startswith("rank_"))
    if names != sorted(name for name in os.listdir(second) if name.startswith("rank_")):
        return [f"{first} and {second} hold different rank files"]
    for name in names:
        one = dict(leaves(torch.load(os.path.join(first, name), weights_only=True)))
        two = dict(leaves(torch.load(os.path.join(second, name), weights_only=True)))
        if one.keys() != two.keys():
            differences.append(f"{name}: different tensors")
        differences += [f"{name}{path}" for path in one
                        if path in two and not torch.equal(one[path], two[path])]
    return differences


def _cell(text) -> str:
    return "" if text is None else str(text).replace("|", "\\|")


def report(rows: list[dict], summary: list[str]) -> str:
    lines = ["| # | fault | rank | iteration | struck (s) | said after (s) | training again after (s) | "
             "resumed from | iterations redone | named as |", "|---|---|---|---|---|---|---|---|---|---|"]
    for number, row in enumerate(rows, 1):
        lines.append(f"| {number} | {row['what']} | {row['rank']} | {row['iteration']} | "
                     f"{_cell(row['struck'])} | {_cell(row['detected_s'])} | {_cell(row['back_s'])} | "
                     f"{_cell(row['resumed_from'])} | "
                     f"{_cell(row['redone'])} | {_cell(' / '.join(row['named']))} |")
    return "\n".join(lines + [""] + summary) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.chaos", description=help_description(__doc__))
    parser.add_argument("--faults", type=int, default=20, help="faults, one per start (default 20)")
    parser.add_argument("--iterations", type=int, default=300, help="--train-iters of the job (default 300)")
    parser.add_argument("--save-interval", type=int, default=10,
                        help="--save-interval of the job (default 10)")
    parser.add_argument("--timeout-minutes", type=float, default=1.0,
                        help="--distributed-timeout-minutes of the job: a hang's bound")
    parser.add_argument("--seed", type=int, default=0, help="chooses the faults, ranks and iterations")
    parser.add_argument("--out", default="runs/chaos", help="where chaos.md and chaos.json go")
    args = parser.parse_args(argv)
    faults = plan(args.faults, args.iterations, args.save_interval, 4, args.seed)
    timeout_s = args.timeout_minutes * 60
    with tempfile.TemporaryDirectory() as root:
        from data.default_corpus import ensure_default_corpus

        prefix, tokenizer = ensure_default_corpus(os.path.join(root, "corpus"), vocab_size=512,
                                                  max_bytes=400_000)
        flags = MODEL + ["--data-path", prefix, "--tokenizer-model", tokenizer, "--data-cache-dir",
                         os.path.join(root, "cache"), "--train-iters", str(args.iterations),
                         "--save-interval", str(args.save_interval),
                         "--distributed-timeout-minutes", f"{args.timeout_minutes:g}"]
        print(f"uninterrupted run of {args.iterations} iterations ...", flush=True)
        reference = run_job(os.path.join(root, "reference"), flags, [], os.path.join(root, "none"), 3600)
        if reference["status"] != 0:
            sys.exit("the uninterrupted run failed:\n"
                     + "\n".join(text for _, text in reference["lines"][-20:]))
        print(f"run under {len(faults)} faults: " + ", ".join(f"{f['fault']}@{f['rank']}" for f in faults),
              flush=True)
        log = os.path.join(root, "faults.jsonl")
        chaos = run_job(os.path.join(root, "chaos"), flags, faults, log, 3 * 3600)
        rows = tabulate(faults, chaos, log)
        final = f"iter_{args.iterations:07d}"
        differences = (tensor_differences(os.path.join(root, "reference", final),
                                     os.path.join(root, "chaos", final))
                       if chaos["status"] == 0 else ["the job did not finish"])
    late = [row for row in rows if row["kind"] in HANGS and (row["detected_s"] or 1e9) > timeout_s + 60]
    unnamed = [row for row in rows if not row["named"]]
    seconds = chaos["lines"][-1][0] if chaos["lines"] else 0.0
    summary = [f"job exit status {chaos['status']} after {seconds:.0f} s "
               f"with {len(faults)} faults (uninterrupted: {reference['lines'][-1][0]:.0f} s); "
               f"--distributed-timeout-minutes {args.timeout_minutes:g}, torchrun grace 5 s",
               "final checkpoint: " + ("every tensor equals the uninterrupted run's, bit for bit"
                                       if not differences else f"{len(differences)} tensors differ: "
                                       + ", ".join(differences[:5])),
               f"hangs said later than the timeout + 60 s: {len(late)}; faults no line named: {len(unnamed)}"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "chaos.json"), "w") as handle:
        json.dump({"faults": rows, "status": chaos["status"], "differences": differences}, handle, indent=1)
    text = report(rows, summary)
    with open(os.path.join(args.out, "chaos.md"), "w") as handle:
        handle.write(text)
    print(text)
    if chaos["status"] != 0 or differences or late or unnamed:
        sys.exit(1)


if __name__ == "__main__":
    main()
