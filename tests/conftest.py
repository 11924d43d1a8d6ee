"""Fixtures shared by the training tests: a small real-text corpus (stdlib sources), built once."""

import pytest


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory):
    """(data prefix, tokenizer model) of ~400 KB of the standard library, vocabulary 512."""
    from data.default_corpus import ensure_default_corpus

    return ensure_default_corpus(str(tmp_path_factory.mktemp("corpus")), vocab_size=512, max_bytes=400_000)
