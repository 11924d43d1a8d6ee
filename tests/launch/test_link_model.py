"""The link model's overlap term: what hides behind a pass's compute, what each backend's collectives
send off a node, and the benchmark's inverse of it."""

import math

import pytest

from launch.bench.slow_link import compute_of
from launch.tools.planning.link_model import Device, Links, ZeroCommOptions, step_seconds, zero_transfers
from launch.tools.planning.plan import Layout, plan_layout
from parallel.topology import Topology
from pretrain.config.arguments import parse_config

LINKS = Links(3e9, 0.12e9, 14e-6)  # 24 Gbit/s in a node, 0.96 Gbit/s across
PARAMS, LAYERS = 14_000_000, 4


def _zero_3(backend: str, options: ZeroCommOptions = ZeroCommOptions(), micro_batches: int = 2):
    return zero_transfers(Topology(4, 1, 1, gpus_per_node=2), PARAMS, 3, micro_batches, 2, 4,
                          options, backend=backend,
                          pieces=LAYERS)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_pass_hides_what_its_backend_hides_and_no_more(backend):
    found = _zero_3(backend)
    total = sum(t.seconds(LINKS) for t in found)
    # nothing to hide behind: the serial sum
    assert step_seconds(found, LINKS, 0.0, 2) == pytest.approx(total)
    # compute long enough for every hidden share: compute plus what no pass can hide. NCCL hides all but a
    # pass's first gather / last reduction (one of its layers); on gloo nothing hides (as measured)
    shares = [0.0] * 3 if backend == "gloo" else [1 - 1 / LAYERS] * 3
    dp = [t for t in found if t.axis == "dp"]
    assert [(t.operation, t.phase) for t in dp] == [("all_gather", "forward"), ("all_gather", "backward"),
                                                    ("reduce_scatter", "backward")]
    assert [t.overlap for t in dp] == pytest.approx(shares)
    long = 100.0
    hidden = sum(share * t.seconds(LINKS) for share, t in zip(shares, dp))
    assert step_seconds(found, LINKS, 3 * long, 2) == pytest.approx(3 * long + total - hidden)
    # in between: never below the compute, never above compute + the serial sum, and growing with compute
    steps = [step_seconds(found, LINKS, c, 2) for c in (0.2, 0.5, 1.0, 2.0)]
    assert steps == sorted(steps)
    for c, step in zip((0.2, 0.5, 1.0, 2.0), steps):
        assert max(c, total) <= step + 1e-12 and step <= c + total + 1e-12


def test_gloos_reduce_scatter_leaves_a_node_as_an_all_to_all_and_hides_only_behind_its_micro_batches():
    # dp 4 on two nodes of 2: around NCCL's ring ranks 1 -> 2 and 3 -> 0 cross, (n-1)/n of the gradients
    # each; gloo's all-to-all sends each of a node's two ranks' two parts for the other node, 1/n each
    gloo, nccl = ([t for t in _zero_3(b) if t.operation == "reduce_scatter"][0] for b in ("gloo", "nccl"))
    gradients = 4 * PARAMS
    assert gloo.per_rank == nccl.per_rank == pytest.approx(gradients * 3 / 4)
    assert nccl.leaving_node == pytest.approx(gradients * 3 / 4)
    assert gloo.leaving_node == pytest.approx(2 * 2 * gradients / 4)
    # stage 1 reduce-scatters once, in the last micro-batch's backward: of 4 micro-batches' backward
    # compute it can hide behind a quarter only
    stage1 = zero_transfers(Topology(4, 1, 1, gpus_per_node=2), PARAMS, 1, 4, 2, 4,
                            backend="nccl", pieces=LAYERS)
    reduce = next(t for t in stage1 if t.operation == "reduce_scatter")
    backward = 0.5 * reduce.seconds(LINKS)
    alone = step_seconds([reduce], LINKS, backward, 4, forward_share=0.0)
    assert alone == pytest.approx(backward + reduce.seconds(LINKS) - backward / 4)


def test_the_quantize_passes_are_compute_of_the_pass_they_run_in():
    found = _zero_3("nccl", ZeroCommOptions(2, True, True))
    elements = sum(t.count * t.quantized_elements for t in found)
    # qwZ: the first gather quantizes its shard and dequantizes all (1 + 1/4); qgZ: each of 2 micro-batches
    # quantizes and dequantizes the gradients at the node level (2x) and a half of them across (2 x 1/2)
    assert elements == pytest.approx(PARAMS * (1.25 + 2 * (2 + 1)))
    long = 100.0
    fast, slow = (step_seconds(found, LINKS, 3 * long, 2, rate) for rate in (math.inf, 1e8))
    assert slow - fast == pytest.approx(elements / 1e8)


def test_the_benchmarks_compute_is_the_inverse_of_its_prediction():
    found = _zero_3("gloo", ZeroCommOptions(hpz=2))
    floor = step_seconds(found, LINKS, 0.0, 2)  # the links alone
    for measured in (1.2 * floor, 2 * floor, 5 * floor):
        compute = compute_of(measured, found, LINKS, 2)
        assert step_seconds(found, LINKS, compute, 2) == pytest.approx(measured, rel=1e-9)


def test_the_planner_prices_the_quantize_passes_at_the_devices_rate():
    """The slow-link benchmark's GPT on two nodes of 2 over 0.96 Gbit/s on gloo, at the quantize rate of
    ranks sharing 2 CPU cores (1.4e8 elements/s): the layouts in the order measured there (shard groups
    of a node, hpZ + qwZ + qgZ, ZeRO-2, hpZ, ZeRO-3: 1.28, 1.64, 1.79, 1.84, 2.74 s); at a GPU's rate only
    the quantized layout gains."""
    model = parse_config(["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads",
                          "8", "--seq-length",
                          "64", "--vocab-size", "4096", "--bf16"]).model
    runs = {"shard groups": (3, ZeroCommOptions(shard_size=2)), "ZeRO-2": (2, ZeroCommOptions()),
            "hpZ": (3, ZeroCommOptions(hpz=2)), "hpZ + qwZ + qgZ": (3, ZeroCommOptions(2, True, True)),
            "ZeRO-3": (3, ZeroCommOptions())}

    def seconds(quantize_rate: float) -> dict[str, float]:
        device = Device(1.4e10, quantize_rate, "gloo")
        return {name: plan_layout(model, Layout(1, 1, 4, stage, zero=options), 8, 2,
                                  persistence_threshold=1000,
                                  grad_bytes=4, gpus_per_node=2, links=LINKS, device=device).step_seconds
                for name, (stage, options) in runs.items()}

    cpu, gpu = seconds(1.4e8), seconds(1e11)
    assert sorted(cpu, key=cpu.get) == ["shard groups", "hpZ + qwZ + qgZ", "ZeRO-2", "hpZ", "ZeRO-3"]
    assert gpu["hpZ + qwZ + qgZ"] < cpu["hpZ + qwZ + qgZ"]
    assert all(cpu[name] == gpu[name] for name in cpu if name != "hpZ + qwZ + qgZ")
