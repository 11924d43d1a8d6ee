"""The chaos harness's plan and its comparison: faults at strictly increasing iterations that every start
reaches, save faults at saves, every kind present; two checkpoints differing in one tensor are told apart."""

import os

import pytest
import torch

from launch.tools.faults.chaos import KINDS, plan, tensor_differences


def test_the_plan_spreads_every_kind_of_fault_over_the_run():
    for seed in range(50):
        faults = plan(20, 300, 10, 4, seed)
        iterations = [fault["iteration"] for fault in faults]
        assert iterations == sorted(set(iterations)) and iterations[-1] < 300
        assert {fault["kind"] for fault in faults} == {kind for kind, _, _ in KINDS}
        assert all(fault["iteration"] % 10 == 0 for fault in faults if fault["kind"] in ("save", "fullsave"))
        assert all(0 <= fault["rank"] < 4 for fault in faults)
    assert plan(20, 300, 10, 4, 1) != plan(20, 300, 10, 4, 2) and plan(6, 40, 5, 4, 3) == plan(6, 40, 5, 4, 3)
    with pytest.raises(ValueError, match="give more --iterations"):
        plan(20, 30, 10, 4, 0)


def test_checkpoints_that_differ_in_one_tensor_are_told_apart(tmp_path):
    state = {"model": {"w": torch.arange(6.0)}, "optimizer": [torch.ones(3), {"step": 4}]}
    for name in ("a", "b"):
        os.makedirs(tmp_path / name)
        torch.save(state, tmp_path / name / "rank_00000.pt")
    assert tensor_differences(str(tmp_path / "a"), str(tmp_path / "b")) == []
    state["optimizer"][0][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    torch.save(state, tmp_path / "b" / "rank_00000.pt")
    assert tensor_differences(str(tmp_path / "a"), str(tmp_path / "b")) == ["rank_00000.pt/optimizer/0"]
