"""Topology rank algebra against megatron-core's RankGenerator, and its error messages."""

import subprocess
import sys
import warnings

import pytest

from parallel.topology import Topology


def _layouts(max_world: int):
    for world in range(1, max_world + 1):
        for tp in range(1, world + 1):
            for pp in range(1, world // tp + 1):
                for cp in range(1, world // (tp * pp) + 1):
                    if world % (tp * pp * cp) == 0:
                        yield world, tp, pp, cp


def test_groups_match_megatron_rank_generator():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.parallel_state import RankGenerator

    checked = with_cp = 0
    for world, tp, pp, cp in _layouts(64):
        topology = Topology(world, tp, pp, cp)
        oracle = RankGenerator(tp=tp, ep=1, dp=topology.dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        for axis in ("tp", "cp", "dp", "pp", "dp-cp"):
            assert sorted(topology.groups(axis)) == sorted(oracle.get_ranks(axis)), (world, tp, pp, cp, axis)
        assert sorted(topology.groups("mp")) == sorted(sorted(g) for g in oracle.get_ranks("tp-pp"))
        for rank in range(world):  # the coordinates name the rank's place in each of its groups
            p, d, t = topology.coords(rank)
            assert topology.rank(p, d, t, topology.cp_rank(rank)) == rank
        checked += 1
        with_cp += cp > 1
    assert checked > 1000 and with_cp > 500


def test_expert_groups_equal_megatron_cores_expert_rank_generator():
    """Every layout of up to 64 ranks with expert parallelism: each expert group, in megatron-core's own
    order (groups and ranks within them), as its expert rank generator makes it; the pipeline groups of the
    two grids are the same."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.parallel_state import RankGenerator

    checked = 0
    for world in range(1, 65):
        for etp in range(1, world + 1):
            for ep in range(1, world // etp + 1):
                for pp in range(1, world // (etp * ep) + 1):
                    if world % (etp * ep * pp):
                        continue
                    topology = Topology(world, pp=pp, ep=ep, etp=etp)
                    oracle = RankGenerator(tp=etp, ep=ep, dp=topology.edp, pp=pp, cp=1,
                                           order="tp-cp-ep-dp-pp")
                    for axis, theirs in (("etp", "tp"), ("ep", "ep"), ("etp-ep", "tp-ep"),
                                         ("etp-ep-pp", "tp-ep-pp"), ("edp", "dp")):
                        assert topology.groups(axis) == oracle.get_ranks(theirs), (world, etp, ep, pp, axis)
                    assert sorted(topology.groups("pp")) == sorted(oracle.get_ranks("pp"))
                    checked += 1
    assert checked > 700
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by --expert-tensor-parallel-size 1 "
                                         r"\(not given: it defaults to --tensor-model-parallel-size; give "
                                         r"it, e.g. 1\) x --expert-model-parallel-size 4"):
        Topology(6, ep=4)
    with pytest.raises(ValueError, match="world size 6 is not divisible by --expert-tensor-parallel-size 1 "
                                         "x"):
        Topology(6, ep=4, etp=1)  # given: named as given
    assert Topology(8, tp=2, ep=2).expert_tp == 2 and Topology(8, tp=2, ep=2, etp=1).edp == 4


def test_coords_and_rank_are_inverse_and_follow_the_formula():
    topology = Topology(24, tp=2, pp=3)
    assert topology.dp == 4
    for rank in range(24):
        p, d, t = topology.coords(rank)
        assert rank == t + 2 * (d + 4 * p)
        assert topology.rank(pp=p, dp=d, tp=t) == rank


def test_every_axis_partitions_the_world():
    topology = Topology(16, tp=2, pp=2)
    for axis, size in (("tp", 2), ("dp", 4), ("pp", 2), ("mp", 4)):
        groups = topology.groups(axis)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(16))


def test_embedding_groups_are_first_and_last_stage():
    topology = Topology(8, tp=2, pp=4)
    for ranks in topology.groups("embedding"):
        stages = [topology.coords(r)[0] for r in ranks]
        assert stages == [0, 3]
        assert len({topology.coords(r)[1:] for r in ranks}) == 1
    assert Topology(4, tp=2, pp=1).groups("embedding") == [[0], [1], [2], [3]]


@pytest.mark.parametrize("args, words", [
    ((6, 4, 1), ["world size 6", "not divisible", "--tensor-model-parallel-size 4"]),
    ((8, 3, 1), ["not divisible", "x --pipeline-model-parallel-size 1 = 3"]),
    ((4, 8, 1), ["--tensor-model-parallel-size 8 is larger than the world size 4"]),
    ((4, 1, 5), ["--pipeline-model-parallel-size 5 is larger"]),
    ((0, 1, 1), ["world size must be an integer >= 1"]),
    ((4, 0, 1), ["--tensor-model-parallel-size must be an integer >= 1"]),
    ((12, 2, 2, 2), ["world size 12", "x --context-parallel-size 2 x", "= 8", "change tp/cp/pp"]),
    ((4, 1, 1, 0), ["--context-parallel-size must be an integer >= 1"]),
])
def test_bad_layouts_are_rejected_with_the_numbers_and_the_fix(args, words):
    with pytest.raises(ValueError) as error:
        Topology(*args)
    for word in words:
        assert word in str(error.value)


def test_tp_group_across_nodes_warns():
    with pytest.warns(UserWarning, match="span nodes"):
        Topology(8, tp=4, pp=1, gpus_per_node=2).warn_if_tp_spans_nodes()
    assert Topology(16, tp=2, pp=2, gpus_per_node=8).tp_groups_spanning_nodes() == []


def test_cli_prints_groups_and_nodes():
    out = subprocess.run([sys.executable, "-m", "parallel.topology", "--world-size", "16",
                          "--tp", "2", "--pp", "2",
                          "--gpus-per-node", "8"], capture_output=True, text=True, check=True).stdout
    assert "world 16 = pp 2 x dp 4 x tp 2" in out
    assert "tp: [0@n0, 1@n0]" in out
    assert "pp: [0@n0, 8@n1]" in out
    out = subprocess.run([sys.executable, "-m", "parallel.topology", "--world-size", "16", "--tp", "2",
                          "--cp", "2", "--pp", "2"], capture_output=True, text=True, check=True).stdout
    assert "world 16 = pp 2 x dp 2 x cp 2 x tp 2" in out
    assert "cp: [0, 2] [1, 3]" in out and "dp-cp: [0, 2, 4, 6] [1, 3, 5, 7]" in out
    assert "6=(pp0,dp1,cp1,tp0)" in out
    bad = subprocess.run([sys.executable, "-m", "parallel.topology", "--world-size", "6", "--tp", "4"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not divisible" in bad.stderr
