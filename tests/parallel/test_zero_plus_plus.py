"""ZeRO++ and MiCS on a plain nn.Module: quantized weight gathers (qwZ), the secondary partition (hpZ),
quantized gradients (qgZ), and shard groups with replicas (MiCS / HSDP)."""

import pytest
import torch
from torch import nn

from parallel import zero
from parallel.comm import AxisGroup, CommStats
from parallel.process_groups import create_process_groups
from parallel.topology import Topology
from tests.parallel.test_zero import _adam, _data, _full_params, _groups, _model
from tests.parity import assert_tensors_close, assert_trajectory_close
from tests.world import run_world


def _quantized_weights(rank, world_size):
    groups = create_process_groups(Topology(world_size))
    results = {}
    for stage in (1, 2, 3):
        for quantized in (False, True):
            model = _model(width=128)
            options = zero.ZeroOptions(stage=stage, bucket_size=2000, persistence_threshold=16,
                                       quantized_weights=quantized)
            module, optimizer = zero.initialize(model, _adam, options, groups.dp, param_groups=_groups(model),
                                                unit_modules=list(model))
            losses = []
            for inputs, targets in _data(6, 8):
                groups.stats.reset()  # the last step's bytes (the first also checks stage 3's gather order)
                x, y = inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]
                loss = nn.functional.mse_loss(module(x), y)
                loss.backward()
                losses.append(loss.item())
                optimizer.step()
                optimizer.zero_grad()
            gathered = groups.stats.bytes_by_operation()["all_gather"]
            aliased = any(slot.aliased for slot in optimizer.slots)
            results[stage, quantized] = (losses, _full_params(module, optimizer), aliased, gathered)
    return results


def test_quantized_weight_gathers_keep_replicas_equal_and_send_a_quarter_of_fp32():
    """--zero-quantized-weights at stages 1-3: every rank computes with the same (dequantized) weights,
    near the exact run's; the gathers send int8 plus a scale per 256 elements (under 0.3x fp32's bytes on
    this small model, whose short chunks pad their last block); stage 1/2 masters are then copies, never
    views of the buckets the gather overwrites (stage 3 gathers out of its shards, which may stay masters)."""
    ranks = run_world(2, _quantized_weights)
    for stage in (1, 2, 3):
        exact_losses, exact_params, exact_aliased, exact_bytes = ranks[0][stage, False]
        losses, params, aliased, sent = ranks[0][stage, True]
        for other in ranks[1:]:
            for a, b in zip(params, other[stage, True][1]):
                assert torch.equal(a, b), stage
        assert sent < 0.3 * exact_bytes, (stage, sent, exact_bytes)
        assert any(not torch.equal(a, b) for a, b in zip(params, exact_params))
        for a, b in zip(params, exact_params):  # Adam's steps of about lr whatever the gradient's size
            assert (a - b).norm() <= 0.05 * b.norm(), stage
        assert max(abs(a - b) / b for a, b in zip(losses, exact_losses)) < 0.02, (stage, losses, exact_losses)
        assert exact_aliased and aliased == (stage == 3)


CASES = {"zero3": {}, "hpz": {"secondary": True}, "qwz": {"quantized_weights": True},
         "hpz+qwz": {"secondary": True, "quantized_weights": True}, "qgz": {"quantized_gradients": True},
         "hpz+qwz+qgz": {"secondary": True, "quantized_weights": True, "quantized_gradients": True},
         "zero2": {"stage": 2}, "zero2+qgz": {"stage": 2, "quantized_gradients": True},
         "shard2": {"shard": True}}
MICRO_BATCHES = 2


def _zero_plus_plus(rank, world_size):
    """Every case on two nodes of 2 (dp 4, two micro-batches a step, 4 steps): losses, parameters, and the
    last step's bytes (all, and to another node) per operation."""
    groups = create_process_groups(Topology(world_size, gpus_per_node=2), dp_partitions=(2,))
    node, across = groups.dp_partition(2)
    results = {}
    for name, case in CASES.items():
        model = _model(width=128)
        stage = case.get("stage", 3)
        options = zero.ZeroOptions(stage=stage, bucket_size=5000, persistence_threshold=0,
                                   prefetch_budget=0,  # no unit kept: each gathered 4 times a step
                                   quantized_weights=case.get("quantized_weights", False),
                                   quantized_gradients=case.get("quantized_gradients", False),
                                   hpz_partition_size=2 if case.get("secondary") else 1,
                                   shard_size=2 if case.get("shard") else None)
        module, optimizer = zero.initialize(model, _adam, options,
                                            zero.ZeroGroups.from_parallel_groups(groups, options),
                                            param_groups=_groups(model), unit_modules=list(model))
        losses = []
        for inputs, targets in _data(4, 8 * MICRO_BATCHES):
            groups.stats.reset()  # the last step's bytes (the first also checks the gather order)
            mine = (inputs.chunk(world_size)[rank].chunk(MICRO_BATCHES),
                    targets.chunk(world_size)[rank].chunk(MICRO_BATCHES))
            for x, y in zip(*mine):
                loss = nn.functional.mse_loss(module(x), y) / MICRO_BATCHES
                loss.backward()
                losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        results[name] = {"sent": groups.stats.bytes_by_operation(),  # before the gather of every unit below
                         "crossing": groups.stats.inter_node_bytes_by_operation(),
                         "losses": losses, "params": _full_params(module, optimizer),
                         "held": optimizer.model_state_bytes(),
                         "unit_numel": sum(unit.numel for unit in optimizer.units.units) if stage == 3 else 0}
    return results


@pytest.fixture(scope="module")
def two_nodes():
    return run_world(4, _zero_plus_plus)


def _crossing(ranks, name, operation=None):
    """Bytes sent to another node in the last step, summed over the ranks (one operation, or all)."""
    return sum(r[name]["crossing"][operation] if operation else sum(r[name]["crossing"].values())
               for r in ranks)


def test_secondary_partition_keeps_the_numbers_and_gathers_across_nodes_once_a_step(two_nodes):
    """--zero-hpz-partition-size 2 on two nodes of 2 (dp 4, two micro-batches): the same losses and
    parameters as plain ZeRO-3, bit for bit (the secondary copy holds the primary gather's values, and a
    step makes it stale); of the four gathers of a unit per step (two forwards, two backwards) only the
    first crosses nodes; each rank holds 1/2 of the parameters more. With qwZ as well, the replicas hold
    the quantized run's numbers exactly."""
    for results in two_nodes:
        for name, exact in (("hpz", "zero3"), ("hpz+qwz", "qwz")):
            assert results[name]["losses"] == results[exact]["losses"], name
            for a, b in zip(results[name]["params"], results[exact]["params"]):
                assert torch.equal(a, b), name
        assert (results["hpz"]["crossing"]["all_gather"] * 2 * MICRO_BATCHES
                == results["zero3"]["crossing"]["all_gather"])
        # fp32
        assert results["hpz"]["held"] - results["zero3"]["held"] == results["zero3"]["unit_numel"] // 2 * 4
    assert _crossing(two_nodes, "zero3",
                     "all_gather") > 0  # the ring of dp 4 crosses nodes from ranks 1 and 3
    for other in two_nodes[1:]:  # replicas compute with identical weights
        for a, b in zip(two_nodes[0]["hpz+qwz"]["params"], other["hpz+qwz"]["params"]):
            assert torch.equal(a, b)


def test_quantized_gradients_stay_near_the_exact_run_and_zero_plus_plus_sends_under_0_3x_across_nodes(
        two_nodes):
    """--zero-quantized-gradients at stages 2 and 3: the reduce-scatter is replaced by two all-to-alls of
    int8 (within the node, then the node's partial sums across), replicas stay identical and the losses
    within 2% of the exact run; hpZ + qwZ + qgZ send under 0.3x plain ZeRO-3's bytes across nodes."""
    for quantized, exact in (("qgz", "zero3"), ("zero2+qgz", "zero2")):
        results = two_nodes[0][quantized]
        assert results["sent"]["reduce_scatter"] == 0 and results["sent"]["all_to_all"] > 0, quantized
        assert _crossing(two_nodes, quantized, "all_to_all") < 0.3 * _crossing(two_nodes, exact,
                                                                               "reduce_scatter")
        losses, exact_losses = results["losses"], two_nodes[0][exact]["losses"]
        assert max(abs(a - b) / b for a, b in zip(losses, exact_losses)) < 0.02, (quantized, losses,
                                                                                  exact_losses)
        assert any(not torch.equal(a, b) for a, b in zip(results["params"], two_nodes[0][exact]["params"]))
        for other in two_nodes[1:]:
            for a, b in zip(results["params"], other[quantized]["params"]):
                assert torch.equal(a, b), quantized
    everything, plain = _crossing(two_nodes, "hpz+qwz+qgz"), _crossing(two_nodes, "zero3")
    assert everything <= 0.3 * plain, (everything, plain)


@pytest.mark.parity
def test_shard_groups_with_replicas_reproduce_zero_3_and_keep_gathers_in_the_node(two_nodes):
    """Shard groups of 2 (one node each) replicated across the nodes: the losses and parameters of plain
    ZeRO-3 over dp 4 within 1e-5 (another summation order), every gather and reduce-scatter within the
    node; only the replicas' all-reduce of the gradient shards crosses, fewer bytes than plain's."""
    for results in two_nodes:
        assert_trajectory_close(results["shard2"]["losses"], results["zero3"]["losses"], "shard groups: loss")
        assert_tensors_close(results["shard2"]["params"], results["zero3"]["params"],
                             "shard groups: parameters")
        assert (results["shard2"]["crossing"]["all_gather"]
                == results["shard2"]["crossing"]["reduce_scatter"] == 0)
    assert 0 < _crossing(two_nodes, "shard2") < _crossing(two_nodes, "zero3")


def test_secondary_partition_needs_stage_3():
    with pytest.raises(ValueError, match="--zero-hpz-partition-size 2 needs --zero-stage 3"):
        zero.initialize(_model(), _adam, zero.ZeroOptions(stage=2, hpz_partition_size=2),
                        AxisGroup("dp", (0, 1), None, CommStats()))
