"""What every rank checks once the processes can talk and before anything is built or trained: the
files it alone will touch. One rank's problem stops every rank, and rank 0 says which ranks found what.

``validate`` (before any process group) checks what is the same for every rank: flags, the data
files, the tokenizer. Here each rank checks its own view of the disks: that it can write under
``--save`` (a probe file made and removed: a path that is a file, a read-only mount, another
host's missing directory), and that every checkpoint file it will read under ``--load`` matches the
manifest (sizes and sha256), naming the newest intact earlier checkpoint and ``--ckpt-step`` if not.
"""

from __future__ import annotations

import os

import torch

from parallel import comm
from parallel.comm import AxisGroup
from parallel.topology import Topology
from pretrain.checkpoint.catalog import CheckpointError, verify
from pretrain.checkpoint.selection import checkpoint_to_load, step_to_load
from pretrain.config.schema import Config


class PreflightError(RuntimeError):
    """Problems found by some ranks before the first iteration, one line each, the ranks named."""


def _save_problem(directory: str, rank: int) -> str | None:
    probe = os.path.join(directory, f".write-probe-rank{rank}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb") as handle:
            handle.write(b"probe")
            handle.flush()
            os.fsync(handle.fileno())
        os.remove(probe)
    except OSError as error:
        return (f"--save {directory}: cannot write there ({error.strerror or error}); give a writable "
                "directory (it is created if missing)")
    return None


def local_problems(config: Config, topology: Topology, rank: int) -> list[str]:
    """What this rank finds wrong with the files it will write and read."""
    problems = []
    if config.checkpoint.save:
        problem = _save_problem(config.checkpoint.save, rank)
        if problem:
            problems.append(problem)
    directory = checkpoint_to_load(config)
    if directory is not None:
        try:
            verify(directory, step_to_load(config, directory))
        except CheckpointError as error:
            problems.append(str(error))
    return problems


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def agree(problems: list[str], world: AxisGroup, device: torch.device) -> None:
    """Share every rank's ``problems`` (a collective over the world); raise PreflightError on every
    rank if any rank found one, its message one line per problem with the ranks that found it."""
    found: dict[str, list[int]] = {}
    for rank, theirs in enumerate(comm.all_gather_object(problems, world, device)):
        for problem in theirs:
            found.setdefault(problem, []).append(rank)
    if found:
        raise PreflightError("\n".join(f"{_ranks(ranks)}: {problem}" if world.size > 1 else problem
                                       for problem, ranks in found.items()))
