"""Shared artifacts for the data tests, built once per session: a synthetic corpus, a small
tokenizer trained on it, and indexed datasets of the corpus's two halves."""

import pytest

from data.preprocess import preprocess
from data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer, train_tokenizer
from data.tokenizers.spec import TokenizerSpec

from .synthetic import VOCAB_SIZE, make_documents, write_jsonl


@pytest.fixture(scope="session")
def documents():
    return make_documents(60)


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory, documents):
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", documents)


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory, corpus_jsonl):
    return train_tokenizer([corpus_jsonl], VOCAB_SIZE, str(tmp_path_factory.mktemp("tok") / "tok"))


@pytest.fixture(scope="session")
def tokenizer_spec(tokenizer_model):
    return TokenizerSpec("SentencePieceTokenizer", tokenizer_model)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_model):
    return SentencePieceTokenizer(tokenizer_model)


@pytest.fixture(scope="session")
def indexed_halves(tmp_path_factory, documents, tokenizer_spec):
    """Two indexed datasets (prefixes): the first and the second half of the documents."""
    directory = tmp_path_factory.mktemp("indexed")
    prefixes = []
    for name, texts in (("first", documents[:30]), ("second", documents[30:])):
        source = write_jsonl(directory / f"{name}.jsonl", texts)
        prefixes.append(str(directory / name))
        preprocess([source], tokenizer_spec, prefixes[-1])
    return prefixes
