"""Fixtures shared by the training tests: a small real-text corpus (stdlib sources) and one of short
documents, each built once."""

import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory):
    """(data prefix, tokenizer model) of ~400 KB of the standard library, vocabulary 512."""
    from data.default_corpus import ensure_default_corpus

    return ensure_default_corpus(str(tmp_path_factory.mktemp("corpus")), vocab_size=512, max_bytes=400_000)


@pytest.fixture(scope="session")
def short_documents(stdlib_corpus, tmp_path_factory):
    """(data prefix, tokenizer model) of short documents, several ending inside each 32-token sequence."""
    import random

    from tests.data.synthetic import WORDS, write_jsonl

    _, tokenizer = stdlib_corpus
    directory = tmp_path_factory.mktemp("short_documents")
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) for _ in range(1500)]
    corpus = write_jsonl(directory / "short.jsonl", texts)
    subprocess.run([sys.executable, "-m", "data.preprocess", "--input", corpus, "--output-prefix",
                    str(directory / "short"), "--tokenizer-type", "SentencePieceTokenizer",
                    "--tokenizer-model", tokenizer, "--append-eod"],
                   check=True, capture_output=True, text=True)
    return str(directory / "short_text_document"), tokenizer
