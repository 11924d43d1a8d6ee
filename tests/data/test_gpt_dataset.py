import os
import types

import numpy
import pytest
import torch

import shutil

from data.gpt_dataset import (batch_reader, build_gpt_datasets, check_indexed_files, check_token_ids,
                              parse_data_path)
from data.sampler import DataParallelSampler, collate, micro_batches
from data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer as Tokenizer

from ..world import run_world

SEQ_LENGTH = 32


def build(prefixes, cache_dir, tokenizer, seed=1, split="8,1,1", num_samples=(200, 20, 10)):
    return build_gpt_datasets(
        prefixes, split, SEQ_LENGTH, seed, num_samples, tokenizer, str(cache_dir)
    )


def tokens_of(dataset, count):
    return torch.stack([dataset[index]["tokens"] for index in range(count)])


def test_samples_are_shifted_windows(tmp_path, indexed_halves, tokenizer):
    train, valid, test = build(indexed_halves[:1], tmp_path, tokenizer)
    assert len(train) >= 200 and len(valid) >= 20 and len(test) >= 10
    sample = train[0]
    assert sorted(sample) == ["labels", "loss_mask", "position_ids", "tokens"]
    assert all(value.shape == (SEQ_LENGTH,) for value in sample.values())
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert torch.equal(sample["position_ids"], torch.arange(SEQ_LENGTH))
    assert torch.all(sample["loss_mask"] == 1.0)


def test_order_depends_only_on_seed(tmp_path, indexed_halves, tokenizer):
    first = build(indexed_halves[:1], tmp_path / "a", tokenizer)
    again = build(indexed_halves[:1], tmp_path / "b", tokenizer)
    reseeded = build(indexed_halves[:1], tmp_path / "c", tokenizer, seed=2)
    for split in range(3):
        assert torch.equal(tokens_of(first[split], 10), tokens_of(again[split], 10))
    assert not torch.equal(tokens_of(first[0], 10), tokens_of(reseeded[0], 10))
    assert os.listdir(tmp_path / "a")


@pytest.mark.parametrize(
    "data_path, share_of_second", [(["1", "A", "3", "B"], 0.75), (["A", "B"], 0.5)]
)
def test_blend_follows_weights(tmp_path, indexed_halves, tokenizer, data_path, share_of_second):
    prefixes = {"A": indexed_halves[0], "B": indexed_halves[1]}
    train, _, _ = build([prefixes.get(item, item) for item in data_path], tmp_path, tokenizer,
                        num_samples=(400, 20, 10))
    dataset_ids = numpy.array([train[index]["dataset_id"] for index in range(len(train))])
    assert len(train) >= 400
    assert abs(dataset_ids.mean() - share_of_second) < 0.02
    assert not torch.distributed.is_initialized()


def blended_train_tokens(rank, world_size, prefixes, tokenizer_model, cache_dir):
    train, _, _ = build(["1", prefixes[0], "3", prefixes[1]], cache_dir, Tokenizer(tokenizer_model))
    return tokens_of(train, 16)


def test_ranks_of_a_process_group_share_one_cache(tmp_path, indexed_halves, tokenizer_model):
    """Under torch.distributed, rank 0 writes the index caches and the others read them."""
    shared_cache = str(tmp_path / "shared")
    per_rank = run_world(2, blended_train_tokens, indexed_halves, tokenizer_model, shared_cache)
    alone = blended_train_tokens(0, 1, indexed_halves, tokenizer_model, str(tmp_path / "alone"))
    assert torch.equal(per_rank[0], alone) and torch.equal(per_rank[1], alone)


def test_split_without_samples_is_not_built(tmp_path, indexed_halves, tokenizer):
    train, valid, test = build(indexed_halves[:1], tmp_path, tokenizer, split="1,0,0",
                               num_samples=(50, 0, 0))
    assert len(train) >= 50 and valid is None and test is None
    train, valid, test = build(indexed_halves[:1], tmp_path, tokenizer, num_samples=(50, 0, 10))
    assert valid is None and len(test) >= 10


def test_micro_batches_of_a_gpt_dataset(tmp_path, indexed_halves, tokenizer):
    train, _, _ = build(indexed_halves[:1], tmp_path, tokenizer)
    batches = micro_batches(train, DataParallelSampler(200, 0, 4, dp_rank=1, dp_size=2))
    batch = next(batches)
    assert batch["tokens"].shape == (4, SEQ_LENGTH) and batch["tokens"].dtype == torch.int64
    assert torch.equal(batch["tokens"][0], train[4]["tokens"])


def test_batch_reader_equals_samples_collated(tmp_path, indexed_halves, tokenizer):
    """The one-go batch of a GPTDataset is what megatron-core's samples give, collated; with a pad id that
    occurs in the data too (the masked positions must match), and for a blend (read sample by sample)."""
    train, valid, _ = build(indexed_halves[:1], tmp_path / "one", tokenizer)
    blend, _, _ = build(indexed_halves, tmp_path / "blend", tokenizer)
    common = int(train[0]["tokens"][3])
    for dataset, pad in ((train, None), (valid, None), (train, common), (blend, None)):
        if pad is not None:
            dataset._pad_token_id = pad
        read = batch_reader(dataset)
        for indices in ([0], [5, 1, 19], list(range(7, 19))):
            expected, batch = collate([dataset[index] for index in indices]), read(indices)
            assert sorted(batch) == sorted(expected)
            for key in expected:
                assert batch[key].dtype == expected[key].dtype and torch.equal(batch[key], expected[key]), key
        assert torch.all(batch["loss_mask"] == 1) == (pad is None)


def test_parse_data_path():
    assert parse_data_path(["p"]) == (["p"], None)
    assert parse_data_path(["2", "p"]) == (["p"], None)
    assert parse_data_path(["p", "q"]) == (["p", "q"], [1.0, 1.0])
    assert parse_data_path(["0.3", "p", "0.7", "q"]) == (["p", "q"], [0.3, 0.7])


@pytest.mark.parametrize(
    "data_path, message",
    [
        ([], "--data-path : expected PREFIX"),
        (["p", "0.5"], "--data-path p 0.5: expected PREFIX"),
        (["1", "p", "q", "r"], "expected PREFIX"),
        (["0", "p", "1", "q"], "weights must be positive"),
    ],
)
def test_bad_data_path_lists(data_path, message):
    with pytest.raises(ValueError, match=message):
        parse_data_path(data_path)


def test_bad_flags_are_named(tmp_path, indexed_halves, tokenizer):
    missing = str(tmp_path / "missing")
    expected = f"--data-path {missing}: no {missing}.bin found; run python -m data.preprocess"
    with pytest.raises(ValueError, match=expected):
        build([missing], tmp_path, tokenizer)
    for split in ("a,b", "1,2,3,4", "-1,2", "0,0,0"):
        with pytest.raises(ValueError, match=f"--split {split}"):
            build(indexed_halves[:1], tmp_path, tokenizer, split=split)
    with pytest.raises(ValueError, match="--split 969,30,1: the test split .* is empty"):
        build(indexed_halves[:1], tmp_path, tokenizer, split="969,30,1")
    huge_vocabulary = types.SimpleNamespace(vocab_size=70_000)
    expected = "stores uint16 tokens, too small for the tokenizer.s vocabulary of 70000"
    with pytest.raises(ValueError, match=expected):
        build(indexed_halves[:1], tmp_path, huge_vocabulary)


def test_damaged_or_foreign_data_files_are_named_before_reading_a_sample(tmp_path, indexed_halves, tokenizer):
    source = indexed_halves[0]
    vocab = tokenizer.vocab_size

    def check(prefix, vocab_size, flag="--data-path"):
        check_token_ids(prefix, check_indexed_files(prefix, flag), vocab_size, flag)

    check(source, vocab)  # the intact pair passes

    def damaged(name, bin_bytes=None, idx_bytes=None):
        prefix = str(tmp_path / name)
        for suffix, replacement in ((".bin", bin_bytes), (".idx", idx_bytes)):
            shutil.copy(source + suffix, prefix + suffix)
            if replacement is not None:
                with open(prefix + suffix, "wb") as handle:
                    handle.write(replacement(open(source + suffix, "rb").read()))
        return prefix

    cases = [
        (damaged("half", bin_bytes=lambda b: b[:len(b) // 2]), vocab,
         r"half.bin has \d+ bytes where its index describes \d+ \(truncated, or the pair of another "
         r"run\); rebuild"),
        (damaged("garbage", idx_bytes=lambda b: os.urandom(200)), vocab,
         r"garbage.idx is not a megatron index \(no MMIDIDX header\); rebuild it with python -m "
         r"data.preprocess"),
        (damaged("short", idx_bytes=lambda b: b[:len(b) - 8]), vocab,
         r"short.idx is not a megatron index \(\d+ bytes where its counts need \d+\)"),
        (source, 100,
         r"holds token id \d+, beyond the tokenizer's vocabulary of 100 \(made with another tokenizer"),
    ]
    for prefix, vocab_size, message in cases:
        with pytest.raises(ValueError, match=f"^--train-data-path {prefix}: .*" + message):
            check(prefix, vocab_size, "--train-data-path")
