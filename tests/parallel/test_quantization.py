"""Block-wise int8 quantization: the round-trip error per block is within half a step, a quantized
all-gather leaves every rank with every chunk's dequantized local blocks, bit for bit, and the quantized
hierarchical reduce-scatter stays within the sum of its levels' rounding bounds."""

import pytest
import torch

from parallel import comm
from parallel.process_groups import create_process_groups
from parallel.quantization import (BLOCK, LEVELS, blocks, dequantize, quantize, quantized_all_gather,
                                   quantized_reduce_scatter_add)
from parallel.topology import Topology
from tests.world import run_world


def _values(numel: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator) * torch.logspace(-6, 3, numel).flip(0)[torch.randperm(
        numel, generator=generator)]  # magnitudes over nine decades, mixed across blocks
    values[:BLOCK] = 0.0  # an all-zero block
    values[BLOCK + 3] = 1e4  # a block dominated by one outlier
    return values


@pytest.mark.parametrize("numel", [BLOCK * 4, BLOCK * 4 + 37, 5])
def test_round_trip_error_is_within_half_a_step_per_block(numel):
    values = _values(max(numel, 2 * BLOCK), seed=numel)[:numel]
    quantized, scales = quantize(values)
    assert quantized.dtype == torch.int8 and quantized.numel() == blocks(numel) * BLOCK
    assert scales.numel() == blocks(numel) and int(quantized.abs().max()) <= LEVELS
    restored = dequantize(quantized, scales, torch.empty(numel))
    padded = torch.zeros(blocks(numel) * BLOCK)
    padded[:numel] = values
    bound = (padded.view(-1, BLOCK).abs().amax(dim=1) / LEVELS / 2).repeat_interleave(BLOCK)[:numel]
    error = (restored - values).abs()
    assert torch.all(error <= bound * (1 + 1e-6)), float((error / bound.clamp_min(1e-30)).max())
    assert torch.all(restored[values == 0] == 0)
    # the bound is met by rounding, not by sending the values as they are
    assert error.max() > 0 or numel < BLOCK
    # in bf16: the same values rounded once more into the output's dtype
    restored_bf16 = dequantize(quantized, scales, torch.empty(numel, dtype=torch.bfloat16))
    assert torch.equal(restored_bf16, restored.to(torch.bfloat16))


def _gathers(rank, world_size):
    groups = create_process_groups(Topology(world_size))
    results = []
    for dtype, chunk in ((torch.float32, 3 * BLOCK + 10), (torch.bfloat16, 2 * BLOCK)):
        mine = _values(chunk, seed=100 + rank).to(dtype)
        expected = torch.cat([dequantize(*quantize(_values(chunk, seed=100 + r).to(dtype)),
                                         torch.empty(chunk, dtype=dtype)) for r in range(world_size)])
        out = torch.full((chunk * world_size,), float("nan"), dtype=dtype)
        quantized_all_gather(out, mine, groups.dp)
        results.append(torch.equal(out, expected))
        in_place = torch.full((chunk * world_size,), float("nan"), dtype=dtype)
        in_place[rank * chunk:(rank + 1) * chunk] = mine
        quantized_all_gather(in_place, in_place[rank * chunk:(rank + 1) * chunk], groups.dp,
                             async_op=True).wait()
        results.append(torch.equal(in_place, expected))
    sent = groups.stats.bytes_by_operation()["all_gather"]
    n = world_size
    ideal = 2 * (n - 1) / n * n * ((blocks(3 * BLOCK + 10) + blocks(2 * BLOCK)) * (BLOCK + 4))
    return results, sent, round(ideal)


def test_quantized_all_gather_equals_the_dequantized_local_blocks():
    for results, sent, ideal in run_world(2, _gathers):
        assert all(results), results
        assert sent == ideal  # int8 values and fp32 scales, by the ring model
    alone = comm.AxisGroup("dp", (0,), None, comm.CommStats())  # one rank: no call, the same values
    values, out = _values(2 * BLOCK, seed=7)[:BLOCK + 1], torch.empty(BLOCK + 1)
    assert quantized_all_gather(out, values, alone, async_op=True).is_completed()
    assert torch.equal(out, dequantize(*quantize(values), torch.empty(BLOCK + 1)))


def test_a_non_finite_value_makes_its_block_non_finite():
    """An fp16 overflow (inf) or a NaN in a gradient survives quantization: the overflow check still sees
    it."""
    for bad in (float("inf"), float("nan")):
        values = torch.ones(2 * BLOCK)
        values[3] = bad
        restored = dequantize(*quantize(values), torch.empty(2 * BLOCK))
        assert not torch.isfinite(restored[:BLOCK]).any() and torch.equal(restored[BLOCK:], values[BLOCK:])


def _reduce_scatters(rank, world_size):
    groups = create_process_groups(Topology(world_size, gpus_per_node=2), dp_partitions=(2,))
    node, across = groups.dp_partition(2)
    chunk = 3 * BLOCK + 10
    inputs = [_values(chunk * world_size, seed=200 + r) for r in range(world_size)]
    exact = torch.stack(inputs).sum(0).view(world_size, chunk)[rank]
    results = {}
    for name, levels in (("node, across", [node, across]), ("one level", [groups.dp])):
        groups.stats.reset()
        out = torch.full((chunk,), 0.5)  # the shard's value so far: the sum is added into it
        handle = quantized_reduce_scatter_add(out, inputs[rank].clone(), levels, async_op=True)
        handle.wait()
        results[name] = (out - 0.5 - exact, groups.stats.snapshot())
    # advanced (as the next reduction starts): the cross-node level is in flight before wait, same numbers
    reference = torch.full((chunk,), 0.5)
    quantized_reduce_scatter_add(reference, inputs[rank].clone(), [node, across])
    groups.stats.reset()
    out = torch.full((chunk,), 0.5)
    handle = quantized_reduce_scatter_add(out, inputs[rank].clone(), [node, across], async_op=True)
    handle.advance()
    crossing_before_wait = groups.stats.snapshot()["bytes"].get("all_to_all/dp_replica2", 0)
    handle.advance()  # nothing further to start
    handle.wait()
    results["advanced"] = (torch.equal(out, reference), crossing_before_wait)
    # bound: each level rounds every value it sends by at most half a step of its block, max|block| / 254
    largest = torch.stack(inputs).abs().max()
    return results, float(largest), chunk


def test_quantized_reduce_scatter_is_within_its_levels_rounding_and_sends_a_byte_an_element():
    """Also: ``advance`` starts the cross-node level before ``wait`` (what the staged reduction does as the
    next one starts), with the same numbers, bit for bit."""
    n = 4
    for rank, (results, largest, chunk) in enumerate(run_world(n, _reduce_scatters)):
        error, snapshot = results["node, across"]
        # level 1: 4 inputs rounded once; level 2: 2 partial sums (each at most 2 x largest) rounded again
        bound = (n * largest + 2 * (2 * largest)) / LEVELS / 2
        assert 0 < error.abs().max() <= bound, (float(error.abs().max()), bound)
        assert snapshot["by_operation"]["reduce_scatter"] == 0
        # int8 values and scales of each level's part (2 chunks, then 1)
        per_part = blocks(2 * chunk) * (BLOCK + 4)
        assert snapshot["bytes"]["all_to_all/dp_part2"] == per_part  # half of it stays on this rank
        assert snapshot["bytes"]["all_to_all/dp_replica2"] == blocks(chunk) * (BLOCK + 4)
        # the node's partial sums cross, never the inputs (nodes of 2 consecutive ranks)
        assert snapshot["inter_node_by_operation"]["all_to_all"] == blocks(chunk) * (BLOCK + 4)
        assert results["advanced"] == (True, blocks(chunk) * (BLOCK + 4))
        one_level, _ = results["one level"]
        assert 0 < one_level.abs().max() <= n * largest / LEVELS / 2
    alone = comm.AxisGroup("dp", (0,), None, comm.CommStats())  # one rank: the input is added, exactly
    out = torch.ones(5)
    handle = quantized_reduce_scatter_add(out, torch.arange(5.0), [alone], async_op=True)
    handle.advance()
    assert handle.is_completed()
    assert torch.equal(out, torch.arange(5.0) + 1)
