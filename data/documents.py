"""Reading input files as documents, the unit the tokenizer trains on and preprocessing packs.

A `.jsonl` (or `.json`, as Megatron's preprocess_data reads it) file holds one document per line: a
JSON object whose string field `key` ("text" by default) is the document; any other file is one
document, read as UTF-8. This module only reads: it never tokenizes or writes.
"""

import json
import os
from typing import Iterator


def read_documents(path: str, key: str = "text") -> Iterator[str]:
    """Yield the documents of one input file in order; raise ValueError naming `--input` and the
    fix for a missing file, invalid UTF-8 or a malformed JSONL line. Never skips bad input."""
    if not os.path.isfile(path):
        raise ValueError(f"--input {path}: no such file; pass existing text or .jsonl files")
    if not path.endswith((".jsonl", ".json")):
        yield _read_utf8(path)
        return
    with open(path, "rb") as stream:
        for line_number, raw_line in enumerate(stream, start=1):
            if raw_line.strip():
                yield _parse_jsonl_line(path, line_number, raw_line, key)


def _read_utf8(path: str) -> str:
    with open(path, "rb") as stream:
        raw = stream.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"--input {path}: not valid UTF-8 at byte {error.start}; convert the file to UTF-8"
        ) from None


def _parse_jsonl_line(path: str, line_number: int, raw_line: bytes, key: str) -> str:
    where = f"--input {path}, line {line_number}"
    try:
        record = json.loads(raw_line)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{where}: not a UTF-8 JSON object ({error}); fix or drop the line"
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        raise ValueError(f'{where}: expected a JSON object with a string "{key}" field (--json-keys)')
    return record[key]
