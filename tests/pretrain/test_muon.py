"""Muon (--optimizer muon) against one process: every layout and ZeRO stage, offloaded, with pipelines,
context and expert parallelism, within the fp32 trajectory bound; a checkpoint re-cut across dp, tp and
ZeRO stage on the straight trajectory."""

import pytest

from pretrain.config.arguments import ConfigError, parse_config
from pretrain.startup.validation import validate
from tests.parity import assert_trajectory_close
from tests.pretrain.test_moe import EP2, MOE
from tests.pretrain.test_trainer import COMPILED, SHORT, TINY, ZERO3, _pp, _tp, _train
from tests.world import run_world

# Newton-Schulz in fp32: under bf16 iterations ("medium", Megatron's default) two layouts' updates differ
# by a bf16 rounding wherever their fp32 inputs do, which no fp32 bound covers
MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest", "--muon-use-nesterov"]
# the tiny model's largest logits are 0.10-0.17: this clips some heads of some layers at every step
SGD = ["--optimizer", "sgd", "--sgd-momentum", "0.9", "--lr", "0.05"]
QK = ["--qk-clip", "--qk-clip-threshold", "0.12", "--qk-clip-alpha", "0.3"]


def _assert_on(got, want, iterations, what):
    for name, values, reference in zip(("loss", "grad norm"), got[:2], want):
        assert_trajectory_close(values, reference[iterations], f"{what}: {name}")


@pytest.mark.parity
def test_muon_reproduces_one_process_in_every_layout_and_resumes_re_cut(stdlib_corpus, tmp_path):
    """dp4 at ZeRO 0-3, optimizer on the CPU and in NVMe swap files, tp2 + SP x dp2 (whole matrices),
    pp2 interleaved x dp2, cp2 x dp2, compiled layers, and a MoE model at ep2 x dp2: each within the fp32
    trajectory bound of its one-process run. Saved at dp2 x tp2 ZeRO-1, resumed at dp4 ZeRO-3 and at dp1;
    resuming it with AdamW is refused unless --no-load-optim. QK-clip at tp2 x dp2 ZeRO-3 (the clipped rows
    scaled in sharded masters) and pp2 x dp2 on the one-process trajectory of a run that clips every step;
    --optimizer sgd at dp4 ZeRO-2 on its one-process trajectory."""
    references = [MUON + SHORT, MUON + MOE, MUON + SHORT + QK, SGD + SHORT]
    dense, moe, clipped, sgd = run_world(1, _train, references, stdlib_corpus)[0]
    assert clipped[0][-1] != dense[0][-1]  # the clip changed the run
    saved = str(tmp_path / "muon")
    layouts = {
        **{f"dp4 ZeRO-{stage}": ["--zero-stage", stage] for stage in "0123"},
        "dp4 ZeRO-2, optimizer on the CPU": ["--zero-stage", "2", "--offload-optimizer", "cpu"],
        "dp4 ZeRO-3, optimizer in NVMe files": ZERO3 + ["--offload-optimizer", "nvme", "--nvme-path",
                                                        str(tmp_path), "--zero-sub-group-size", "30000"],
        "tp2 + SP x dp2 ZeRO-1": _tp(2, "--sequence-parallel", "--zero-stage", "1"),
        "pp2 interleaved x dp2 ZeRO-2": _pp(2, "interleaved", "--virtual-pipeline-size", "2",
                                            "--zero-stage", "2"),
        "cp2 x dp2 ZeRO-3": ["--context-parallel-size", "2", *ZERO3],
        "dp4 ZeRO-1, layers compiled": ["--zero-stage", "1", *COMPILED],
    }
    resumes = {"saved at dp2 x tp2 ZeRO-1": _tp(2, "--zero-stage", "1", "--train-iters", "3",
                                                "--save", saved),
               "resumed at dp4 ZeRO-3": ZERO3 + ["--load", saved]}
    runs = [MUON + SHORT + flags for flags in [*layouts.values(), *resumes.values()]]
    runs.append(MUON + MOE + EP2 + ["--zero-stage", "1"])
    clips = {"QK-clip at tp2 x dp2 ZeRO-3": _tp(2, *ZERO3),
             "QK-clip at pp2 x dp2 ZeRO-1": _pp(2, "1f1b", "--zero-stage", "1")}
    runs += [MUON + SHORT + QK + flags for flags in clips.values()]
    runs.append(SGD + SHORT + ["--zero-stage", "2"])
    results = run_world(4, _train, runs, stdlib_corpus, timeout_s=400)
    one, = run_world(1, _train, [MUON + SHORT + ["--load", saved]], stdlib_corpus)[0]
    _assert_on(one, dense, slice(3, 6), "resumed at dp1")
    prefix, tokenizer = stdlib_corpus
    data = ["--data-path", prefix, "--tokenizer-model", tokenizer, "--load", saved]
    with pytest.raises(ConfigError, match=r"^--optimizer adam: the checkpoint's states are muon's; resume "
                                          r"with --optimizer muon, or add --no-load-optim"):
        validate(parse_config(TINY + data), 1)
    validate(parse_config(TINY + data + ["--no-load-optim"]), 1)  # a fresh AdamW at the checkpoint's step
    for rank_results in results:
        for name, got in zip(layouts, rank_results):
            _assert_on(got, dense, slice(0, 6), name)
        for (name, _), got in zip(resumes.items(), rank_results[len(layouts):]):
            _assert_on(got, dense, slice(0, 3) if name.startswith("saved") else slice(3, 6), name)
        _assert_on(rank_results[-4], moe, slice(0, 6), "MoE at ep2 x dp2 ZeRO-1")
        for name, got in zip(clips, rank_results[-3:-1]):
            _assert_on(got, clipped, slice(0, 6), name)
        _assert_on(rank_results[-1], sgd, slice(0, 6), "SGD at dp4 ZeRO-2")
