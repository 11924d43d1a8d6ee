"""Preprocessing: tokenize documents into megatron-core's indexed format (`.bin` + `.idx`).

Each input document becomes one indexed-dataset document (one sequence), followed by the
tokenizer's end-of-document id when `append_eod` is set, written through megatron-core's
`IndexedDatasetBuilder` with the smallest dtype that holds the vocabulary. The pair is written
under temporary names and renamed at the end (`.idx` last), so an interrupted run never leaves a
`.bin`/`.idx` pair that does not belong together.

CLI: `python -m data.preprocess --input FILE... --tokenizer-model P.model --output-prefix OUT
[--append-eod] [--workers N]`.
"""

import argparse
import multiprocessing
import os
import sys
import time
import warnings
from typing import Dict, Iterator, List, Optional, Tuple

from data.documents import read_documents
from data.tokenizer import Tokenizer

_worker_tokenizer = None


def preprocess(
    inputs: List[str],
    tokenizer_model: str,
    output_prefix: str,
    append_eod: bool = True,
    workers: int = 1,
) -> Dict[str, object]:
    """Tokenize every document of `inputs` (in order, with `workers` processes) into
    `<output_prefix>.bin/.idx`; return statistics (documents, tokens, bytes, seconds, paths).
    Never leaves temporary files behind when it raises."""
    if workers < 1:
        raise ValueError(f"--workers {workers}: must be at least 1")
    for path in inputs:
        if not os.path.isfile(path):
            raise ValueError(f"--input {path}: no such file; pass existing text or .jsonl files")
    tokenizer = Tokenizer(tokenizer_model)
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
    progress = _Progress()
    documents = _tokenized_documents(inputs, tokenizer, workers)
    try:
        builder = IndexedDatasetBuilder(temporary_bin, dtype=dtype)
        for token_ids, text_bytes in documents:
            if append_eod:
                token_ids.append(tokenizer.eod_id)
            builder.add_document(token_ids, [len(token_ids)])
            progress.update(len(token_ids), text_bytes)
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
    inputs: List[str], tokenizer: Tokenizer, workers: int
) -> Iterator[Tuple[List[int], int]]:
    """Yield (token ids, UTF-8 byte count) per document, in input order."""
    documents = (text for path in inputs for text in read_documents(path))
    if workers == 1:
        yield from ((tokenizer.encode(text), len(text.encode("utf-8"))) for text in documents)
        return
    with multiprocessing.get_context("spawn").Pool(
        workers, initializer=_load_worker_tokenizer, initargs=(tokenizer.model_path,)
    ) as pool:
        yield from pool.imap(_encode_in_worker, documents, chunksize=16)


def _load_worker_tokenizer(tokenizer_model: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(tokenizer_model)


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


def main(argv: Optional[List[str]] = None) -> None:
    """CLI entry point: preprocess the inputs and print the statistics."""
    parser = argparse.ArgumentParser(
        prog="python -m data.preprocess", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="text files (one document each) or .jsonl files (one per line)")
    parser.add_argument("--tokenizer-model", required=True, help="sentencepiece .model file")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and .idx")
    parser.add_argument("--append-eod", action="store_true",
                        help="append the end-of-document id to every document")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    args = parser.parse_args(argv)
    try:
        stats = preprocess(args.input, args.tokenizer_model, args.output_prefix,
                           args.append_eod, args.workers)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {stats['bin_path']} and {stats['idx_path']}: {stats['documents']} documents, "
          f"{stats['tokens']} tokens")


if __name__ == "__main__":
    main()
