"""Who every rank of the world is and whether it still answers, kept in the rendezvous store, so that a
survivor of a peer's death or hang can name the rank instead of printing the transport's error.

Owns the store keys ``peers/<restart>/id/<rank>`` (host, pid and node, written once by ``register``),
``peers/<restart>/fate/<rank>`` (how a worker ended, written by its node's launcher: ``record_fate``)
and the reading of ``peers/<restart>/beat/<rank>`` (a counter, the time and what the rank is doing:
written by that rank's ``parallel.watchdog.HangWatchdog``). Never communicates through process
groups (a dead peer has broken them). It talks to the default group's store over a connection of
its own (a rank blocked in a store wait holds its default connection). Under torchrun with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the launchers' setting) that store lives in rank 0's
process, so a rank 0 that hung or died takes it along: ``Survey.unreachable`` says so.

A node is torchrun's node rank (``GROUP_RANK``) on its host: a peer on another node is "remote" even
on the same machine (emulated nodes), and a survivor judges it by what it can see from afar (its
connection closed, its beats stopped), never by its process id.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

STORE_TIMEOUT_S = 5.0
# the fates a launcher records (``record_fate``) besides "ended by <signal>"
HUNG = "hung: stopped (SIGSTOP or a debugger)"
TERMINATED = "terminated by its launcher"  # stopped because another worker failed: a consequence


def _key(kind: str, rank: int, restart: int | None = None) -> str:
    """The store key of ``kind`` (id, beat, fate) for ``rank`` in attempt ``restart`` (default: this one)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if restart is None else restart
    return f"peers/{attempt}/{kind}/{rank}"


def open_store(address: str | None = None, port: int | None = None):
    """A connection of its own to the default group's store (or the one at ``address:port``), or None
    where there is none (no launcher, a world of one)."""
    if address is None:
        if not dist.is_initialized() or dist.get_world_size() == 1 or "MASTER_ADDR" not in os.environ:
            return None
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
                         wait_for_workers=False)


def bounded(call, timeout_s: float = STORE_TIMEOUT_S):
    """``call()``'s result, or TimeoutError after ``timeout_s``: a store whose host is stopped accepts a
    connection and then never answers, and torch's client waits for that answer without a bound (the
    call is left behind in a daemon thread; the process is about to exit)."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, call()))
        except Exception as error:  # noqa: BLE001 - handed to the caller
            result.append((False, error))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        raise TimeoutError(f"the store did not answer in {timeout_s:g} s")
    ok, value = result[0]
    if not ok:
        raise value
    return value


def record_fate(address: str, port: int, restart: int, fates: dict[int, str]) -> None:
    """A launcher's word on how its workers of attempt ``restart`` ended (rank -> "ended by SIGKILL", ...),
    for the survivors on other nodes, which cannot see those processes. Gives up quietly when the store
    is gone (its host, rank 0's process, ended too)."""
    def tell() -> None:
        store = open_store(address, port)
        for rank, fate in fates.items():
            store.set(_key("fate", rank, restart), fate)
    try:
        bounded(tell)
    except Exception:  # noqa: BLE001 - no store to tell: the survivors judge by what they see
        pass


def beat_key(rank: int) -> str:
    return _key("beat", rank)


def register(store) -> None:
    """Record this rank's host, pid and node (once per process, after the default group exists)."""
    node = os.environ.get("GROUP_RANK", "0")
    store.set(_key("id", dist.get_rank()), f"{socket.gethostname()} {os.getpid()} {node}")


@dataclass
class Peer:
    """One other rank as a survivor sees it."""

    rank: int
    host: str
    pid: int
    node: str
    local: bool  # same host and node: its process can be looked at
    beats: tuple[int, float, str] | None = None  # (counter, time, what it was doing) at the second look
    silent: bool = False  # its counter did not move between two looks
    state: str = ""  # local only: "gone" (exited), "stopped" (SIGSTOP, a debugger), or "" (running)
    fate: str = ""  # how it ended, as its node's launcher recorded it ("" when it has not)

    def name(self) -> str:
        where = self.host if self.local else f"{self.host}, node {self.node}"
        return f"rank {self.rank} (pid {self.pid} on {where})"

    def last_seen(self) -> str:
        if self.beats is None:
            return "never heard from"
        return f"last heard {time.time() - self.beats[1]:.0f} s ago at {self.beats[2]}"


def process_state(pid: int) -> str:
    """"gone" (exited, or a zombie not reaped yet), "stopped", or "" (alive and running)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            return ""
        return ""
    return {"Z": "gone", "X": "gone", "T": "stopped", "t": "stopped"}.get(state, "")


def local_workers() -> list[tuple[int, int]]:
    """(global rank, pid) of the other workers this process's launcher started (the children of its parent
    that run under the same TORCHELASTIC_RUN_ID), read from /proc; none without a launcher."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is None or not os.path.isdir("/proc"):
        return []
    parent, me, found = os.getppid(), os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                if int(handle.read().rsplit(")", 1)[1].split()[1]) != parent:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environment = dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError, IndexError):  # it ended meanwhile, or is not ours to read
            continue
        if environment.get(b"TORCHELASTIC_RUN_ID") == run.encode() and b"RANK" in environment:
            found.append((int(environment[b"RANK"]), int(entry)))
    return sorted(found)


@dataclass
class Survey:
    """Every other rank, looked at twice some seconds apart; ``unreachable`` when the store did not answer
    (then ``peers`` holds what was known before: identities only)."""

    peers: list[Peer] = field(default_factory=list)
    unreachable: bool = False


def identities(store, world_size: int) -> list[Peer]:
    """Every other rank's identity, as registered (raises when the store does not answer in time)."""
    me, host, node = dist.get_rank(), socket.gethostname(), os.environ.get("GROUP_RANK", "0")
    ranks = [rank for rank in range(world_size) if rank != me]
    keys = [_key("id", rank) for rank in ranks]
    bounded(lambda: store.wait(keys, datetime.timedelta(seconds=STORE_TIMEOUT_S)), STORE_TIMEOUT_S + 1)
    values = bounded(lambda: store.multi_get(keys))
    peers = []
    for rank, value in zip(ranks, values):
        their_host, pid, their_node = value.decode().split()
        peers.append(Peer(rank, their_host, int(pid), their_node, their_host == host and their_node == node))
    return peers


def _present(store, keys: dict[int, str]) -> dict[int, str]:
    def read() -> dict[int, str]:
        present = {rank: key for rank, key in keys.items() if store.check([key])}
        values = store.multi_get(list(present.values())) if present else []
        return {rank: value.decode() for rank, value in zip(present, values)}
    return bounded(read)


def _beats(store, ranks: list[int]) -> dict[int, tuple[int, float, str]]:
    beats = {}
    for rank, value in _present(store, {rank: beat_key(rank) for rank in ranks}).items():
        count, stamp, doing = value.split(" ", 2)
        beats[rank] = (int(count), float(stamp), doing)
    return beats


def survey(store, known: list[Peer], interval_s: float) -> Survey:
    """Look at every rank in ``known``: which local ones are gone or stopped and, when none is, which still
    beat (two looks ``interval_s`` apart). Never raises."""
    for peer in known:
        if peer.local:
            peer.state = process_state(peer.pid)
    local_fault = any(peer.state for peer in known)
    try:
        ranks = [peer.rank for peer in known]
        first = second = _beats(store, ranks)
        if not local_fault:  # a gone or stopped process needs no second look
            time.sleep(interval_s)
            second = _beats(store, ranks)
        fates = _present(store, {rank: _key("fate", rank) for rank in ranks})
    except Exception:  # noqa: BLE001 - the store's host hung or died (or timed out): what is known must do
        return Survey(known, unreachable=True)
    for peer in known:
        peer.beats, peer.fate = second.get(peer.rank), fates.get(peer.rank, "")
        if peer.local:  # it may have ended while this one looked
            peer.state = process_state(peer.pid)
        peer.silent = bool(peer.state) or peer.beats is None or (
            not local_fault and first.get(peer.rank, (None,))[0] == peer.beats[0])
    return Survey(known)
