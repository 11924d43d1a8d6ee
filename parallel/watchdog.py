"""A hang watchdog: when a step stops making progress it names the ranks the others wait for and what they
were last doing, then ends this rank so that the launcher (torchrun's elastic agent) restarts the job.

Each rank beats: a daemon thread writes, every ``beat_s`` seconds and whenever the rank starts a new phase
(at most ten times a second), a counter, the time and what the rank is doing (iteration, phase, newest
collective: ``doing()``) to the store (``parallel.peers``). A rank whose counter stops moving is
silent: stopped (SIGSTOP, a debugger), dead, or its host is gone. A survivor tells them apart by what
it can see: a local process that exited or is stopped, a connection that closed (a process that
ended) or a collective that timed out (a process that is still there).

Progress is a new phase or a collective issued (``CommStats.issued``). A watched phase without progress
for ``timeout_s`` (``--distributed-timeout-minutes``) ends the rank even where no collective timeout
applies (a point-to-point wait, a store wait); a collective timeout or a closed connection ends it
through the caller's error path (``pretrain.__main__``), which asks ``explain`` whom to name. Checkpoint
writes and reads are not watched: a slow disk is not a hang (their collectives keep their timeout).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

import torch.distributed as dist

from parallel import peers
from parallel.comm_stats import CommStats

STOPPING = "stopping after a failure"  # the phase of a rank that explained a failure and exits
STOPPED, LOST = "stopped: SIGSTOP or a debugger", "killed, or out of memory"  # a local process, as seen


class HangWatchdog:
    """Owns this rank's beat record in the store and the thread that writes it; decides (in a thread
    of its own) when a watched phase has stalled and calls ``on_stall(who, says)`` there (``who``: the
    sentence naming the ranks; ``says``: whether this rank is the one to say it), which must end the
    process. Never communicates through process groups, never raises from its threads. Without a store
    (a world of one process) it only keeps what the rank is doing."""

    def __init__(self, timeout_s: float, on_stall: Callable[[str, bool], None] | None = None,
                 beat_s: float = 1.0):
        self.timeout_s, self.on_stall, self.beat_s = timeout_s, on_stall, beat_s
        self.iteration, self.phase, self.watched, self.serial = 0, "starting", True, 0
        self.stats: CommStats | None = None
        self._claimed = threading.Lock()
        self._stopped = threading.Event()
        self._changed = threading.Event()
        self._known: list[peers.Peer] | None = None
        self.store = peers.open_store() if on_stall is not None else None
        if self.store is not None:
            peers.register(self.store)
            self._reader = peers.open_store()  # survivors read on their own connection: never behind a beat
            threading.Thread(target=self._beat, name="watchdog-beat", daemon=True).start()
            threading.Thread(target=self._watch, name="watchdog-watch", daemon=True).start()

    def follow(self, stats: CommStats) -> None:
        """Count this process's collectives (the rank's groups' shared counters) as progress."""
        self.stats = stats

    def at(self, iteration: int, phase: str, watched: bool = True) -> None:
        """This rank now does ``phase`` of ``iteration``; ``watched=False``: a stall here is no hang."""
        self.iteration, self.phase, self.watched = iteration, phase, watched
        self.serial += 1
        self._changed.set()

    def doing(self) -> str:
        call = self.stats.last_call if self.stats is not None else None
        return f"iteration {self.iteration}, {self.phase}" + (
            f", last collective {call[0]} over {call[1]}" if call else "")

    def claim(self) -> bool:
        """Whether this caller is the first to report (the error path and the stall thread race)."""
        return self._claimed.acquire(blocking=False)

    def stop(self) -> None:
        self._stopped.set()
        self._changed.set()

    def stopping(self) -> None:
        """This rank ends after a failure it has explained: it beats on (a rank that falls silent would
        be taken for a hung one), saying so, until it exits."""
        self.at(self.iteration, STOPPING, watched=False)

    def _progress(self) -> tuple[int, int]:
        return self.serial, self.stats.issued if self.stats is not None else 0

    def _beat(self) -> None:
        """Publish what this rank does, every ``beat_s`` and at each new phase (at most ten times a
        second). A store whose host is stopped blocks this thread for good: the stall check is apart."""
        key, count = peers.beat_key(dist.get_rank()), 0
        while not self._stopped.is_set():
            count += 1
            try:
                self.store.set(key, f"{count} {time.time():.3f} {self.doing()}")
            except Exception:  # noqa: BLE001 - the store's host is gone for good: the error path says so
                return
            self._changed.wait(self.beat_s)
            self._changed.clear()
            time.sleep(0.1)

    def _watch(self) -> None:
        last, since = None, time.monotonic()
        self._peers()  # learnt while the store answers: then a survivor of its host can still name it
        while not self._stopped.wait(self.beat_s):
            if self._known is None:
                self._peers()
            progress, now = self._progress(), time.monotonic()
            if progress != last or not self.watched:
                last, since = progress, now
            elif now - since > self.timeout_s + 2 * self.beat_s and self.claim():  # a timeout goes first
                who, says = self.explain()
                self.stopping()
                self.on_stall(who, says)
                return

    def _peers(self) -> list[peers.Peer] | None:
        if self._known is None:
            try:
                self._known = peers.identities(self._reader, dist.get_world_size())
            except Exception:  # noqa: BLE001 - not every rank registered, or the store is gone
                return None
        return [peers.Peer(p.rank, p.host, p.pid, p.node, p.local) for p in self._known]

    def explain(self, connection_closed: bool = False, terminated: bool = False) -> tuple[str, bool]:
        """(the sentence naming the ranks this one waits for and what they were doing, whether this rank
        says it: the lowest rank that is neither dead nor hung). ``connection_closed``: the failure was
        a closed connection, so a silent rank on another node died (a hung one keeps its sockets).
        ``terminated``: the launcher is tearing the job down (its SIGTERM came), so a rank 0 that is gone
        may have left on purpose, having said why: then this rank does not blame it."""
        me = dist.get_rank()
        known = self._peers() if self.store is not None else None
        if known is None:
            return "the ranks could not be looked up in the store", os.environ.get("LOCAL_RANK", "0") == "0"
        found = peers.survey(self._reader, known, 2.5 * self.beat_s)
        local_alive = [p.rank for p in found.peers if p.local and p.state == ""]
        if found.unreachable:
            holder = next((p for p in found.peers if p.rank == 0), None)
            state = {"stopped": f"hung ({_why(holder, STOPPED)})",
                     "gone": "is gone (it died, or it named another failure and left)"}.get(
                holder.state, "does not answer (hung or died)") if holder else ""
            who = (f"{holder.name()}, whose process holds the job's store, {state}" if holder
                   else "the job's store (in this process) stopped answering")
            blameless = terminated and holder is not None and holder.state == "gone"
            return who, me == min(local_alive + [me]) and not blameless
        # a worker its launcher stopped because of another's failure, or one that explained a failure
        # and left, is a consequence, not a cause
        left = [p for p in found.peers if p.beats and STOPPING in p.beats[2]]  # these may have said it
        found.peers = [p for p in found.peers if p.fate != peers.TERMINATED and p not in left]
        dead = [p for p in found.peers if p.state == "gone" or (p.fate and p.fate != peers.HUNG)
                or (not p.local and p.silent and connection_closed)]
        hung = [p for p in found.peers if (p.silent or p.fate) and p not in dead]
        lines = [f"{p.name()} died ({_why(p, LOST if p.local else 'its connection closed')}; "
                 f"{p.last_seen()})" for p in dead]
        lines += [f"{p.name()} hung ({_why(p, STOPPED if p.state == 'stopped' else 'silent')}; "
                  f"{p.last_seen()})" for p in hung]
        if not lines:  # every rank beats: name those elsewhere than this one
            here = f"iteration {self.iteration}, {self.phase}"
            away = [p for p in found.peers
                    if p.beats and not p.beats[2].startswith(here) and STOPPING not in p.beats[2]]
            lines = [f"{p.name()} did not arrive ({p.last_seen()})" for p in away] or [
                f"every rank is alive at {here} (this one waits after {self.doing()})"]
        says = me == min([p.rank for p in found.peers + left if p not in dead and p not in hung] + [me])
        return "; ".join(lines), says


def _why(peer: peers.Peer, seen: str) -> str:
    """What the peer's node's launcher recorded of its end, else what this rank ``seen``."""
    return f"{peer.fate}, said its node's launcher" if peer.fate else seen
