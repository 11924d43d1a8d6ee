"""The sha256 of files: what a checkpoint's manifest and a tokenizer's identity record of them."""

from __future__ import annotations

import hashlib


def files_sha256(*paths: str) -> str:
    """The hex sha256 of the files' bytes, one after another, read in blocks of 1 MiB."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


class HashingWriter:
    """A binary file being written whose sha256 and size are taken from the bytes as they pass (one pass:
    no read back). Owns the digest only; the caller owns, flushes and closes the file."""

    def __init__(self, handle):
        self.handle, self.size = handle, 0
        self._digest = hashlib.sha256()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._digest.update(view)
        self.size += len(view)
        return self.handle.write(view)

    def flush(self) -> None:
        self.handle.flush()

    def hexdigest(self) -> str:
        return self._digest.hexdigest()
