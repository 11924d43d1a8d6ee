"""Mixture-of-experts training against one process: every expert layout (ep, etp, with tp + SP, pp, cp,
ZeRO 0-3 over the expert data-parallel group, both dispatchers, grouped product) follows the single-process
trajectory, dropless and with a capacity factor."""

import re

import pytest

from pretrain.config.arguments import ConfigError, parse_config
from pretrain.startup.validation import validate
from tests.parity import assert_trajectory_close
from tests.pretrain.test_trainer import SHORT, TINY, _train
from tests.world import run_world

# Qwen2-MoE-like: the first layer dense, then top-2 of 4 SwiGLU experts with a gated shared expert, the
# Switch balancing loss and the z-loss
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "([0]+[1]*3)", "--swiglu",
       "--moe-ffn-hidden-size", "64", "--moe-shared-expert-intermediate-size", "64",
       "--moe-shared-expert-gate",
       "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", *SHORT]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
CAPACITY = ["--moe-expert-capacity-factor", "1.0"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]

LAYOUTS = {
    "ep2 x tp2 + SP (etp 2), alltoall": (MOE + TP2 + ["--expert-model-parallel-size", "2"] + ALLTOALL, False),
    "tp2 + SP, etp 1 x ep2 (an expert grid unlike the dense one), allgather":
        (MOE + TP2 + ["--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"], False),
    "ep4 ZeRO-3, grouped product": (MOE + ["--expert-model-parallel-size", "4", "--zero-stage", "3",
                                           "--moe-grouped-gemm"] + ALLTOALL, False),
    "ep2 x expert dp 2 ZeRO-1, allgather": (MOE + ["--expert-model-parallel-size", "2", "--zero-stage", "1"],
                                            False),
    "ep2 x expert dp 2 ZeRO-2": (MOE + ["--expert-model-parallel-size", "2", "--zero-stage", "2"] + ALLTOALL,
                                 False),
    "ep2 x pp2 1F1B": (MOE + ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
                       + ALLTOALL, False),
    "ep2 x pp2 interleaved": (MOE + ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                     "2", "--num-layers-per-virtual-pipeline-stage", "1"] + ALLTOALL, False),
    "ep2 x cp2": (MOE + ["--expert-model-parallel-size", "2", "--context-parallel-size", "2"] + ALLTOALL,
                  False),
    "capacity: ep2 x tp2 + SP": (MOE + CAPACITY + TP2 + ["--expert-model-parallel-size", "2"] + ALLTOALL,
                                 True),
    "capacity: ep2 x cp2, full recompute": (MOE + CAPACITY + ["--expert-model-parallel-size", "2",
                                                              "--context-parallel-size", "2",
                                                              "--recompute-granularity", "full"], True),
}


@pytest.mark.parity
def test_expert_layouts_reproduce_one_process_and_a_checkpoint_recuts_across_ep(stdlib_corpus, tmp_path):
    """Each layout within the fp32 bound of one process at every iteration; a checkpoint saved after 3
    iterations at ep2 x tp2 + SP (etp 2, ZeRO-1) resumes at ep1 (dp4, ZeRO-3) and at ep4 (ZeRO-2) on the
    straight run's trajectory (the experts re-cut by name and expert tp slice)."""
    dropless, dropping = run_world(1, _train, [MOE, MOE + CAPACITY], stdlib_corpus)[0]
    assert dropless[0] != dropping[0]  # the capacity drops tokens: another trajectory
    saved = str(tmp_path / "ep2tp2")
    original = MOE + TP2 + ["--expert-model-parallel-size", "2", "--zero-stage", "1"] + ALLTOALL
    resumes = [original + ["--train-iters", "3", "--save", saved],
               MOE + ["--zero-stage", "3", "--load", saved],
               MOE + ["--expert-model-parallel-size", "4", "--zero-stage", "2", "--load", saved] + ALLTOALL]
    results = run_world(4, _train, [flags for flags, _ in LAYOUTS.values()] + resumes, stdlib_corpus,
                        timeout_s=600)[-1]
    for (name, (_, capacity)), result in zip(LAYOUTS.items(), results):
        reference = dropping if capacity else dropless
        for what, got, want in zip(("loss", "grad norm"), result[:2], reference[:2]):
            assert_trajectory_close(got, want, f"{name}: {what}")
    straight = results[0]  # ep2 x tp2 + SP, alltoall, ZeRO-0: the saved run's layout but its stage
    for name, resumed in zip(("ep1 ZeRO-3", "ep4 ZeRO-2"), results[-2:]):
        for what, got, want in zip(("loss", "grad norm"), resumed[:2], straight[:2]):
            assert_trajectory_close(got, want[3:], f"resumed at {name}: {what}")


@pytest.mark.parametrize("flags, world, message", [
    (["--expert-model-parallel-size", "2"], 2, "lay out experts: add --num-experts"),
    (MOE + TP2[:2], 2, "MoE layers with --tensor-model-parallel-size > 1 need --sequence-parallel"),
    (MOE + ["--expert-model-parallel-size", "3"], 3, "--expert-model-parallel-size 3 does not divide "
                                                     "--num-experts 4"),
    (MOE + ["--moe-layer-freq", "__import__('os').system('true')"], 1, "--moe-layer-freq"),
    (MOE + ["--expert-model-parallel-size", "2", "--zero-stage", "2", "--zero-hpz-partition-size", "2"], 2,
     "--zero-hpz-partition-size with --num-experts"),
])
def test_bad_expert_settings_name_the_flag(flags, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(parse_config(TINY + flags), world)
