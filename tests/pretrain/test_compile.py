"""--compile with inductor's own kernels (C++ on the CPU): the GPT and the Llama-class model follow their
eager runs within the fp32 trajectory bound, each layer kind one graph and the loss head one, with no
graph break at tp = 1 (the layouts, with graphs captured but torch's kernels: test_trainer,
test_architectures and test_context_parallel)."""

import pytest

from tests.parity import assert_trajectory_close
from tests.pretrain.test_architectures import LLAMA
from tests.pretrain.test_trainer import SHORT, _train
from tests.world import run_world


def _graphs(rank, world_size, corpus):
    from models.compile import CompileReport

    results = _train(rank, world_size, [SHORT, SHORT + ["--compile"], LLAMA + SHORT,
                                        LLAMA + SHORT + ["--compile"]], corpus)
    return results, CompileReport.now()


@pytest.mark.parity
def test_inductor_kernels_follow_the_eager_run(stdlib_corpus):
    (gpt, gpt_compiled, llama, llama_compiled), report = run_world(1, _graphs, stdlib_corpus,
                                                                   timeout_s=600)[0]
    for eager, compiled, name in ((gpt, gpt_compiled, "gpt"), (llama, llama_compiled, "llama")):
        assert_trajectory_close(compiled[0], eager[0], f"inductor {name}: loss")
        assert_trajectory_close(compiled[1], eager[1], f"inductor {name}: grad norm")
    # the GPT's layer and head; Llama's global and windowed layers (another mask, another rope base) and
    # its untied head: nothing breaks a graph at tp = 1 without context parallelism
    assert report.breaks == {} and report.graphs == 5, report.describe()
