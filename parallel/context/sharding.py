"""Which tokens of a sequence a context-parallel rank holds.

A sequence of S tokens is cut into 2 x cp chunks of S / (2 cp); rank i holds chunks i and 2cp-1-i, in
that order (Megatron's zig-zag). Under causal attention chunk c attends to c + 1 chunks, so every rank
does the same work: (i + 1) + (2cp - i) chunk pairs. Positions, labels and loss masks are cut the same
way as the tokens, so each token keeps its global position.
"""

from __future__ import annotations

import torch


def chunk_ids(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) that ``cp_rank`` holds, in the order it holds them."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp rank {cp_rank} is outside 0..{cp - 1}")
    return cp_rank, 2 * cp - 1 - cp_rank


def chunk_length(seq_length: int, cp: int) -> int:
    """Tokens per chunk; ValueError naming the flag when the sequence does not cut evenly."""
    if seq_length % (2 * cp):
        raise ValueError(f"--seq-length {seq_length} is not a multiple of 2 x --context-parallel-size "
                         f"{cp} = {2 * cp}: each sequence is cut into 2 x cp chunks")
    return seq_length // (2 * cp)


def token_indices(seq_length: int, cp: int, cp_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global indices (0..S-1) of the tokens ``cp_rank`` holds, in its local order."""
    length = chunk_length(seq_length, cp)
    return torch.cat([torch.arange(c * length, (c + 1) * length, device=device)
                      for c in chunk_ids(cp, cp_rank)])


def shard_sequence(tensor: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``tensor`` along ``dim`` (a sequence of S positions), concatenated."""
    if cp == 1:
        return tensor
    length = chunk_length(tensor.shape[dim], cp)
    return torch.cat([tensor.narrow(dim, c * length, length) for c in chunk_ids(cp, cp_rank)], dim=dim)


def unshard_sequence(pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every cp rank's ``shard_sequence`` (in cp-rank order)."""
    cp = len(pieces)
    halves = [piece.chunk(2, dim=dim) for piece in pieces]
    chunks = [halves[c][0] if c < cp else halves[2 * cp - 1 - c][1] for c in range(2 * cp)]
    return torch.cat(chunks, dim=dim)
