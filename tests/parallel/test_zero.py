"""ZeRO stage 0 (bucketed all-reduce data parallelism) on a plain nn.Module, against one process."""

import pytest
import torch
from torch import nn

from parallel import zero
from parallel.comm import AxisGroup, CommStats
from parallel.process_groups import create_process_groups
from parallel.topology import Topology
from tests.world import run_world


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


def _data(steps: int, per_step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(per_step, 8, generator=generator), torch.randn(per_step, 4, generator=generator))
            for _ in range(steps)]


def _adam(groups):
    return torch.optim.AdamW(groups, lr=1e-2)


def _train(module, optimizer, data, dp_rank, dp_size, micro_batches):
    losses = []
    for inputs, targets in data:
        mine = inputs.chunk(dp_size)[dp_rank].chunk(micro_batches), targets.chunk(dp_size)[dp_rank].chunk(micro_batches)
        for index, (x, y) in enumerate(zip(*mine)):
            loss = nn.functional.mse_loss(module(x), y) / micro_batches
            if index < micro_batches - 1:
                with optimizer.no_sync():
                    loss.backward()
            else:
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in module.parameters()]


def _stage0_world(rank, world_size, bucket_size):
    groups = create_process_groups(Topology(world_size))
    module, optimizer = zero.initialize(_model(), _adam, stage=0, group=groups.dp, bucket_size=bucket_size)
    groups.stats.reset()
    params = _train(module, optimizer, _data(1, 8), rank, world_size, micro_batches=2)
    first_step_bytes = groups.stats.bytes_by_operation()
    calls = groups.stats.snapshot()["calls"].get("all_reduce/dp", 0)
    params = _train(module, optimizer, _data(5, 8)[1:], rank, world_size, micro_batches=2)
    return params, first_step_bytes, calls, len(optimizer.buffers[0].buckets)


def test_stage0_matches_one_process_and_sends_2p_bytes():
    alone = AxisGroup("dp", (0,), None, CommStats())
    module, optimizer = zero.initialize(_model(), _adam, stage=0, group=alone)
    _train(module, optimizer, _data(1, 8), 0, 1, micro_batches=4)
    reference = _train(module, optimizer, _data(5, 8)[1:], 0, 1, micro_batches=4)
    numel = sum(p.numel() for p in reference)
    for bucket_size in (50, 10_000):
        for params, sent, calls, buckets in run_world(2, _stage0_world, bucket_size):
            for got, want in zip(params, reference):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            # gradients all-reduced once per step (not per micro-batch): 2 P (N-1)/N fp32 elements
            assert sent["all_reduce"] == 2 * numel * 4 * (1 / 2)
            assert calls == buckets and (buckets > 1) == (bucket_size == 50)


def test_bad_stage_and_bucket_size_are_refused():
    alone = AxisGroup("dp", (0,), None, CommStats())
    with pytest.raises(ValueError, match="--zero-stage 5 is unknown"):
        zero.initialize(_model(), _adam, stage=5, group=alone)
    with pytest.raises(ValueError, match="--zero-bucket-size must be >= 1"):
        zero.initialize(_model(), _adam, stage=0, group=alone, bucket_size=0)
