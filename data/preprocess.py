"""Preprocessing: tokenize documents into megatron-core's indexed format (`.bin` + `.idx`).

Each input document becomes one indexed-dataset document (one sequence), followed by the
tokenizer's end-of-document id when `append_eod` is set, written through megatron-core's
`IndexedDatasetBuilder` with the smallest dtype that holds the vocabulary. The pair is written
under temporary names and renamed at the end (`.idx` last), so an interrupted run never leaves a
`.bin`/`.idx` pair that does not belong together.

CLI: Megatron-LM's tools/preprocess_data.py flags, and its output names, so that a corpus prepared by
either tool trains in the other:

    python -m data.preprocess --input FILE... --output-prefix OUT [--json-keys text ...]
        [--tokenizer-type T --tokenizer-model M | --vocab-file vocab.json --merge-file merges.txt]
        [--append-eod] [--workers N]

writes `OUT_<key>_document.bin/.idx` for each JSON key (a plain text file is one document under the
key "text"). `--split-sentences` (which needs nltk) is refused; `--partitions`, `--keep-newlines`,
`--lang` and `--log-interval` are accepted for Megatron's scripts and change nothing here.
"""

import argparse
import collections
import multiprocessing
import os
import sys
import time
import warnings
from typing import Dict, Iterator, List, Optional, Tuple

from data.documents import read_documents
from data.tokenizers.spec import TokenizerSpec, add_tokenizer_arguments, build_tokenizer, spec_from_arguments

_worker_tokenizer = None


def preprocess(
    inputs: List[str],
    tokenizer: TokenizerSpec,
    output_prefix: str,
    append_eod: bool = True,
    workers: int = 1,
    json_key: str = "text",
) -> Dict[str, object]:
    """Tokenize every document of `inputs` (field `json_key` of .jsonl lines; in order, with `workers`
    processes) into `<output_prefix>.bin/.idx`; return statistics (documents, tokens, bytes, seconds,
    paths). Never leaves temporary files behind when it raises."""
    if workers < 1:
        raise ValueError(f"--workers {workers}: must be at least 1")
    for path in inputs:
        if not os.path.isfile(path):
            raise ValueError(f"--input {path}: no such file; pass existing text or .jsonl files")
    spec, tokenizer = tokenizer, build_tokenizer(tokenizer)
    with warnings.catch_warnings():
        # Imported here, not at module level: spawned tokenizer workers import this module and
        # must not pay for megatron-core (seconds) nor hear its optional-dependency warnings.
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    bin_path, idx_path = output_prefix + ".bin", output_prefix + ".idx"
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    temporary_bin = f"{output_prefix}.{os.getpid()}.tmp.bin"
    temporary_idx = f"{output_prefix}.{os.getpid()}.tmp.idx"
    progress, tokens_from = _Progress(), {}  # tokens per input file, the end-of-document ids not counted
    documents = _tokenized_documents(inputs, spec, tokenizer, workers, json_key)
    try:
        builder = IndexedDatasetBuilder(temporary_bin, dtype=dtype)
        for path, token_ids, text_bytes in documents:
            tokens_from[path] = tokens_from.get(path, 0) + len(token_ids)
            if append_eod:
                token_ids.append(tokenizer.eod_id)
            builder.add_document(token_ids, [len(token_ids)])
            progress.update(len(token_ids), text_bytes)
        for path in inputs:
            if not tokens_from.get(path):
                found = "the file is empty" if os.path.getsize(path) == 0 else \
                    "only empty documents" if path in tokens_from else "no documents"
                raise ValueError(f"--input {path}: no tokens ({found}): nothing to train on; give a "
                                 "file with "
                                 "text, or leave it out")
        builder.finalize(temporary_idx)
        if os.path.exists(idx_path):
            os.remove(idx_path)
        os.replace(temporary_bin, bin_path)
        os.replace(temporary_idx, idx_path)
    finally:
        documents.close()
        for path in (temporary_bin, temporary_idx):
            if os.path.exists(path):
                os.remove(path)
    progress.finish()
    return {
        "documents": progress.documents,
        "tokens": progress.tokens,
        "bytes": progress.bytes,
        "seconds": progress.seconds(),
        "bin_path": bin_path,
        "idx_path": idx_path,
    }


def _tokenized_documents(
    inputs: List[str], spec: TokenizerSpec, tokenizer, workers: int, json_key: str
) -> Iterator[Tuple[str, List[int], int]]:
    """Yield (input file, token ids, UTF-8 byte count) per document, in input order."""
    paths: collections.deque = collections.deque()  # the file of each document handed to the encoder

    def texts() -> Iterator[str]:
        for path in inputs:
            for text in read_documents(path, json_key):
                paths.append(path)
                yield text

    if workers == 1:
        encoded = ((tokenizer.encode(text), len(text.encode("utf-8"))) for text in texts())
        yield from ((paths.popleft(), ids, size) for ids, size in encoded)
        return
    with multiprocessing.get_context("spawn").Pool(
        workers, initializer=_load_worker_tokenizer, initargs=(spec,)
    ) as pool:
        yield from ((paths.popleft(), ids, size) for ids,
                    size in pool.imap(_encode_in_worker, texts(), chunksize=16))


def _load_worker_tokenizer(spec: TokenizerSpec) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(spec)


def _encode_in_worker(text: str) -> Tuple[List[int], int]:
    return _worker_tokenizer.encode(text), len(text.encode("utf-8"))


class _Progress:
    """Counts documents, tokens and bytes; redraws one stderr line at most once per second."""

    def __init__(self) -> None:
        self.documents = self.tokens = self.bytes = 0
        self.start = self.last_draw = time.monotonic()

    def update(self, tokens: int, text_bytes: int) -> None:
        self.documents += 1
        self.tokens += tokens
        self.bytes += text_bytes
        if time.monotonic() - self.last_draw >= 1.0:
            self.last_draw = time.monotonic()
            sys.stderr.write("\r" + self._line())
            sys.stderr.flush()

    def finish(self) -> None:
        sys.stderr.write("\r" + self._line() + "\n")
        sys.stderr.flush()

    def seconds(self) -> float:
        return time.monotonic() - self.start

    def _line(self) -> str:
        megabytes_per_second = self.bytes / 1e6 / max(self.seconds(), 1e-9)
        return (
            f"{self.documents} documents, {self.tokens} tokens, "
            f"{megabytes_per_second:.2f} MB/s"
        )


def output_prefix_for(output_prefix: str, json_key: str) -> str:
    """Megatron's name for the dataset of one JSON key: `<prefix>_<key>_document`."""
    return f"{output_prefix}_{json_key}_document"


def main(argv: Optional[List[str]] = None) -> None:
    """CLI entry point: preprocess the inputs and print the statistics."""
    parser = argparse.ArgumentParser(
        prog="python -m data.preprocess", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="text files (one document each) or .jsonl / .json files (one per line)")
    parser.add_argument("--output-prefix", required=True,
                        help="writes <prefix>_<key>_document.bin and .idx for each --json-keys key")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="fields of each JSON line to tokenize, one dataset each")
    add_tokenizer_arguments(parser)
    parser.add_argument("--append-eod", action="store_true",
                        help="append the end-of-document id to every document")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--split-sentences", action="store_true",
                        help="refused: needs nltk's sentence splitter")
    for flag in ("--partitions", "--log-interval"):
        parser.add_argument(flag, type=int, help="accepted for Megatron's scripts; no effect here")
    parser.add_argument("--keep-newlines", action="store_true",
                        help="accepted for Megatron's scripts; no effect")
    parser.add_argument("--lang", help="accepted for Megatron's scripts (sentence splitting); no effect")
    args = parser.parse_args(argv)
    if args.split_sentences:
        parser.error("--split-sentences is not supported (it needs nltk's punkt splitter): preprocess whole "
                     "documents, as GPT pretraining reads them")
    plain = [path for path in args.input if not path.endswith((".jsonl", ".json"))]
    if plain and args.json_keys != ["text"]:
        parser.error(f"--json-keys {' '.join(args.json_keys)}: {plain[0]} is a plain text file (one "
                     "document, "
                     "under the key text); give .jsonl inputs or drop --json-keys")
    for key in args.json_keys:
        try:
            stats = preprocess(args.input, spec_from_arguments(args),
                               output_prefix_for(args.output_prefix, key),
                               args.append_eod, args.workers, key)
        except ValueError as error:  # bad input data: one line, no usage text
            sys.stderr.write(f"error: {error}\n")
            sys.exit(2)
        print(f"wrote {stats['bin_path']} and {stats['idx_path']}: {stats['documents']} documents, "
              f"{stats['tokens']} tokens")


if __name__ == "__main__":
    main()
