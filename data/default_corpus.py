"""The default corpus, which needs no download: the running interpreter's standard-library source.

Every `.py` file under `sysconfig.get_paths()["stdlib"]` is one document, in sorted path order,
except files in `site-packages`, `test`, `tests` and `idlelib` directories, files over 1 MB and
files that are not UTF-8. `ensure_default_corpus` turns it once into a trained tokenizer and an
indexed dataset and caches them in a directory keyed by vocabulary size, byte budget and Python
version.
"""

import fcntl
import json
import os
import platform
import shutil
import sysconfig
from typing import Iterator, List, Optional, Tuple

from data.preprocess import preprocess
from data.tokenizers.sentencepiece_tokenizer import train_tokenizer
from data.tokenizers.spec import TokenizerSpec

EXCLUDED_DIRECTORIES = frozenset({"site-packages", "test", "tests", "idlelib"})
MAX_FILE_BYTES = 1 << 20
TOKENIZER_TRAINING_LINES = 400_000
DOCUMENTS_FILE = "documents.jsonl"
TOKENIZER_PREFIX = "tokenizer"
DATA_PREFIX = "corpus"


def ensure_default_corpus(
    cache_dir: str, vocab_size: int, max_bytes: Optional[int] = None
) -> Tuple[str, str]:
    """Return `(data_prefix, tokenizer_model_path)` of the default corpus, building it on first use.

    The result lives in `cache_dir/<key>`; it is built in a temporary directory and renamed into
    place, under an exclusive `fcntl.flock` on `cache_dir/default_corpus.lock`, so concurrent
    callers (several ranks, several jobs) build it once and never see a partial directory.
    `max_bytes` caps the UTF-8 size of the collected documents (None: the whole library)."""
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes {max_bytes}: must be positive, or None for the whole library")
    os.makedirs(cache_dir, exist_ok=True)
    key = f"stdlib-py{platform.python_version()}-vocab{vocab_size}-bytes{max_bytes or 'all'}"
    final_dir = os.path.join(cache_dir, key)
    data_prefix = os.path.join(final_dir, DATA_PREFIX)
    tokenizer_model = os.path.join(final_dir, TOKENIZER_PREFIX + ".model")
    with open(os.path.join(cache_dir, "default_corpus.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(final_dir):
            building_dir = os.path.join(cache_dir, f".{key}.{os.getpid()}.building")
            shutil.rmtree(building_dir, ignore_errors=True)
            try:
                _build(building_dir, vocab_size, max_bytes)
                os.rename(building_dir, final_dir)
            finally:
                shutil.rmtree(building_dir, ignore_errors=True)
    return data_prefix, tokenizer_model


def _build(directory: str, vocab_size: int, max_bytes: Optional[int]) -> None:
    os.makedirs(directory)
    documents_path = os.path.join(directory, DOCUMENTS_FILE)
    documents = 0
    with open(documents_path, "w", encoding="utf-8") as stream:
        for text in _collect_documents(max_bytes):
            stream.write(json.dumps({"text": text}) + "\n")
            documents += 1
    if documents == 0:
        raise ValueError(f"max_bytes {max_bytes}: no standard-library file fits; raise it")
    model_path = train_tokenizer(
        [documents_path], vocab_size, os.path.join(directory, TOKENIZER_PREFIX),
        max_lines=TOKENIZER_TRAINING_LINES,
    )
    preprocess([documents_path], TokenizerSpec("SentencePieceTokenizer", model_path),
               os.path.join(directory, DATA_PREFIX), append_eod=True)


def _collect_documents(max_bytes: Optional[int]) -> Iterator[str]:
    """Standard-library sources in sorted order; a file that would overflow `max_bytes` is skipped
    and the next ones still considered, so the budget is filled deterministically."""
    total_bytes = 0
    for path in standard_library_sources():
        with open(path, "rb") as stream:
            raw = stream.read()
        if max_bytes is not None and total_bytes + len(raw) > max_bytes:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        total_bytes += len(raw)
        yield text


def standard_library_sources() -> List[str]:
    """Sorted paths of the running interpreter's standard-library `.py` files that form the corpus.
    Only lists files: never reads them."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name not in EXCLUDED_DIRECTORIES]
        for name in files:
            path = os.path.join(directory, name)
            if name.endswith(".py") and os.path.getsize(path) <= MAX_FILE_BYTES:
                paths.append(path)
    return sorted(paths)
