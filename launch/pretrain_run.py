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
    per iteration). A failed run stops the caller with its exit status."""
    with tempfile.TemporaryDirectory() as directory:
        metrics = os.path.join(directory, "metrics.jsonl")
        command = [sys.executable, "-m", "launch.torchrun", "--nproc", str(nproc), *flags,
                   "--metrics-file", metrics, "--sample-prompt", ""]
        subprocess.run(command, check=True)
        with open(metrics) as handle:
            return [json.loads(line) for line in handle]
