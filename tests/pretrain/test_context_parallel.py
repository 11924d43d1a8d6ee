"""Context parallelism in training: every layout it composes with reproduces one process's trajectory."""

import pytest

from tests.pretrain.test_architectures import LLAMA
from tests.pretrain.test_trainer import _assert_same_trajectory, _pp, _tp, _train
from tests.world import run_world


def _cp(size, kind="p2p", *extra):
    return ["--context-parallel-size", str(size), "--cp-comm-type", kind, *extra]


@pytest.fixture(scope="module")
def references(stdlib_corpus):
    gpt, llama = run_world(1, _train, [[], LLAMA], stdlib_corpus)[0]
    return {"gpt": gpt[:2], "llama": llama[:2]}


def _assert_all_follow(results, references, names):
    """Every rank's run of layout i follows references[i] (one reference for all layouts, or one each)."""
    references = references if isinstance(references, list) else [references] * len(names)
    for rank_results in results:
        assert len(rank_results) == len(names)
        for (losses, norms, *_), reference, name in zip(rank_results, references, names):
            _assert_same_trajectory((losses, norms), reference, name)


@pytest.mark.parity
def test_context_parallel_layouts_reproduce_the_single_process_run(references, stdlib_corpus):
    zero = [_cp(2, "p2p", "--zero-stage", str(stage)) for stage in (1, 2, 3)]
    four = {"cp2 p2p": _cp(2), "cp2 a2a": _cp(2, "a2a"), "cp2 allgather": _cp(2, "allgather"),
            "cp4 p2p": _cp(4), "cp4 a2a": _cp(4, "a2a"),
            "cp2 x tp2 SP p2p": _cp(2) + _tp(2, "--sequence-parallel"),
            "cp2 x tp2 SP a2a": _cp(2, "a2a") + _tp(2, "--sequence-parallel"),
            "cp2 x pp2 1f1b": _cp(2) + _pp(2),
            "cp2 x pp2 interleaved a2a": _cp(2, "a2a") + _pp(2, "interleaved",
                                                             "--virtual-pipeline-size", "2"),
            **{f"cp2 x dp2 ZeRO-{stage}": flags for stage, flags in zip((1, 2, 3), zero)},
            "cp2 x dp2 ZeRO-3 full recompute": _cp(2, "p2p", "--zero-stage", "3", "--recompute-granularity",
                                                   "full"),
            "cp2 per-layer types, selective recompute": ["--context-parallel-size", "2", "--cp-comm-type",
                                                         "p2p", "a2a", "allgather", "p2p",
                                                         "--recompute-granularity", "selective"]}
    _assert_all_follow(run_world(4, _train, list(four.values()), stdlib_corpus, timeout_s=600),
                       references["gpt"], list(four))
    llama = {"llama cp2 p2p": _cp(2), "llama cp2 a2a": _cp(2, "a2a"), "llama cp4 p2p": _cp(4),
             "llama cp2 x tp2 SP": _cp(2) + _tp(2, "--sequence-parallel"),
             "llama cp2 x pp2 interleaved": _cp(2) + _pp(2, "interleaved", "--virtual-pipeline-size", "2"),
             "llama cp2 x dp2 ZeRO-3": _cp(2, "a2a", "--zero-stage", "3")}
    _assert_all_follow(run_world(4, _train, [LLAMA + flags for flags in llama.values()], stdlib_corpus,
                                 timeout_s=600), references["llama"], list(llama))
    eight = {"cp2 x tp2 x pp2": _cp(2) + _tp(2, "--sequence-parallel") + _pp(2),
             "cp4 x dp2 ZeRO-2": _cp(4, "p2p", "--zero-stage", "2"),
             "llama cp2 x dp2 x tp2 ZeRO-3 a2a": LLAMA + _cp(2, "allgather", "--zero-stage", "3") + _tp(2)}
    _assert_all_follow(run_world(8, _train, list(eight.values()), stdlib_corpus, timeout_s=600),
                       [references["gpt"]] * 2 + [references["llama"]], list(eight))
