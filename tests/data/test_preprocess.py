import os
import subprocess
import sys

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from data.preprocess import preprocess
from data.tokenizers.spec import TokenizerSpec

from .synthetic import write_jsonl


@pytest.fixture(scope="module")
def sources(tmp_path_factory, documents):
    """The documents as one .jsonl file plus two plain files (one document each)."""
    directory = tmp_path_factory.mktemp("sources")
    plain = []
    for index, text in enumerate(documents[:2]):
        path = directory / f"module{index}.py"
        path.write_text(text, encoding="utf-8")
        plain.append(str(path))
    return [write_jsonl(directory / "docs.jsonl", documents[2:20])] + plain


def expected_documents(tokenizer, documents, append_eod=True):
    texts = documents[2:20] + documents[:2]
    return [tokenizer.encode(text) + ([tokenizer.eod_id] if append_eod else []) for text in texts]


def read_indexed(prefix):
    dataset = IndexedDataset(prefix)
    return [dataset[index].tolist() for index in range(len(dataset))], dataset


def test_indexed_dataset_holds_exactly_the_tokens(
    tmp_path, sources, tokenizer, tokenizer_spec, documents
):
    prefix = str(tmp_path / "out")
    stats = preprocess(sources, tokenizer_spec, prefix, append_eod=True, workers=1)
    stored, dataset = read_indexed(prefix)
    expected = expected_documents(tokenizer, documents)
    assert stored == expected
    assert dataset.index.dtype == numpy.uint16
    assert list(dataset.document_indices) == list(range(len(expected) + 1))
    assert stats["documents"] == len(expected) and stats["tokens"] == sum(map(len, expected))
    assert sorted(os.listdir(tmp_path)) == ["out.bin", "out.idx"]


def test_two_workers_write_identical_files(tmp_path, sources, tokenizer_spec):
    for workers in (1, 2):
        preprocess(sources, tokenizer_spec, str(tmp_path / f"w{workers}"), workers=workers)
    for suffix in (".bin", ".idx"):
        one = (tmp_path / f"w1{suffix}").read_bytes()
        assert one == (tmp_path / f"w2{suffix}").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["w1.bin", "w1.idx", "w2.bin", "w2.idx"]


def test_without_eod(tmp_path, sources, tokenizer, tokenizer_spec, documents):
    preprocess(sources, tokenizer_spec, str(tmp_path / "out"), append_eod=False)
    assert read_indexed(str(tmp_path / "out"))[0] == expected_documents(tokenizer, documents, False)


def test_failed_run_leaves_no_files(tmp_path, sources, tokenizer_spec):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff not utf-8")
    with pytest.raises(ValueError, match=f"--input {bad}: not valid UTF-8"):
        preprocess(sources + [str(bad)], tokenizer_spec, str(tmp_path / "out"))
    assert os.listdir(tmp_path) == ["bad.txt"]


def test_bad_arguments(tmp_path, sources, tokenizer_spec):
    with pytest.raises(ValueError, match="--input /no/such.txt: no such file"):
        preprocess(["/no/such.txt"], tokenizer_spec, str(tmp_path / "out"))
    with pytest.raises(ValueError, match="--tokenizer-model /no/such.model"):
        preprocess(sources, TokenizerSpec("SentencePieceTokenizer", "/no/such.model"), str(tmp_path / "out"))
    with pytest.raises(ValueError, match="--workers 0"):
        preprocess(sources, tokenizer_spec, str(tmp_path / "out"), workers=0)
    assert os.listdir(tmp_path) == []


def test_cli_matches_api(tmp_path, sources, tokenizer_model, tokenizer_spec):
    """The CLI takes Megatron's flags and names its output as Megatron's tool does."""
    preprocess(sources, tokenizer_spec, str(tmp_path / "api"))
    result = subprocess.run(
        [sys.executable, "-m", "data.preprocess", "--input", *sources, "--tokenizer-model",
         tokenizer_model, "--output-prefix", str(tmp_path / "cli"), "--append-eod"],
        capture_output=True, text=True, check=True,
    )
    assert "20 documents" in result.stdout
    for suffix in (".bin", ".idx"):
        assert ((tmp_path / f"cli_text_document{suffix}").read_bytes()
                == (tmp_path / f"api{suffix}").read_bytes())


def test_inputs_that_give_no_tokens_are_refused_by_name(tmp_path, sources, tokenizer_spec):
    empty, blank = tmp_path / "empty.txt", tmp_path / "blank.jsonl"
    empty.write_text("")
    blank.write_text('{"text": ""}\n\n{"text": ""}\n')
    for bad, reason in ((empty, "the file is empty"), (blank, "only empty documents")):
        with pytest.raises(ValueError, match=f"--input {bad}: no tokens \\({reason}\\): nothing to train on"):
            preprocess([sources[1], str(bad)], tokenizer_spec, str(tmp_path / "out"))
        assert sorted(os.listdir(tmp_path)) == ["blank.jsonl", "empty.txt"]  # nothing written
    command = [sys.executable, "-m", "data.preprocess", "--input", str(empty), "--output-prefix",
               str(tmp_path / "o"),
               "--tokenizer-model", tokenizer_spec.tokenizer_model]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr == (f"error: --input {empty}: no tokens (the file is empty): "
                                                  "nothing to train on; give a file with text, "
                                                  "or leave it out\n")
