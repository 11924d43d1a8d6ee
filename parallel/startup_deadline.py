"""A deadline on a distributed run's start: joining the job's store, forming the process groups, the hang
watchdog's registration and the first collective must end within --distributed-timeout-minutes, as every
phase of training must (``parallel.watchdog`` watches from the first collective on).

A start can wait without any bound of its own: a store whose host (rank 0's process) is stopped accepts a
connection and never answers, and the process groups wait for a peer that never arrives. Which rank stalled
is told from what this process sees without the store it may be waiting for: its launcher's other workers
(``parallel.peers.local_workers``: one that is stopped or gone is named). With none of them at fault the
rank it waits for is on another node, whose own workers name it.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Callable

from parallel import peers
from parallel.watchdog import LOST, STOPPED

GRACE_S = 2.0  # past the timeout: a collective's or the store's own timeout, when it has one, goes first


class StartupDeadline:
    """Owns the thread that waits for the start to finish (``finished``) and, ``timeout_s`` (+ grace) after
    it began, calls ``on_expiry(phase, who, says)`` there (``who``: the sentence naming the ranks;
    ``says``: whether this rank is the one to say it), which must end the process; ``expire`` does the same
    at once (the start failed with a timeout of its own). Never communicates, never raises from its
    thread."""

    def __init__(self, timeout_s: float, on_expiry: Callable[[str, str, bool], None]):
        self.timeout_s, self.on_expiry = timeout_s, on_expiry
        self.phase = "joining the job's store and forming the process groups"
        self._done = threading.Event()
        self._claimed = threading.Lock()
        threading.Thread(target=self._wait, name="startup-deadline", daemon=True).start()

    def at(self, phase: str) -> None:
        self.phase = phase

    def finished(self) -> None:
        self._done.set()

    def expire(self) -> None:
        """Say who the start waits for and end (the caller's start failed): once, whoever comes first."""
        if self._claimed.acquire(blocking=False):
            self._done.set()
            self.on_expiry(self.phase, *explain())

    def _wait(self) -> None:
        if not self._done.wait(self.timeout_s + GRACE_S):
            self.expire()


def explain() -> tuple[str, bool]:
    """(the sentence naming the workers of this node that are stopped or gone, or saying the rank waited
    for is elsewhere; whether this rank says it: the lowest-ranked running worker of its node)."""
    me, host, node = int(os.environ.get("RANK", "0")), socket.gethostname(), os.environ.get("GROUP_RANK", "0")
    states = [(peers.Peer(rank, host, pid, node, local=True), peers.process_state(pid))
              for rank, pid in peers.local_workers()]
    faults = [f"{peer.name()} " + (f"hung ({STOPPED})" if state == "stopped" else f"died ({LOST})")
              for peer, state in states if state]
    running = [peer.rank for peer, state in states if not state] + [me]
    who = "; ".join(faults) or ("every worker of this node runs: the rank waited for is on another node, or "
                                "the job's store there does not answer")
    return who, me == min(running)
