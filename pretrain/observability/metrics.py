"""Per-iteration metrics: gathered from every rank, written by global rank 0 to the console, the
JSON-lines metrics file (format in docs/architecture.md, "Metrics file") and wandb.

``comm_bytes`` cover the training step (forward, backward, optimizer); the reductions done only
for logging and evaluation are not part of it. ``peak_mem_bytes`` is the peak since the iteration began.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys

import torch

from parallel import comm
from parallel.comm import OPERATIONS
from parallel.process_groups import ParallelGroups

RANK_FIELDS = ("rank", "parameters", "expected_model_state_bytes", "model_state_bytes", "offloaded_bytes",
               "saved_activation_bytes", "buffer_pool_bytes", "peak_mem_bytes")


# dense bf16/fp16 tensor-core peaks (NVIDIA data sheets, without sparsity), FLOP/s per GPU
PEAK_FLOPS_16_BIT = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12))


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's peak FLOP/s for ``dtype`` where the table knows it (bf16 / fp16 on A100, H100, H200),
    else None (no MFU is reported)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for model, peak in PEAK_FLOPS_16_BIT if model in name), None)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: GPU allocator statistics, or the process's resident-set high-water mark."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as handle:  # "5" resets VmHWM (Linux)
            handle.write("5")
    except OSError:
        pass  # no reset available: the peak stays the process's lifetime peak


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory allocated (GPU) or peak resident set size of this process (CPU) since the last
    ``reset_peak_memory``."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def gather_per_rank(groups: ParallelGroups, mine: dict, comm_bytes: dict[str, int],
                    inter_node: dict[str, int]) -> list[dict]:
    """Every rank's ``RANK_FIELDS``, comm bytes and the comm bytes of those that crossed a node boundary,
    in rank order (a collective over the world)."""
    values = ([float(mine[name]) for name in RANK_FIELDS] + [float(comm_bytes[op]) for op in OPERATIONS]
              + [float(inter_node[op]) for op in OPERATIONS])
    local = torch.tensor(values, dtype=torch.float64)
    everyone = torch.empty(groups.world.size * local.numel(), dtype=torch.float64)
    comm.all_gather_into_tensor(everyone, local, groups.world)
    rows = []
    for row in everyone.view(groups.world.size, -1).tolist():
        entry = {name: int(row[i]) for i, name in enumerate(RANK_FIELDS)}
        entry["comm_bytes"] = {op: int(row[len(RANK_FIELDS) + i]) for i, op in enumerate(OPERATIONS)}
        entry["comm_bytes_inter_node"] = {op: int(row[len(RANK_FIELDS) + len(OPERATIONS) + i])
                                          for i, op in enumerate(OPERATIONS)}
        rows.append(entry)
    return rows


def _finite_or_null(value):
    """JSON has no NaN or infinity: a skipped step's non-finite norm becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_null(v) for v in value]
    return value


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _human_seconds(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class MetricsWriter:
    """Writes metrics lines (rank 0 only): console, JSON-lines file, and an optional wandb run.

    Owns the open metrics file. Never computes a metric: callers pass measured values.
    """

    def __init__(self, path: str | None, wandb_run=None, enabled: bool = True, tensorboard=None):
        self.enabled, self.wandb_run, self.tensorboard = enabled, wandb_run, tensorboard
        self._file = None
        if enabled and path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", buffering=1)

    def log(self, record: dict, train_iters: int, eta_s: float, console: bool = True) -> None:
        if not self.enabled:
            return
        if console:
            peak = max((r["peak_mem_bytes"] for r in record.get("per_rank", [])), default=0)
            norm = f" | params norm {record['params_norm']:.3f}" if "params_norm" in record else ""
            depths = "".join(f" | {key} {value:.4f}" for key, value in record.items()
                             if key.startswith("mtp_") and key.endswith(" loss"))  # Megatron's names
            console_line(f"iter {record['iteration']:>6}/{train_iters} | loss {record['loss']:.4f}{depths} | "
                         f"lr {record['lr']:.3e} | "
                         f"grad norm {record['grad_norm']:.3f}{norm} | batch {record['batch_size']} | "
                         f"{record['tokens_per_s']:.0f} tok/s | {record['tflops_per_rank'] * 1000:.2f} "
                         "GFLOP/s/rank | "
                         + (f"MFU {record['mfu']:.1%} | " if "mfu" in record else "") +
                         f"peak mem {_human_bytes(peak)} | step {record['step_time_s']:.2f} s | ETA "
                         f"{_human_seconds(eta_s)}"
                         + (" | skipped" if record["skipped"] else ""))
        self.write(record)

    def progress(self, iteration: int, train_iters: int, loss: float, lr: float, tokens_per_s: float,
                 eta_s: float) -> None:
        """A console line between the logged iterations (none written to the file): long
        ``--log-interval``s, Megatron's default 100 among them, are never silent for long."""
        if self.enabled:
            console_line(f"iter {iteration:>6}/{train_iters} | loss {loss:.4f} | lr {lr:.3e} | "
                         f"{tokens_per_s:.0f} tok/s | ETA {_human_seconds(eta_s)}")

    def write(self, record: dict) -> None:
        """Append ``record`` to the metrics file and wandb (no console line)."""
        if not self.enabled:
            return
        if self._file is not None:
            self._file.write(json.dumps(_finite_or_null(record), allow_nan=False) + "\n")
        if self.wandb_run is not None:
            flat = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"}
            for entry in record.get("per_rank", []):
                flat[f"rank{entry['rank']}/model_state_bytes"] = entry["model_state_bytes"]
                flat[f"rank{entry['rank']}/comm_bytes"] = sum(entry["comm_bytes"].values())
                flat[f"rank{entry['rank']}/comm_bytes_inter_node"] = sum(
                    entry["comm_bytes_inter_node"].values())
                flat[f"rank{entry['rank']}/peak_mem_bytes"] = entry["peak_mem_bytes"]
            self.wandb_run.log(flat, step=record["iteration"])
        if self.tensorboard is not None:
            self.tensorboard.log(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


def model_state_table(per_rank: list[dict], stage: int, dp: int, dtype) -> str:
    """Per rank: model-state bytes as ``parallel.zero.memory`` predicts them for its parameters beside
    what the tensors hold (after the first step, when the optimizer states exist)."""
    lines = [f"model-state bytes per rank (ZeRO stage {stage}, dp {dp}, {dtype}): expected vs measured "
             "(in memory + in swap files)"]
    for entry in per_rank:
        expected = entry["expected_model_state_bytes"]
        held = entry["model_state_bytes"] + entry["offloaded_bytes"]
        lines.append(f"  rank {entry['rank']:>3}: {entry['parameters']:>12,} params  expected "
                     f"{expected / 2**20:10.2f} MiB  measured {entry['model_state_bytes'] / 2**20:10.2f} + "
                     f"{entry['offloaded_bytes'] / 2**20:.2f} MiB  ({held / expected:.3f}x)")
    return "\n".join(lines)


def comm_table(per_rank: list[dict], node_size: int | None) -> str:
    """Per rank: the bytes the first step sent, per operation, and of those the bytes that crossed a node
    boundary (``parallel.comm``'s ring model; nodes of ``node_size`` consecutive ranks)."""
    nodes = f"nodes of {node_size} ranks" if node_size else "one node"
    used = [op for op in OPERATIONS if any(entry["comm_bytes"][op] for entry in per_rank)]
    lines = [f"bytes sent per rank in the first step (MiB, all / to another node; {nodes}): "
             + (", ".join(used) if used else "nothing")]
    for entry in per_rank:
        cells = [f"{entry['comm_bytes'][op] / 2**20:.2f} / {entry['comm_bytes_inter_node'][op] / 2**20:.2f}"
                 for op in used]
        lines.append(f"  rank {entry['rank']:>3}: " + "  ".join(f"{op} {cell}" for op,
                                                                cell in zip(used, cells)))
    return "\n".join(lines)


def console_line(line: str) -> None:
    """Write ``line`` to the console in one piece, newline included, and flush: the checkpoint writer's
    thread says a save was published while the training thread prints its lines, and print's separate
    writes of a text and its newline let one line run into the other."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def print_rank0(enabled: bool, *parts) -> None:
    if enabled:
        console_line(" ".join(map(str, parts)))
