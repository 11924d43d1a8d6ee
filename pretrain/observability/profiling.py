"""Megatron's profiling flags, working: what a traced step records, and where it goes.

- ``--profile --use-pytorch-profiler``: a ``torch.profiler`` trace of the steps after
  ``--profile-step-start`` up to ``--profile-step-end`` (1-based, as the log counts them; Megatron's
  defaults 10 and 12 trace steps 11 and 12) on each of ``--profile-ranks``, written under
  ``--tensorboard-dir`` as ``rank<R>.<time>.pt.trace.json`` (Chrome trace format: TensorBoard's profiler
  plugin, Perfetto and chrome://tracing read it), CPU and CUDA activity with shapes.
- ``--profile`` alone (GPUs): nsys's capture range (``cudaProfilerStart`` / ``Stop``, for ``nsys profile
  --capture-range=cudaProfilerApi``) around those steps, with an NVTX range per step and per operator.
- ``--record-memory-history`` (GPUs): the CUDA allocator's history from the start, and torch's memory
  snapshot written to ``--memory-snapshot-path`` at the end of the run (pytorch.org/memory_viz reads it).

Validation refuses, before any process group, what cannot be done (``pretrain.startup.validation``);
``--profile`` alone on the CPU (Megatron's scripts pass it) traces nothing and says so in one line.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings

import torch

from pretrain.config.schema import Config


class StepProfiler:
    """Owns this rank's profiler between the traced steps and the memory history. Never changes what a step
    computes; ``close()`` ends whatever is still running (a run that stopped early) and writes the
    snapshot."""

    def __init__(self, config: Config, rank: int, device: torch.device):
        self.settings, self.rank, self.device = config.profiling, rank, device
        self.directory = config.logging.tensorboard_dir
        self.traced = self.settings.profile and rank in self.settings.profile_ranks
        if self.traced and not self.settings.use_pytorch_profiler and device.type != "cuda":
            print(f"rank {rank}: --profile drives nsys's capture range on a GPU; nothing is traced on the "
                  "CPU (add --use-pytorch-profiler and --tensorboard-dir for a torch.profiler trace)",
                  flush=True)
            self.traced = False
        self._active: contextlib.ExitStack | None = None
        self._profile: torch.profiler.profile | None = None  # the torch profiler while it traces
        if self.settings.record_memory_history:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def step_begin(self, iteration: int) -> None:
        """Before step ``iteration`` (1-based): the torch profiler starts one step before the first traced
        one (its warm-up, as Megatron's), nsys's capture range with the first traced one."""
        start, torch_profiler = self.settings.profile_step_start, self.settings.use_pytorch_profiler
        warmup = 1 if torch_profiler and start > 0 else 0
        if self.traced and iteration == start + 1 - warmup and self._active is None:
            self._active = contextlib.ExitStack()
            if torch_profiler:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if self.device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                handler = torch.profiler.tensorboard_trace_handler(self.directory,
                                                                   worker_name=f"rank{self.rank}")
                steps = self.settings.profile_step_end - start
                with warnings.catch_warnings(), _without_kineto_lines():  # tracing from step 1 has no
                    warnings.filterwarnings("ignore", "Profiler won't be using warmup")  # step to warm up on
                    self._profile = self._active.enter_context(torch.profiler.profile(
                        activities=activities, record_shapes=True, on_trace_ready=handler,
                        schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=steps, repeat=1)))
            else:
                torch.cuda.cudart().cudaProfilerStart()
                self._active.callback(torch.cuda.cudart().cudaProfilerStop)
                self._active.enter_context(torch.autograd.profiler.emit_nvtx(record_shapes=True))
        if self._active is not None and self.device.type == "cuda":
            torch.cuda.nvtx.range_push(f"iteration {iteration}")

    def step_end(self, iteration: int) -> None:
        """After step ``iteration``: the last traced one stops the profiler and writes its trace."""
        if self._active is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.nvtx.range_pop()
        if self._profile is not None:  # each traced step a ProfilerStep#N range of its own
            with _without_kineto_lines():
                self._profile.step()
        if iteration >= self.settings.profile_step_end:
            self._stop()

    def close(self) -> None:
        self._stop()
        if self.settings.record_memory_history:
            path = self.settings.memory_snapshot_path + (f".rank{self.rank}" if self.rank else "")
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)
            print(f"rank {self.rank}: CUDA memory snapshot written to {path}", flush=True)

    def _stop(self) -> None:
        if self._active is not None:
            active, self._active, self._profile = self._active, None, None
            with _without_kineto_lines():
                active.close()
            if self.settings.use_pytorch_profiler:
                print(f"rank {self.rank}: profiler trace written under {self.directory}", flush=True)


@contextlib.contextmanager
def _without_kineto_lines():
    """Kineto's lines as its profiler starts and stops ("USDT: ... profiler_start", "STAGE: ..."), which its
    C++ logger writes to the process's stderr whatever KINETO_LOG_LEVEL says, kept off the console: stderr
    is caught in a file meanwhile and every other line written on after."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True)
                    if not line.startswith((b"USDT:", b"STAGE:"))]
            if kept:
                os.write(2, b"".join(kept))
