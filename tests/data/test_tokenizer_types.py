"""Megatron's --tokenizer-type choices against the other side's own code: GPT2BPETokenizer's ids equal
transformers.GPT2TokenizerFast's, HuggingFaceTokenizer's equal AutoTokenizer's, on vocabularies built
here with the `tokenizers` library; the NullTokenizer reads ids; bad flags are named."""

import os

import pytest

from data.tokenizers.spec import TokenizerSpec, build_tokenizer

from .bpe_files import write_gpt2_files, write_hf_directory

TEXTS = ["def f(x):\n\treturn x  # café → λ 😀\n", "  leading spaces and <|endoftext|> inside",
         "tokens, ranks; shards!\n\n\nend", "", "ünïcödé 1234567 \r\n", "</s> and <s> as text"]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory, documents):
    return write_gpt2_files(str(tmp_path_factory.mktemp("gpt2")), documents)


@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory, documents):
    return write_hf_directory(str(tmp_path_factory.mktemp("hf")), documents)


def test_gpt2_bpe_ids_equal_transformers_gpt2_tokenizer_fast(gpt2_files, documents):
    transformers = pytest.importorskip("transformers")
    vocab, merges = gpt2_files
    # reads vocab.json, merges.txt
    theirs = transformers.GPT2TokenizerFast.from_pretrained(os.path.dirname(vocab))
    ours = build_tokenizer(TokenizerSpec("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    for text in TEXTS + documents[:10]:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == text
    assert ours.eod == theirs.convert_tokens_to_ids("<|endoftext|>") == theirs.eos_token_id
    assert ours.vocab_size == len(theirs)


def test_hugging_face_ids_equal_auto_tokenizer(hf_directory, documents):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(hf_directory)
    for path in (hf_directory, os.path.join(hf_directory, "tokenizer.json")):
        ours = build_tokenizer(TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=path))
        for text in TEXTS + documents[:10]:
            assert ours.encode(text) == theirs(text)["input_ids"], text  # the BOS included, as theirs adds it
            assert ours.decode(ours.encode(text)) == theirs.decode(theirs(text)["input_ids"])
        assert ours.eod == theirs.eos_token_id and ours.vocab_size == len(theirs)


def test_null_tokenizer_reads_ids():
    null = build_tokenizer(TokenizerSpec("NullTokenizer", vocab_size=100))
    assert null.encode("5 17  99") == [5, 17, 99] and null.decode([5, 17]) == "5 17"
    assert null.eod == 100 and null.vocab_size == 101  # Megatron's: the end of document follows the ids


@pytest.mark.parametrize("spec, message", [
    (TokenizerSpec("GPT2BPETokenizer", vocab_file="vocab.json"), "--vocab-file without --merge-file"),
    (TokenizerSpec("GPT2BPETokenizer", merge_file="merges.txt"), "--merge-file without --vocab-file"),
    (TokenizerSpec("GPT2BPETokenizer"), "GPT2BPETokenizer needs --vocab-file vocab.json and --merge-file"),
    (TokenizerSpec("SentencePieceTokenizer", "t.model", vocab_file="v", merge_file="m"),
     "add --tokenizer-type GPT2"),
    (TokenizerSpec("HuggingFaceTokenizer"), "HuggingFaceTokenizer needs --tokenizer-model"),
    (TokenizerSpec("HuggingFaceTokenizer", tokenizer_model="/no/such"), "no tokenizer.json there"),
    (TokenizerSpec("GPT2BPETokenizer", vocab_file="/no/v.json", merge_file="/no/m.txt"),
     "--vocab-file /no/v.json: no"),
    (TokenizerSpec("NullTokenizer"), "NullTokenizer needs --vocab-size"),
])
def test_bad_tokenizer_flags_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer(spec)
