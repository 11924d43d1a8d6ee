"""The peer of ``launch.bench.pipeline``: torch.distributed.pipelining's schedules on ``plain_gpt`` cut into
pipeline stages, one world per schedule (run by ``launch.bench.pipeline``).

1f1b is torch's Schedule1F1B, zb-h1 its ScheduleInterleavedZeroBubble with one stage per rank (ZB1P, the
paper's ZB-H1 order) and zbv its ScheduleZBVZeroBubble (two stages per rank in a V). A stage's waiting is
the time spent in torch's point-to-point waits (its ``_wait_batch_p2p``, timed from outside); its
activations are the storages autograd keeps for backward, counted by saved-tensor hooks whose holders
are freed when autograd frees them (with a split backward torch keeps the graph until the weight pass).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from launch.bench.world import add_worker_arguments, write_result
from launch.help_text import help_description


class _Held:
    """One saved tensor in ``SavedBytes``: freed with the autograd node that keeps it."""

    def __init__(self, probe: SavedBytes, tensor):
        self.probe, self.tensor = probe, tensor
        self.address = tensor.untyped_storage().data_ptr()
        probe.add(self.address, tensor.untyped_storage().nbytes())

    def __del__(self):
        self.probe.drop(self.address)


class SavedBytes:
    """The storage bytes autograd keeps for backward (each storage once, parameters left out), and the
    peak."""

    def __init__(self):
        self.count: dict[int, list[int]] = {}  # address: [holders, bytes]
        self.current = self.peak = 0

    def add(self, address: int, nbytes: int) -> None:
        entry = self.count.setdefault(address, [0, nbytes])
        if entry[0] == 0:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        entry[0] += 1

    def drop(self, address: int) -> None:
        entry = self.count[address]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.count[address]

    def hooks(self):
        import torch
        from torch import nn

        def pack(tensor):
            if isinstance(tensor if tensor._base is None else tensor._base, nn.Parameter):
                return tensor
            return _Held(self, tensor)

        def unpack(held):
            return held.tensor if isinstance(held, _Held) else held

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _pieces(args: argparse.Namespace, pp: int, stages: list[int]):
    """The plain GPT's pieces for virtual ``stages`` of ``pp * len(stages)``: the embeddings in the first,
    the final norm and an untied head in the last, ``layers`` blocks cut evenly."""
    import torch
    from torch import nn

    from launch.bench.plain_gpt import PlainGPT

    total = pp * len(stages)
    model = PlainGPT(128, args.hidden, args.layers_per_stage * pp, 4, args.seq)
    per = len(model.blocks) // total

    class Piece(nn.Module):
        def __init__(self, index: int):
            super().__init__()
            self.first, self.last = index == 0, index == total - 1
            self.wte, self.wpe = (model.wte, model.wpe) if self.first else (None, None)
            self.blocks = nn.ModuleList(model.blocks[index * per:(index + 1) * per])
            self.ln_f = model.ln_f if self.last else None
            self.head = nn.Linear(args.hidden, 128, bias=False) if self.last else None
            if self.last:
                with torch.no_grad():
                    self.head.weight.copy_(model.wte.weight)

        def forward(self, x):
            if self.first:
                x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x)) if self.last else x

    return [Piece(index) for index in stages]


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)
    from torch.distributed.pipelining import schedules as torch_schedules

    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    v = args.schedule == "zbv"
    indices = [rank, 2 * pp - 1 - rank] if v else [rank]
    total = pp * len(indices)
    micro = 2
    pieces = _pieces(args, pp, indices)
    stages = [PipelineStage(piece, index, total, torch.device("cpu"))
              for piece, index in zip(pieces, indices)]

    def loss(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    kind = {"1f1b": Schedule1F1B, "zb-h1": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}
    schedule = kind[args.schedule](stages[0] if args.schedule == "1f1b" else stages, args.m, loss_fn=loss)
    waited = [0.0]
    original = torch_schedules._wait_batch_p2p

    def timed_wait(work):
        started = time.perf_counter()
        original(work)
        waited[0] += time.perf_counter() - started

    torch_schedules._wait_batch_p2p = timed_wait
    probe = SavedBytes()
    generator = torch.Generator().manual_seed(0)
    idle, seconds, peaks = [], [], []
    for step in range(args.steps + 1):
        batch = torch.randint(0, 128, (micro * args.m, args.seq), generator=generator)
        waited[0], probe.peak = 0.0, probe.current
        started = time.perf_counter()
        with probe.hooks():
            if any(index == 0 for index in indices) and any(index == total - 1 for index in indices):
                schedule.step(batch, target=batch)
            elif any(index == 0 for index in indices):
                schedule.step(batch)
            elif any(index == total - 1 for index in indices):
                schedule.step(target=batch)
            else:
                schedule.step()
        elapsed = time.perf_counter() - started
        if step > 0:
            idle.append(waited[0] / elapsed)
            seconds.append(elapsed)
            peaks.append(probe.peak)
        for piece in pieces:
            piece.zero_grad(set_to_none=True)
    write_result(args.worker_output, rank, {"stage": rank, "idle": statistics.median(idle),
                                            "seconds": statistics.median(seconds), "peak": max(peaks)})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.torch_pipeline",
                                     description=help_description(__doc__))
    add_worker_arguments(parser)
    parser.add_argument("--worker-schedule", dest="schedule", default="1f1b")
    parser.add_argument("--worker-micro-batches", dest="m", type=int, default=4)
    parser.add_argument("--worker-pp", dest="pp", type=int, default=2)
    parser.add_argument("--layers-per-stage", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    if not args.worker:
        parser.error("run by launch.bench.pipeline")
    _worker(args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
