"""Stage partition and schedules: every schedule is complete, ordered and deadlock-free.

The schedules are checked by simulating all stages at once: asynchronous sends go into per-(pair,
stream) FIFO queues, receives block until the head of their queue is there and must find exactly
the (chunk, micro-batch) they expect, as gloo and NCCL would deliver them.
"""

from collections import deque

import pytest

from parallel.pipeline.partition import chunk_layers, validate_partition
from parallel.pipeline.schedules import schedule, validate_schedule


def test_interleaved_partition_follows_megatron():
    assert [chunk_layers(8, 2, stage, chunk, vp=2) for stage in (0, 1) for chunk in (0, 1)] == \
        [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert [chunk_layers(6, 2, s, layers_per_stage=[2, 4]) for s in (0, 1)] == [[0, 1], [2, 3, 4, 5]]


@pytest.mark.parametrize("args, message", [
    ((6, 4), "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4 x --virtual-pipeline-size 1"),
    ((8, 2, 3), "--num-layers 8 is not divisible by --pipeline-model-parallel-size 2 x --virtual-pipeline-size 3"),
    ((2, 4), "--pipeline-model-parallel-size 4 is larger than --num-layers 2"),
    ((6, 2, 1, [2, 3]), "must be 2 positive counts summing to --num-layers 6"),
])
def test_bad_partitions_name_the_flags(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        validate_partition(*args)


@pytest.mark.parametrize("args, message", [
    (("interleaved", 3, 2, 2), "multiple of --pipeline-model-parallel-size 2"),
    (("interleaved", 2, 4, 2), "needs the micro-batches per step"),
    (("1f1b", 4, 2, 2), "--virtual-pipeline-size 2 needs --pipeline-schedule interleaved"),
])
def test_bad_schedules_name_the_flags(args, message):
    with pytest.raises(ValueError, match=message):
        validate_schedule(*args)


def _simulate(kind, m, pp, vp):
    """Run every stage's action list; return the largest number of live micro-batches per stage."""
    actions = [schedule(kind, m, pp, stage, vp) for stage in range(pp)]
    for stage_actions in actions:
        assert sorted((a.kind, a.chunk, a.micro_batch) for a in stage_actions) == \
            sorted((k, c, i) for k in "FB" for c in range(vp) for i in range(m))
    queues: dict[tuple, deque] = {}
    position, live, peak = [0] * pp, [set() for _ in range(pp)], [0] * pp

    def first(stage, chunk):
        return stage == 0 and chunk == 0

    def last(stage, chunk):
        return stage == pp - 1 and chunk == vp - 1

    while any(position[s] < len(actions[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            if position[s] == len(actions[s]):
                continue
            a = actions[s][position[s]]
            if a.kind == "F" and not first(s, a.chunk):
                source, expected = (s - 1) % pp, (a.chunk if s > 0 else a.chunk - 1, a.micro_batch)
            elif a.kind == "B" and not last(s, a.chunk):
                source, expected = (s + 1) % pp, (a.chunk if s < pp - 1 else a.chunk + 1, a.micro_batch)
            else:
                source = None
            if source is not None:
                queue = queues.setdefault((source, s, a.kind), deque())
                if not queue:
                    continue  # blocked on a receive
                assert queue.popleft() == expected, f"stage {s} received out of order at {a}"
            if a.kind == "F":
                assert (a.chunk, a.micro_batch) not in live[s]
                live[s].add((a.chunk, a.micro_batch))
                peak[s] = max(peak[s], len(live[s]))
                if not last(s, a.chunk):
                    queues.setdefault((s, (s + 1) % pp, "F"), deque()).append((a.chunk, a.micro_batch))
            else:
                live[s].remove((a.chunk, a.micro_batch))  # its forward ran before
                if not first(s, a.chunk):
                    queues.setdefault((s, (s - 1) % pp, "B"), deque()).append((a.chunk, a.micro_batch))
            position[s] += 1
            progressed = True
        assert progressed, f"deadlock: {kind} m={m} pp={pp} vp={vp} at positions {position}"
    assert all(not q for q in queues.values())
    return peak


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_gpipe_and_1f1b_are_deadlock_free_and_bound_live_activations(pp, m):
    assert _simulate("gpipe", m, pp, 1) == [m] * pp
    assert _simulate("1f1b", m, pp, 1) == [min(pp - stage, m) for stage in range(pp)]


@pytest.mark.parametrize("pp, vp", [(2, 2), (2, 3), (4, 2), (4, 4), (3, 2)])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_is_deadlock_free(pp, vp, groups):
    peak = _simulate("interleaved", groups * pp, pp, vp)
    assert peak[0] <= min(groups * pp * vp, 2 * (pp - 1) + (vp - 1) * pp + 1)
