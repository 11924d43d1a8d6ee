"""Run ``python -m pretrain`` on this machine (through ``launch.torchrun``) and read back its metrics.

Scripts that show what a configuration does on this machine (``stage3_fits``, ``infinity_fits``,
``bench_offload``) share this: one training run per call, its metrics file's lines returned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def machine_memory_bytes() -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def run_pretrain(nproc: int, flags: list[str]) -> list[dict]:
    """Train with ``flags`` on ``nproc`` processes; the metrics lines (``--log-interval 1`` gives one
    per iteration). A failed run stops the caller with its exit status. One process runs without
    torchrun's agent (a world of one needs no rendezvous: two seconds less a run in a sweep)."""
    from parallel.process_groups import free_port

    with tempfile.TemporaryDirectory() as directory:
        metrics = os.path.join(directory, "metrics.jsonl")
        tail = [*flags, "--metrics-file", metrics, "--sample-prompt", ""]
        env = None
        if nproc == 1:
            command = [sys.executable, "-m", "pretrain", *tail]
            env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        else:
            command = [sys.executable, "-m", "launch.torchrun", "--nproc", str(nproc), *tail]
        subprocess.run(command, check=True, env=env)
        with open(metrics) as handle:
            return [json.loads(line) for line in handle]
