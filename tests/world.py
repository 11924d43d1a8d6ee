"""Run a function on a world of N gloo processes on this machine, for tests.

``run_world(n, fn, *args)`` spawns n processes, initialises a gloo group among them (one OMP thread
each), calls ``fn(rank, n, *args)`` on every rank and returns the list of results in rank order.
A rank that raises makes ``run_world`` raise ``WorldError`` carrying that rank's traceback; ranks
still running after ``timeout_s`` are killed and named ("hung"), so a collective that one rank
skips fails the test in seconds instead of hanging CI. ``fn`` must be a module-level function
(it is pickled into the children) and its result picklable.

Children are forked from one server process per test session that has already imported torch and
the training stack (``PRELOAD``): importing them costs seconds per process, which 8 processes on 2
cores would pay again for every world. Each child then takes the caller's environment as it is at
``run_world`` (a test's ``monkeypatch.setenv`` reaches the ranks as it would with spawn).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import time
import traceback

import torch.multiprocessing as mp

from parallel.process_groups import free_port


class WorldError(AssertionError):
    """A rank of a test world failed or hung; the message names the ranks and carries tracebacks."""


# imported once by the fork server; every rank starts with them loaded
PRELOAD = ["torch", "torch.distributed", "pretrain.training.trainer",
           "torch._dynamo"]  # imported by torch's optimizers on first use: about a second per process


def _child(rank: int, world_size: int, port: int, collective_timeout_s: float, results, fn, args,
           environment: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        value = fn(rank, world_size, *args)
        results.put((rank, True,
                     pickle.dumps(value)))  # plain bytes: tensors must not travel as shared memory
        dist.destroy_process_group()
    except BaseException:  # report everything, including a gloo timeout, to the parent
        results.put((rank, False, traceback.format_exc()))


def run_world(world_size: int, fn, *args, timeout_s: float = 120.0,
              collective_timeout_s: float | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results by rank."""
    if not 1 <= world_size <= 8:
        raise ValueError(f"test worlds have 1 to 8 processes, not {world_size}")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
    results = context.Queue()
    port = free_port()
    collective_timeout_s = collective_timeout_s or timeout_s
    processes = [context.Process(target=_child,
                                 args=(rank, world_size, port, collective_timeout_s, results, fn, args,
                                                                dict(os.environ)),
                                 daemon=False) for rank in range(world_size)]
    for process in processes:
        process.start()
    values: dict[int, object] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(values) + len(failures) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0)
                    and r not in values and r not in failures]
            for r in dead:
                failures[r] = f"process exited with code {processes[r].exitcode} without a result"
            continue
        (values if ok else failures)[rank] = value
        if failures:  # one rank failed: the others would wait on it, stop them now
            break
    hung = [r for r in range(world_size) if r not in values and r not in failures]
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(timeout=5)
    if failures or hung:
        parts = [f"rank {r} failed:\n{failures[r]}" for r in sorted(failures)]
        if hung:
            why = "stopped after another rank failed" if failures else f"hung for more than {timeout_s:.0f} s"
            parts.insert(0, f"ranks {hung} {why} (a collective that not every rank entered?)")
        raise WorldError("\n".join(parts))
    return [pickle.loads(values[r]) for r in range(world_size)]
