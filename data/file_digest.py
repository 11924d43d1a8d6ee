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
