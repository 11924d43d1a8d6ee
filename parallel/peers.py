"""Who every rank of the world is (its host and process id, kept in the rendezvous store), so that a
survivor of a peer's death can name the rank that died instead of printing the transport's error.

Owns nothing but the store keys ``peer/<rank>``. Never communicates through process groups (a dead
peer has broken them); the store belongs to the launcher (torchrun's agent) and outlives the workers.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from parallel.process_groups import rendezvous_store


def register() -> None:
    """Record this rank's host and pid (once per process, after the default group exists)."""
    store = rendezvous_store()
    if store is not None:
        store.set(f"peer/{dist.get_rank()}", f"{socket.gethostname()} {os.getpid()}")


def _gone(pid: int) -> bool:
    """The process has exited (a zombie its launcher has not reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def dead_peers(timeout_s: float = 2.0) -> tuple[dict[int, str], list[int]]:
    """(the ranks on this host whose process is gone, each with a description such as "rank 1 (pid
    3922 on node-a)"; the ranks on other hosts, whose state this process cannot see)."""
    store = rendezvous_store()
    if store is None or not dist.is_initialized():
        return {}, []
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    host, dead, remote = socket.gethostname(), {}, []
    for rank in range(dist.get_world_size()):
        if rank == dist.get_rank():
            continue
        try:
            their_host, pid = store.get(f"peer/{rank}").decode().split()
        except Exception:  # noqa: BLE001 - the store itself is gone (its host died): nothing to name
            return dead, remote
        if their_host != host:
            remote.append(rank)
        elif _gone(int(pid)):
            dead[rank] = f"rank {rank} (pid {pid} on {host})"
    return dead, remote
