"""Counted collectives: values are right, handles finish waited in any order, and byte counters equal
the formulas of the patterns the backend sends in."""

import pytest
import torch

from parallel import comm
from parallel.process_groups import create_process_groups
from parallel.topology import Topology
from tests.world import run_world


def _every_collective(rank, world_size):
    groups = create_process_groups(Topology(world_size))
    group, stats, n = groups.dp, groups.stats, world_size
    expected = {}
    # all_reduce: 2(n-1)/n * S
    x = torch.full((8 * n,), float(rank + 1))
    comm.all_reduce(x, group)
    assert torch.all(x == n * (n + 1) / 2)
    expected["all_reduce"] = 2 * (n - 1) / n * x.numel() * 4
    # reduce_scatter: (n-1)/n * S_in, async handle
    full = torch.arange(4 * n, dtype=torch.float64) + rank
    shard = torch.empty(4, dtype=torch.float64)
    comm.reduce_scatter_tensor(shard, full, group, async_op=True).wait()
    base = torch.arange(4 * n, dtype=torch.float64)[4 * rank:4 * rank + 4]
    assert torch.equal(shard, n * base + n * (n - 1) / 2)
    expected["reduce_scatter"] = (n - 1) / n * full.numel() * 8
    # all_gather: (n-1)/n * S_out
    mine = torch.full((3,), rank, dtype=torch.bfloat16)
    gathered = torch.empty(3 * n, dtype=torch.bfloat16)
    comm.all_gather_into_tensor(gathered, mine, group)
    assert gathered.tolist() == [float(r) for r in range(n) for _ in range(3)]
    # in flight together, started in one order and waited in another on every rank (rank r: rotated by r,
    # reversed on odd ranks): torch's collectives progress without wait(), so no order can deadlock
    whole = torch.full((5 * n,), -1.0)
    whole[5 * rank:5 * rank + 5] = rank
    summed, parts = torch.empty(2), torch.arange(2.0 * n) * (rank + 1)
    inside = torch.arange(3.0 * n) + rank  # reduced in place: the output is its own chunk
    half = torch.full((4 * n,), 1.0 + 2**-8, dtype=torch.bfloat16)  # summed in fp32, rounded once
    half_sum = torch.empty(4, dtype=torch.bfloat16)
    handles = [comm.all_gather_into_tensor(whole, whole[5 * rank:5 * rank + 5], group, async_op=True),
               comm.reduce_scatter_tensor(summed, parts, group, async_op=True),
               comm.reduce_scatter_tensor(inside[3 * rank:3 * rank + 3], inside, group, async_op=True),
               comm.all_reduce(x, group, async_op=True),
               comm.reduce_scatter_tensor(half_sum, half, group, async_op=True)]
    order = list(range(len(handles)))
    order = order[rank % len(order):] + order[:rank % len(order)]
    for index in order[::-1] if rank % 2 else order:
        handles[index].wait()
    assert whole.tolist() == [float(r) for r in range(n) for _ in range(5)]
    assert summed.tolist() == [(2 * rank + i) * n * (n + 1) / 2 for i in range(2)]
    assert inside[3 * rank:3 * rank + 3].tolist() == [n * (3 * rank + i) + n * (n - 1) / 2 for i in range(3)]
    assert torch.all(x == n * n * (n + 1) / 2)
    assert torch.equal(half_sum, torch.full((4,), n * (1.0 + 2**-8)).to(torch.bfloat16))
    expected["all_gather"] = (n - 1) / n * (gathered.numel() * 2 + whole.numel() * 4)
    expected["reduce_scatter"] += (n - 1) / n * (parts.numel() * 4 + inside.numel() * 4 + half.numel() * 2)
    expected["all_reduce"] *= 2
    # broadcast: S to each rank this one passes it on to (gloo's binomial tree from rank n - 1: at n = 4 it
    # sends to ranks 0 and 1, rank 0 to rank 2)
    b = torch.full((16,), float(rank), dtype=torch.float32)
    comm.broadcast(b, src=n - 1, group=group)
    assert torch.all(b == n - 1)
    expected["broadcast"] = 16 * 4 * {2: {1: 1}, 4: {3: 2, 0: 1}}.get(n, {}).get(rank, 0)
    # all-to-all: part j to rank j, (n-1)/n * S
    sent, received = torch.arange(3.0 * n) + 100 * rank, torch.empty(3 * n)
    comm.all_to_all_single(received, sent, group)
    assert received.tolist() == [100.0 * r + 3 * rank + i for r in range(n) for i in range(3)]
    expected["all_to_all"] = (n - 1) / n * sent.numel() * 4
    # p2p ring: S per send
    expected["p2p"] = 0
    if n > 1:
        out, into = torch.full((5,), float(rank)), torch.empty(5)
        handles = comm.batch_isend_irecv([(out, (rank + 1) % n, 0)], [(into, (rank - 1) % n, 0)], group)
        for h in handles:
            h.wait()
        assert torch.all(into == (rank - 1) % n)
        if rank == 0:
            comm.send(torch.ones(7), dst=1, group=group)
        elif rank == 1:
            got = torch.zeros(7)
            comm.recv(got, src=0, group=group)
            assert torch.all(got == 1)
        expected["p2p"] = 5 * 4 + (7 * 4 if rank == 0 else 0)
    comm.barrier(group)
    measured = stats.bytes_by_operation()
    calls = stats.snapshot()["calls"]
    stats.reset()
    assert stats.total_bytes() == 0
    return measured, {k: round(v) for k, v in expected.items()}, calls


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_collectives_count_their_bytes_and_finish_waited_in_any_order(world_size):
    for measured, expected, calls in run_world(world_size, _every_collective):
        assert measured == expected
        if world_size == 1:
            assert calls == {}  # a group of one makes no call
        else:
            assert calls["all_reduce/dp"] == 2 and calls["reduce_scatter/dp"] == 4


def _inter_node_bytes(rank, world_size):
    """Two nodes of two ranks, tp 2 x dp 2: the dp ring [r, r + 2] always crosses, the tp ring [0, 1]
    never; over the world [0..3] only ranks 1 and 3 send to another node in a ring, every rank two of
    its three parts in an all-to-all (and gloo's gathers and reduce-scatters); a send crosses with its
    target."""
    groups = create_process_groups(Topology(world_size, tp=2, gpus_per_node=2))
    for group in (groups.dp, groups.tp, groups.world):
        comm.all_reduce(torch.ones(16), group)
    comm.all_gather_into_tensor(torch.empty(8), torch.ones(2), groups.world)
    comm.reduce_scatter_tensor(torch.empty(4), torch.ones(16), groups.world)
    out, into = torch.ones(3), torch.empty(3)
    handles = comm.batch_isend_irecv([(out, (rank + 1) % 4, 0)], [(into, (rank - 1) % 4, 0)], groups.world)
    for handle in handles:
        handle.wait()
    return groups.stats.snapshot()


def test_inter_node_bytes_by_the_pattern_sent():
    for rank, snapshot in enumerate(run_world(4, _inter_node_bytes)):
        crossing = snapshot["inter_node_by_operation"]
        world_crosses = rank in (1, 3)
        # the dp ring's 2 * 1/2 * 64
        assert crossing["all_reduce"] == 64 + (2 * 3 / 4 * 64 if world_crosses else 0)
        assert crossing["all_gather"] == 3 / 4 * 32 * 2 / 3  # on gloo also directly
        assert crossing["p2p"] == (12 if world_crosses else 0)
        assert crossing["reduce_scatter"] == 3 / 4 * 64 * 2 / 3  # the parts for the other node's two ranks
        assert snapshot["by_operation"]["all_reduce"] == 64 + 64 + 96


def _groups_of_a_3d_grid(rank, world_size):
    groups = create_process_groups(Topology(world_size, tp=2, pp=2, ep=2, etp=1))
    result = {}
    for axis in ("tp", "dp", "pp", "mp", "embedding", "world", "etp", "ep", "etp-ep", "etp-ep-pp", "edp"):
        group = getattr(groups, axis.replace("-", "_"))
        x = torch.tensor([float(rank)])
        comm.all_reduce(x, group)
        result[axis] = (list(group.ranks), x.item())
    by_axis = groups.stats.bytes_by_axis()
    return (groups.pp_rank, groups.dp_rank, groups.tp_rank), result, by_axis


def test_process_groups_of_a_3d_grid():
    """Every dense and expert group (experts over ep 2 x etp 1) holds the ranks the topology names, and
    communicates among them."""
    topology = Topology(8, tp=2, pp=2, ep=2, etp=1)
    for rank, (coords, result, by_axis) in enumerate(run_world(8, _groups_of_a_3d_grid)):
        assert coords == topology.coords(rank)
        for axis, (ranks, total) in result.items():
            expected = list(range(8)) if axis == "world" else topology.group_of(axis, rank)
            assert ranks == expected
            assert total == sum(expected)
        assert by_axis["tp"] == 2 * (1 / 2) * 4 and by_axis["mp"] == round(2 * (3 / 4) * 4)


def _wrong_world_size(rank, world_size):
    create_process_groups(Topology(4, tp=2))


def test_world_size_mismatch_is_an_error_not_a_hang():
    from tests.world import WorldError

    with pytest.raises(WorldError, match="launcher started 2 processes but the layout is for 4"):
        run_world(2, _wrong_world_size, timeout_s=60)
