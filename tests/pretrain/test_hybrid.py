"""Hybrid models (--hybrid-layer-pattern with a Mamba-2, a gated delta net and a Kimi delta attention
layer; attention with its output gate, as Qwen3-Next's; the attention layer and the MLP post-norm, the
delta net's beta up to 2, as OLMo hybrid's) trained in every layout against one process: tp +
SP, pp by the pattern's |, interleaved, cp by the head exchange (whole groups, and Mamba groups cut into
head shares), ZeRO 1-3, recompute (full, and the mamba module), --compile, documents; a checkpoint re-cut
between layouts resumes on the trajectory."""

import pytest

from tests.parity import assert_trajectory_close
from tests.pretrain.test_trainer import COMPILED, SHORT, _train
from tests.world import run_world

MAMBA = ["--mamba-head-dim", "16", "--mamba-num-groups", "2", "--mamba-state-dim", "16", "--mamba-chunk-size",
         "8", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
         "--linear-num-key-heads", "4", "--linear-num-value-heads", "8", "--linear-key-head-dim", "8",
         "--linear-value-head-dim", "8", "--attention-output-gate",
         # OLMo hybrid's parts: the attention layer and the MLP post-norm, beta up to 2, the delta net's
         # output norm of an epsilon of its own
         "--post-norm-layers", "1", "4", "--linear-allow-neg-eigval", "--linear-output-norm-epsilon", "1e-5"]
HYBRID = ["--hybrid-layer-pattern", "M*GK-"] + MAMBA + SHORT
CUT = ["--hybrid-layer-pattern", "M*|GK-"] + MAMBA + SHORT
DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids"]
TP2, CP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"], ["--context-parallel-size", "2"]
ZERO3 = ["--zero-stage", "3", "--zero-persistence-threshold", "0"]
MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest"]

# name: (flags, the one-process run they follow)
LAYOUTS = {
    "tp2 + SP": (HYBRID + TP2, "hybrid"),
    "pp2 by the pattern's |, ZeRO-1": (CUT + ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"],
                                       "hybrid"),
    "pp2 x vp2 (four | segments), interleaved": (
        ["--hybrid-layer-pattern", "M|*|GK|-"] + MAMBA + SHORT + ["--pipeline-model-parallel-size", "2"],
        "hybrid"),
    "cp2 (whole groups per cp rank), mamba recomputed, ZeRO-2": (
        HYBRID + CP2 + ["--recompute-granularity", "selective", "--recompute-modules", "mamba", "layernorm",
                        "--zero-stage", "2"], "hybrid"),
    "cp4 (each Mamba group's heads in two shares, one key head per rank)": (
        HYBRID + ["--context-parallel-size", "4"], "hybrid"),
    "tp2 + SP x cp2, compiled": (HYBRID + TP2 + CP2 + COMPILED, "hybrid"),
    "dp4 ZeRO-3, full recompute": (HYBRID + ZERO3 + ["--recompute-granularity", "full"], "hybrid"),
    "Muon (out_projs orthogonalized; in_projs, convs and vectors AdamW): tp2 + SP, ZeRO-1": (
        HYBRID + MUON + TP2 + ["--zero-stage", "1"], "muon"),
    "documents: cp2 x tp2 + SP": (HYBRID + DOCUMENTS + CP2 + TP2, "documents"),
    "documents: dp2 x pp2, ZeRO-3, mixers recomputed": (
        CUT + DOCUMENTS + ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "selective",
                           "--recompute-modules", "mamba"] + ZERO3, "documents"),
}


@pytest.mark.parity
def test_hybrid_layouts_reproduce_one_process_and_a_checkpoint_recuts(stdlib_corpus, tmp_path):
    """Each layout within the fp32 bound of one process at every iteration; a checkpoint saved after 3
    iterations at tp2 + SP resumes at pp2 (the pattern cut by |) and at cp2 x dp2 ZeRO-3 (the pattern taken
    from the checkpoint) on the straight run's trajectory."""
    hybrid, documents, muon = run_world(1, _train, [HYBRID, HYBRID + DOCUMENTS, HYBRID + MUON],
                                        stdlib_corpus)[0]
    references = {"hybrid": hybrid, "documents": documents, "muon": muon}
    saved = str(tmp_path / "tp2")
    resumes = [HYBRID + TP2 + ["--train-iters", "3", "--save", saved],
               CUT + ["--pipeline-model-parallel-size", "2", "--load", saved],
               MAMBA + SHORT + CP2 + ZERO3 + ["--num-layers", "5", "--load", saved]]  # (the pattern's count)
    results = run_world(4, _train, [flags for flags, _ in LAYOUTS.values()] + resumes, stdlib_corpus,
                        timeout_s=600)[-1]
    for (name, (_, reference)), result in zip(LAYOUTS.items(), results):
        for what, got, want in zip(("loss", "grad norm"), result[:2], references[reference][:2]):
            assert_trajectory_close(got, want, f"{name}: {what}")
        assert not result[5], (name, result[5])  # --compile: graph breaks at communication only
    for name, resumed in zip(("pp2", "cp2 x dp2 ZeRO-3"), results[-2:]):
        for what, got, want in zip(("loss", "grad norm"), resumed[:2], hybrid[:2]):
            assert_trajectory_close(got, want[3:], f"resumed at {name}: {what}")
