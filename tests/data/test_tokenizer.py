import json
import os
import subprocess
import sys

import pytest

from data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer as Tokenizer, train_tokenizer

from .synthetic import VOCAB_SIZE

TEXTS = [
    "",
    "def f(x):\n\tif x:  \n        return  'é→😀'\n\n\n  # trailing   \n",
    "   leading spaces\r\nwindows line\r\n\x00\x7f\u00a0nbsp",
    "class 日本語:\n    π = 3.14159  # ∑ unicode in code\n",
    "no newline at end",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_round_trip_of_training_documents(tokenizer, documents):
    for text in documents[:5]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_ids_and_megatron_attributes(tokenizer):
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert 0 <= tokenizer.eod_id < tokenizer.vocab_size
    assert 0 <= tokenizer.pad_id < tokenizer.vocab_size and tokenizer.pad_id != tokenizer.eod_id
    assert (tokenizer.eod, tokenizer.pad) == (tokenizer.eod_id, tokenizer.pad_id)
    assert tokenizer.eod_id not in tokenizer.encode("</s> <pad>")
    json.dumps(tokenizer.unique_identifiers)


def test_training_is_deterministic(tmp_path, corpus_jsonl, tokenizer_model):
    again = train_tokenizer([corpus_jsonl], VOCAB_SIZE, str(tmp_path / "again"))
    assert open(again, "rb").read() == open(tokenizer_model, "rb").read()
    assert sorted(os.listdir(tmp_path)) == ["again.model"]


def test_cli_writes_model(tmp_path, corpus_jsonl):
    prefix = str(tmp_path / "cli")
    result = subprocess.run(
        [sys.executable, "-m", "data.tokenizers", "--input", corpus_jsonl,
         "--vocab-size", "350", "--output-prefix", prefix],
        capture_output=True, text=True, check=True,
    )
    assert f"{prefix}.model" in result.stdout and "vocab size 350" in result.stdout
    assert Tokenizer(prefix + ".model").vocab_size == 350


def test_missing_or_invalid_model(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-model /no/such.model: cannot read"):
        Tokenizer("/no/such.model")
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ValueError) as error:
        Tokenizer(str(garbage))
    assert str(error.value) == (f"--tokenizer-model {garbage}: not a sentencepiece model (the file does "
                                "not parse "
                                "as one); give the .model file the data was preprocessed with, or train "
                                "one with "
                                "python -m data.tokenizers")  # once, without sentencepiece's internals


def test_bad_training_arguments(tmp_path, corpus_jsonl):
    with pytest.raises(ValueError, match="--vocab-size 100: .*smaller than required"):
        train_tokenizer([corpus_jsonl], 100, str(tmp_path / "small"))
    with pytest.raises(ValueError, match="--input /no/such.txt"):
        train_tokenizer([corpus_jsonl, "/no/such.txt"], VOCAB_SIZE, str(tmp_path / "missing"))
    assert os.listdir(tmp_path) == []
