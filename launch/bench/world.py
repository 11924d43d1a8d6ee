"""Run a benchmark worker on a torchrun world of this machine and collect each rank's JSON result.

``run_world(module, nproc, args)`` starts ``python -m MODULE --worker-output DIR ARGS`` under torchrun;
each rank writes ``rank<R>.json`` with ``write_result``; the results come back in rank order. A
failing world stops the benchmark with the tail of its error output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def run_world(module: str, nproc: int, args: list[str], threads_per_rank: int | None = None) -> list[dict]:
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", module, "--worker-output", directory, *args]
        run = subprocess.run(command, capture_output=True, text=True, env=env)
        if run.returncode:
            sys.exit(f"benchmark world failed: {' '.join(args)}\n{run.stderr[-4000:]}")
        return read_results(directory, nproc)


def add_worker_arguments(parser) -> None:
    """The flags by which ``run_world`` starts a benchmark module as one rank of its world."""
    parser.add_argument("--worker", action="store_true", help="internal: run as one rank of the world")
    parser.add_argument("--worker-output", help="internal: where ranks write their results")


def write_result(directory: str, rank: int, result: dict) -> None:
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)


def read_results(directory: str, ranks: int) -> list[dict]:
    """What ranks 0 .. ``ranks`` - 1 wrote with ``write_result``, in rank order."""
    results = []
    for rank in range(ranks):
        with open(os.path.join(directory, f"rank{rank}.json")) as handle:
            results.append(json.load(handle))
    return results


def write_table(path: str, rows: list[str]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        handle.write("\n".join(rows) + "\n")
    print(f"table written to {path}")
