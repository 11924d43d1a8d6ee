"""Packed documents as runs: the one test the convolutions and scans make of whether two tokens may see
each other."""

from __future__ import annotations

import torch


def segments(documents: torch.Tensor) -> torch.Tensor:
    """[b, S] -> a run index per token, rising by one at every document boundary (so two tokens are in
    one document exactly when their run indices are equal, whatever ids the documents have)."""
    starts = torch.ones_like(documents, dtype=torch.long)
    starts[:, 1:] = (documents[:, 1:] != documents[:, :-1]).long()
    return starts.cumsum(1)
