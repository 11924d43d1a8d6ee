"""Context parallelism in training: every layout it composes with reproduces one process's trajectory."""

import pytest

from tests.parity import assert_trajectory_close
from tests.pretrain.test_architectures import LLAMA
from tests.pretrain.test_trainer import COMPILED, _assert_same_trajectory, _pp, _short, _tp, _train
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
    # all-gather attention runs in the per-layer case, document masking and resume (the 8-rank grids
    # are the topology test's): each composition once keeps the test inside the suite's time
    four = {"cp2 p2p": _cp(2), "cp2 a2a": _cp(2, "a2a"), "cp4 p2p": _cp(4), "cp4 a2a": _cp(4, "a2a"),
            "cp2 x tp2 SP p2p": _cp(2) + _tp(2, "--sequence-parallel"),
            "cp2 x pp2 1f1b": _cp(2) + _pp(2),
            "cp2 x pp2 interleaved a2a": _cp(2, "a2a") + _pp(2, "interleaved",
                                                             "--virtual-pipeline-size", "2"),
            "cp2 x dp2 ZeRO-1": _cp(2, "p2p", "--zero-stage", "1"),
            "cp2 x dp2 ZeRO-2 a2a": _cp(2, "a2a", "--zero-stage", "2"),
            "cp2 x dp2 ZeRO-3 full recompute": _cp(2, "p2p", "--zero-stage", "3", "--recompute-granularity",
                                                   "full"),
            "cp2 per-layer types, selective recompute": ["--context-parallel-size", "2", "--cp-comm-type",
                                                         "p2p", "a2a", "allgather", "p2p",
                                                         "--recompute-granularity", "selective"]}
    _assert_all_follow(run_world(4, _train, _short(four.values()), stdlib_corpus, timeout_s=600),
                       references["gpt"], list(four))
    llama = {"llama cp4 p2p": _cp(4),
             "llama cp2 x tp2 SP": _cp(2) + _tp(2, "--sequence-parallel"),
             "llama cp2 x pp2 interleaved": _cp(2) + _pp(2, "interleaved", "--virtual-pipeline-size", "2"),
             "llama cp2 x dp2 ZeRO-3": _cp(2, "a2a", "--zero-stage", "3")}
    _assert_all_follow(run_world(4, _train, _short(LLAMA + flags for flags in llama.values()),
                                 stdlib_corpus, timeout_s=600), references["llama"], list(llama))


DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


@pytest.mark.parity
def test_document_masking_reproduces_one_process_with_context_and_pipeline_parallelism(short_documents):
    (plain, *_), (masked, *_), (llama, *_) = run_world(1, _train, [[], DOCUMENTS, LLAMA + DOCUMENTS],
                                                       short_documents)[0]
    assert all(abs(a - b) > 1e-3 for a, b in zip(plain, masked))  # the masks change every step's loss
    layouts = {"cp2 x tp2 SP": _cp(2) + _tp(2, "--sequence-parallel"), "pp2": _pp(2),
               "cp2 a2a x pp2": _cp(2, "a2a") + _pp(2), "cp4 allgather": _cp(4, "allgather")}
    runs = run_world(4, _train, _short([DOCUMENTS + flags for flags in layouts.values()]
                                       + [LLAMA + DOCUMENTS + _cp(2) + _tp(2)]), short_documents,
                     timeout_s=600)
    compiled = run_world(2, _train, _short([LLAMA + DOCUMENTS + _cp(2) + COMPILED]), short_documents)
    runs = [four + two for four, two in zip(runs, 2 * compiled)]
    references = [masked] * len(layouts) + [llama, llama]
    names = [*layouts, "llama cp2 x tp2", "llama cp2 compiled"]
    for rank_results in runs:
        for (losses, *_, unexpected), reference, name in zip(rank_results, references, names):
            assert_trajectory_close(losses, reference[:len(losses)], f"documents {name}: loss")
            assert not unexpected, unexpected  # a compiled layer's graphs break at communication only


@pytest.mark.parity
def test_a_checkpoint_saved_at_cp2_x_tp2_resumes_at_cp1_and_cp4(references, stdlib_corpus, tmp_path):
    saved = str(tmp_path / "cp2tp2")
    run_world(4, _train, [LLAMA + _cp(2) + _tp(2) + ["--train-iters", "5", "--lr-decay-iters", "10",
                                                     "--save", saved]], stdlib_corpus)
    resumed = run_world(4, _train, [LLAMA + flags + ["--load", saved] for flags in
                                    (_tp(2, "--zero-stage", "1"), _cp(4), _cp(2, "allgather") + _tp(2))],
                        stdlib_corpus, timeout_s=600)
    losses, norms = references["llama"]
    for rank_results in resumed:
        for (got, got_norms, *_), name in zip(rank_results,
                                              ("cp1 x dp2 x tp2 ZeRO-1", "cp4", "cp2 x tp2 allgather")):
            assert_trajectory_close(got, losses[5:], f"resumed at {name}: loss")
            assert_trajectory_close(got_norms, norms[5:], f"resumed at {name}: grad norm")
