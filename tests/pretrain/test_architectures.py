"""A Llama-class model (RMSNorm, SwiGLU, rope base 500000, grouped-query attention with 2 groups,
untied output layer, no linear biases, query/key norms; sliding windows of 8 tokens on every other
layer, those turning by a rope base of their own, as Gemma 3's local layers) against its
single-process run in every layout, with recompute and offload, a checkpoint of it re-cut to another
layout and exported; and a corpus tokenized with GPT-2 BPE through Megatron's preprocessing flags."""

import subprocess
import sys

import pytest
from safetensors.torch import load_file

from models.gpt import GPTModel
from parallel.comm import AxisGroup, CommStats
from pretrain.config.arguments import ConfigError, parse_config
from pretrain.interop.convert import main as convert
from pretrain.startup.validation import validate
from tests.data.bpe_files import write_gpt2_files
from tests.parity import assert_trajectory_close
from tests.pretrain.test_trainer import COMPILED, SHORT, TINY, _pp, _short, _tp, _train
from tests.world import run_world

LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--rotary-base", "500000",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--qk-layernorm",
         "--window-size", "7", "0", "--window-attn-skip-freq", "2", "--rotary-base-local", "10000"]


def _assert_follows(results, reference, what, start=0):
    for rank_results in results:
        for index, (losses, norms, *_) in enumerate(rank_results):
            assert_trajectory_close(losses, reference[0][start:start + len(losses)], f"{what} {index}: loss")
            assert_trajectory_close(norms, reference[1][start:start + len(norms)],
                                    f"{what} {index}: grad norm")


@pytest.mark.parity
def test_llama_class_model_reproduces_the_single_process_run_in_every_layout(stdlib_corpus, tmp_path):
    (losses, norms, *_), = run_world(1, _train, [LLAMA], stdlib_corpus)[0]
    assert losses[-1] < losses[0] - 0.3  # it learns
    saved = str(tmp_path / "interleaved")
    interleaved = _pp(2, "interleaved", "--virtual-pipeline-size", "2")
    recompute_offload = ["--zero-stage", "3", "--zero-persistence-threshold", "0",
                         "--recompute-granularity", "full",
                         "--offload-optimizer", "cpu"]
    # compiled where --compile must keep working (issue 49): interleaved stages, ZeRO-3's gathers around the
    # compiled layers under full recompute with the optimizer on the CPU, tp2 + SP (eager: the same layouts
    # in test_trainer, and the interleaved run below)
    two = run_world(2, _train, _short([LLAMA + _tp(2), LLAMA + _tp(2, "--sequence-parallel"), LLAMA + _pp(2),
                                       LLAMA + interleaved + COMPILED,
                                       LLAMA + _tp(2, "--zero-stage", "2", "--recompute-granularity",
                                                   "selective"),
                                       LLAMA + recompute_offload + COMPILED,
                                       LLAMA + _tp(2, "--sequence-parallel", *COMPILED)]), stdlib_corpus)
    _assert_follows(two, (losses, norms), "tp2 / tp2+SP / pp2 / compiled pp2 interleaved / tp2 ZeRO-2 "
                                          "selective / "
                                          "compiled dp2 ZeRO-3 full recompute, optimizer on the CPU / "
                                          "compiled tp2+SP")
    assert not any(run[5] for rank_results in two for run in rank_results)  # graph breaks: at communication
    # the interleaved run saved at iteration 5 (decaying as for 10) is re-cut for dp2 x tp2 x pp2 ZeRO-3
    run_world(2, _train,
              [LLAMA + interleaved + ["--train-iters", "5", "--lr-decay-iters", "10", "--save", saved]],
              stdlib_corpus)
    grid = LLAMA + _pp(2) + _tp(2, "--sequence-parallel") + ["--zero-stage", "3",
                                                             "--zero-persistence-threshold", "0"]
    straight, resumed = zip(*run_world(8, _train, [SHORT + grid, grid + ["--load", saved]],
                                       stdlib_corpus, timeout_s=400))
    _assert_follows([[run] for run in straight], (losses, norms), "dp2 x tp2 x pp2 ZeRO-3")
    _assert_follows([[run] for run in resumed], (losses, norms), "re-cut to dp2 x tp2 x pp2 ZeRO-3", start=5)
    # and exported: one file that the single-process model of the same flags loads, every name and shape
    convert(["--load", saved, "--output", str(tmp_path / "llama.safetensors")])
    config = parse_config(TINY + LLAMA + ["--vocab-size", "512"]).model
    GPTModel(config, AxisGroup("tp", (0,), None, CommStats()), seed=0).load_state_dict(
        load_file(str(tmp_path / "llama.safetensors")), strict=True)


def test_a_corpus_preprocessed_with_megatrons_flags_trains(tmp_path, stdlib_corpus):
    """GPT-2 BPE files, data.preprocess with Megatron's flags (and its output name), then training."""
    from tests.data.synthetic import make_documents, write_jsonl

    documents = make_documents(80)
    vocab, merges = write_gpt2_files(str(tmp_path / "gpt2"), documents)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents)
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    subprocess.run([sys.executable, "-m", "data.preprocess", "--input", corpus, "--output-prefix",
                    str(tmp_path / "corpus"), "--json-keys", "text", *tokenizer,
                    "--append-eod", "--workers", "2"],
                   check=True, capture_output=True, text=True)
    flags = [*tokenizer, "--data-path", str(tmp_path / "corpus_text_document"), "--data-cache-dir",
             str(tmp_path / "cache"), "--train-iters", "6", "--split", "90,10,0"]
    (losses, *_), = run_world(1, _train_with_flags, flags)[0]
    assert losses[-1] < losses[0]


def _train_with_flags(rank, world_size, flags):
    import torch

    from pretrain.training.trainer import Trainer

    config = parse_config(TINY + flags)
    trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
    return [(trainer.train().losses,)]


@pytest.mark.parametrize("flags, message", [
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-query-groups 3 does not divide --num-attention-"),
    (["--group-query-attention", "--num-query-groups", "2", *_tp(4)],
     "--tensor-model-parallel-size 4 does not divide --num-query-groups 2"),
    (["--num-query-groups", "2"], "--num-query-groups 2 needs --group-query-attention"),
    (["--swiglu", "--squared-relu"],
     "--swiglu, --geglu, --quick-geglu and --squared-relu are four MLP activations"),
    (["--window-size", "4", "2"], "--window-size 4 2: give LEFT RIGHT with LEFT >= 0"),
    (["--window-size", "4", "0", "--window-attn-skip-freq", "1", "0", "1"],
     r"--window-attn-skip-freq 1 0 1: give one N >= 1 or one 0/1 per layer \(4\)"),
    (["--window-attn-skip-freq", "2"], "--window-attn-skip-freq chooses the full-attention layers"),
    (["--position-embedding-type", "rope", "--rotary-base-local", "10000"],
     "--rotary-base-local is the base of the sliding-window layers' rotary positions: it needs"),
    (["--qk-layernorm", "--qk-layernorm-scope", "projection"],
     "--qk-layernorm-scope projection normalises over a projection split across tensor-parallel ranks"),
    (["--attn-logit-softcapping", "0"], "--attn-logit-softcapping must be > 0, got 0.0"),
    (["--vocab-file", "vocab.json", "--tokenizer-type", "GPT2BPETokenizer"],
     "--vocab-file without --merge-file"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.1"], "--rotary-percent 0.1 of a head's 16"),
    (["--swiglu", "--ffn-hidden-size", "90", *_tp(4)],
     "--tensor-model-parallel-size 4 does not divide --ffn-hidden-"),
    (["--merge-file", "merges.txt"], "--merge-file without --vocab-file"),
])
def test_bad_architecture_and_tokenizer_flags_are_named(stdlib_corpus, flags, message):
    prefix, tokenizer = stdlib_corpus
    model = [] if "--vocab-file" in flags or "--merge-file" in flags else ["--tokenizer-model", tokenizer]
    config = parse_config(TINY + ["--data-path", prefix, *model] + flags)
    with pytest.raises(ConfigError, match=message):
        validate(config, 4)
