"""The ZeRO-R buffer pool: constant arenas, reused slots, no allocation after the first iteration."""

import pytest
import torch

from models.config import GPTConfig
from models.gpt import GPTModel
from parallel import zero
from parallel.buffer_pool import BufferPool, StagingRing
from parallel.recompute import RecomputePolicy, apply_recompute
from parallel.process_groups import create_process_groups
from parallel.topology import Topology
from tests.parity import NO_DROPOUT
from tests.world import run_world


def test_staging_ring_finishes_a_slot_before_reusing_it_and_skips_held_slots():
    pool = BufferPool()
    ring = StagingRing(pool, "staging", 10, torch.float32, slots=2)
    finished = []
    first, slot = ring.take(10, lambda: finished.append("first"))
    ring.take(4, lambda: finished.append("second"))
    assert finished == [] and slot == 0
    third, slot = ring.take(6, lambda: finished.append("third"))
    assert finished == ["first"] and third.data_ptr() == first.data_ptr() and slot == 0
    _, slot = ring.take(3, lambda: finished.append("fourth"), avoid={1})  # slot 1 is held open: 0 again
    assert finished == ["first", "third"] and slot == 0
    assert ring.take(3, lambda: None, avoid={0, 1}) is None  # every slot held: the caller needs its own area
    ring.drain()
    assert finished == ["first", "third", "second", "fourth"]
    assert pool.allocations == 1 and pool.high_water["staging"] == 14
    with pytest.raises(ValueError, match="cannot hold 11"):
        ring.take(11, lambda: None)


def _pool_use(rank, world_size):
    groups = create_process_groups(Topology(world_size))
    report = {}
    for stage in (2, 3):
        for layers in (4, 12):
            config = GPTConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, seq_length=16,
                               vocab_size=128, **NO_DROPOUT)
            model = GPTModel(config, groups.tp, seed=0)
            pool = BufferPool()
            if stage == 3:  # checkpoints share the pool with the gathers they trigger again in backward
                apply_recompute(torch.nn.ModuleList([model]), RecomputePolicy("full", 1), groups.tp, pool)
            _, optimizer = zero.initialize(model, lambda g: torch.optim.AdamW(g, lr=1e-3),
                                           zero.ZeroOptions(stage=stage, bucket_size=2_000,
                                                            persistence_threshold=1000), groups.dp,
                                           unit_modules=list(model.layers), buffer_pool=pool)
            counts = []
            for step in range(4):
                tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
                for _ in range(2):  # two micro-batches: stage 2/3 stage and reduce each time
                    model(tokens, torch.arange(16).expand(2, 16), labels=tokens).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                counts.append(optimizer.buffer_pool.allocations)
            report[(stage, layers)] = (counts, dict(optimizer.buffer_pool.high_water))
    return report


def test_no_allocation_after_the_first_iteration_and_high_water_independent_of_depth():
    """The staging arenas are sized by the bucket size (and the largest single weight or stage-3 unit),
    never by the depth: 12 layers use no more than 4 layers. Checkpoint slots hold exactly one layer
    input per layer and micro-batch in flight."""
    largest_weight = 64 * 256  # an MLP weight; a block's stage-3 unit is 64 * 64 * 12 = 49,152 elements
    block = 49_152
    for report in run_world(2, _pool_use):
        for (stage, layers), (counts, high_water) in report.items():
            assert counts == [counts[0]] * 4, (stage, layers, counts)
            bound = 2 * (2_000 + largest_weight)  # two slots of a bucket each; the shard receives the sum
            assert high_water["grad-staging-torch.float32-dp"] <= bound, (stage, layers, high_water)
            if stage == 3:
                assert high_water["zero3-staging-torch.float32-dp"] == 2 * block, high_water
                assert high_water["activation-checkpoints"] == layers * 16 * 2 * 64, high_water


def test_staged_reduction_gives_a_key_its_own_area_when_every_slot_is_still_open():
    from parallel.comm import DetachedGroup
    from parallel.zero.shard_reduce_scatter import ShardReduceScatter

    pool = BufferPool()
    staged = ShardReduceScatter(pool, "staging", 8, torch.float32, DetachedGroup("dp", 1))
    shards = {key: torch.full((4,), 10.0) for key in "abc"}  # earlier micro-batches, kept
    areas = {key: staged.open(key, 4, lambda key=key: shards[key]) for key in "abc"}  # a, b fill both slots
    arena = pool.view("staging-dp", 0, 16, torch.float32)  # the arena of the dp group's reductions
    inside = [arena.data_ptr() <= areas[k].data_ptr() < arena.data_ptr() + arena.numel() * 4 for k in "abc"]
    assert inside == [True, True, False]
    for value, key in enumerate("cab", start=1):  # filled and started in any order
        areas[key].fill_(value)
        staged.start(key)
    staged.finish()
    assert [shards[k].tolist() for k in "abc"] == [[12.0] * 4, [13.0] * 4, [11.0] * 4]
