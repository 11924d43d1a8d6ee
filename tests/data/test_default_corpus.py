import json
import os
import sysconfig
import threading
import time

from megatron.core.datasets.indexed_dataset import IndexedDataset

from data.default_corpus import ensure_default_corpus, standard_library_sources
from data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer as Tokenizer

VOCAB_SIZE = 400
MAX_BYTES = 300_000


def test_sources_are_sorted_library_files_without_tests():
    sources = standard_library_sources()
    root = sysconfig.get_paths()["stdlib"]
    assert sources == sorted(sources) and len(sources) > 100
    for path in sources:
        parts = os.path.relpath(path, root).split(os.sep)
        assert path.endswith(".py")
        assert not {"site-packages", "test", "tests", "idlelib"} & set(parts)


def test_builds_once_then_reuses_the_cache(tmp_path):
    data_prefix, model_path = ensure_default_corpus(str(tmp_path), VOCAB_SIZE, MAX_BYTES)
    tokenizer = Tokenizer(model_path)
    assert tokenizer.vocab_size == VOCAB_SIZE
    documents_path = os.path.join(os.path.dirname(data_prefix), "documents.jsonl")
    with open(documents_path, encoding="utf-8") as stream:
        texts = [json.loads(line)["text"] for line in stream]
    assert sum(len(text.encode("utf-8")) for text in texts) <= MAX_BYTES
    dataset = IndexedDataset(data_prefix)
    assert len(dataset) == len(texts)
    assert dataset[0].tolist() == tokenizer.encode(texts[0]) + [tokenizer.eod_id]
    assert tokenizer.decode(dataset[0][:-1]) == texts[0]

    start = time.monotonic()
    assert ensure_default_corpus(str(tmp_path), VOCAB_SIZE, MAX_BYTES) == (data_prefix, model_path)
    assert time.monotonic() - start < 0.5


def test_concurrent_callers_build_one_directory(tmp_path):
    results = []
    def call():
        results.append(ensure_default_corpus(str(tmp_path), VOCAB_SIZE, 60_000))

    callers = [threading.Thread(target=call) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(results) == 2 and results[0] == results[1]
    corpus_directory = os.path.basename(os.path.dirname(results[0][0]))
    assert sorted(os.listdir(tmp_path)) == sorted([corpus_directory, "default_corpus.lock"])
