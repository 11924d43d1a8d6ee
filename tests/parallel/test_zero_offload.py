"""ZeRO-Offload / ZeRO-Infinity: the optimizer on the CPU or in swap files reproduces the in-memory run
exactly, holds at most three sub-groups in memory, and refuses bad swap directories clearly."""

import os
import resource
import signal

import pytest
import torch

from models.config import GPTConfig
from models.gpt import GPTModel
from parallel import zero
from parallel.process_groups import create_process_groups
from parallel.topology import Topology
from parallel.zero.swap import SwapError, SwapSpace, check_swap_directory
from tests.parity import NO_DROPOUT
from tests.world import run_world

CONFIG = GPTConfig(num_layers=24, hidden_size=32, num_attention_heads=4, seq_length=16,
                   vocab_size=128, **NO_DROPOUT)


def _train(groups, stage, dtype, swap_root, **offload):
    """Eight steps of AdamW on a 24-layer GPT (masters of at most 3,000 elements, offloaded or not: the
    same cut steps the same masters); the losses, final parameters and what was held where."""
    model = GPTModel(CONFIG, groups.tp, seed=0).to(dtype)
    options = zero.ZeroOptions(stage=stage, bucket_size=4_000, persistence_threshold=100, clip_grad=1.0,
                               sub_group_size=3_000, **offload)
    _, optimizer = zero.initialize(model, lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1), options,
                                   groups.dp, unit_modules=list(model.layers))
    losses, held = [], []
    for step in range(8):
        tokens = torch.randint(0, 128, (2, 16),
                               generator=torch.Generator().manual_seed(step + 10 * groups.dp_rank))
        loss = model(tokens, torch.arange(16).expand(2, 16), labels=tokens).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        held.append((optimizer.model_state_bytes(), optimizer.offloaded_bytes(),
                     optimizer.buffer_pool.allocations))
    with optimizer.gathered_parameters():
        params = [p.detach().clone() for p in model.parameters()]
    states = sum(t.numel() * t.element_size() for m in optimizer.masters
                 for t in optimizer.optimizer.state[m].values() if t.numel() > 1)
    files = os.listdir(swap_root)
    shards = (sum(s.numel() * s.element_size() for s in optimizer.units.shards.values()) if optimizer.units
              else 0)
    optimizer.close()
    return losses, params, held, states, files, shards


def _offload_runs(rank, world_size, swap_root):
    groups = create_process_groups(Topology(world_size))
    report = {}
    for stage, dtype in ((1, torch.bfloat16), (2, torch.float32), (3, torch.float32), (3, torch.bfloat16)):
        reference = _train(groups, stage, dtype, swap_root)
        cpu = _train(groups, stage, dtype, swap_root, offload_optimizer="cpu")
        nvme = _train(groups, stage, dtype, swap_root, offload_optimizer="nvme", nvme_path=swap_root)
        runs = [cpu, nvme]
        if stage == 3:  # ZeRO-Infinity: the parameter shards in files too, read ahead of their gathers
            runs.append(_train(groups, stage, dtype, swap_root, offload_param="nvme", nvme_path=swap_root,
                               prefetch_budget=30_000))
            runs.append(_train(groups, stage, dtype, swap_root, offload_optimizer="nvme",
                               offload_param="nvme",
                               nvme_path=swap_root))
        report[(stage, str(dtype))] = (reference, runs)
    return report


@pytest.mark.parity
def test_optimizer_offload_reproduces_the_in_memory_run_exactly(tmp_path):
    for report in run_world(2, _offload_runs, str(tmp_path)):
        for (stage, dtype), (reference, runs) in report.items():
            for name, run in enumerate(runs):
                assert run[0] == reference[0], (stage, dtype, name)  # losses, bit for bit
                assert all(torch.equal(a, b) for a, b in zip(run[1], reference[1])), (stage, dtype, name)
                assert [held[2] for held in run[2][1:]] == [run[2][1][2]] * 7  # no allocation after step 1
            in_memory, states = reference[2][-1][0], reference[3]
            # the optimizer in files: its states (and bf16's fp32 masters) left memory
            for nvme in runs[1::2]:
                resident, offloaded, _ = nvme[2][-1]
                assert in_memory - resident >= 0.8 * states, (stage, dtype, in_memory, resident, states)
                assert offloaded >= states, (stage, dtype, offloaded, states)
                assert nvme[4] and all(name.startswith("zero-") for name in nvme[4])  # private directories
            if stage == 3:  # the shards left memory too: what stays is the gradient shard and buffers
                shards = reference[5]
                params_only, both = runs[2][2][-1], runs[3][2][-1]
                assert params_only[1] >= shards and both[1] >= shards + states, (dtype, params_only, both)
                # fp32: the master can no longer be the shard, so only both offloads together save the shard
                assert (params_only[0] <= in_memory
                        and both[0] <= in_memory - shards - 0.8 * states), (dtype, both)
    assert os.listdir(tmp_path) == []  # closed: the swap files are gone


def test_swap_directory_is_checked_before_training(tmp_path):
    with pytest.raises(ValueError, match="--nvme-path .*missing.* does not exist"):
        check_swap_directory(str(tmp_path / "missing"), 0)
    with pytest.raises(ValueError, match="GiB free but the swapped states need"):
        check_swap_directory(str(tmp_path), 1 << 60)
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere
        with pytest.raises(ValueError, match="not writable"):
            check_swap_directory(str(read_only), 0)


def test_an_io_error_names_the_swap_file(tmp_path):
    space = SwapSpace(str(tmp_path), "test")
    space.write("states", torch.arange(4.0)).result()
    into = torch.empty(8)
    with pytest.raises(SwapError, match=r"reading .*states failed .*checkpoints are not touched"):
        space.read("states", into).result()  # the file is shorter than asked
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))  # files stop growing, like a full disk
    try:
        with pytest.raises(SwapError, match=r"writing .*big failed .*File too large"):
            space.write("big", torch.zeros(1024)).result()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    space.close()
    assert not os.path.exists(space.directory)
