"""The multi-process test harness itself: results, errors and hangs."""

import time

import pytest
import torch

from parallel import comm
from parallel.process_groups import create_process_groups
from parallel.topology import Topology
from tests.world import WorldError, run_world


def _rank_times_ten(rank, world_size):
    return rank * 10, world_size


def _rank_one_raises(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on purpose")
    return rank


def _rank_one_skips_a_collective(rank, world_size):
    groups = create_process_groups(Topology(world_size))
    if rank == 1:
        time.sleep(60)  # never joins the all-reduce below
        return "skipped"
    x = torch.ones(4)
    comm.all_reduce(x, groups.world)
    return x.sum().item()


def test_results_come_back_in_rank_order():
    assert run_world(3, _rank_times_ten) == [(0, 3), (10, 3), (20, 3)]


def test_a_raising_rank_is_named_with_its_traceback():
    with pytest.raises(WorldError) as error:
        run_world(2, _rank_one_raises)
    assert "rank 1 failed" in str(error.value) and "boom on purpose" in str(error.value)


def test_a_skipped_collective_fails_within_the_timeout_naming_the_hung_ranks():
    start = time.monotonic()
    with pytest.raises(WorldError) as error:
        run_world(2, _rank_one_skips_a_collective, timeout_s=8)
    assert time.monotonic() - start < 20
    assert "hung" in str(error.value) and "[0, 1]" in str(error.value)
