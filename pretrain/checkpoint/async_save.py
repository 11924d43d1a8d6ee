"""Asynchronous checkpoint saves (Megatron's ``--async-save``): the step copies what it saves and goes on.

At a save the training thread waits for the previous save, agrees the staging directory with the world
(one small collective), copies this rank's states into host memory (pinned on accelerators) and starts
a writer thread. The thread writes the rank file, fsyncs it, hashes it as it writes, and reports its
size and sha256 (or what stopped it) under the attempt's keys in the rendezvous store; rank 0's
thread waits for every rank's report, writes the manifest and publishes atomically (rename, then
``latest``) exactly as a synchronous save does, then reports the outcome, which every rank's thread
waits for. A thread, not a process: the copy is already in this process's memory (a process would need
it copied again through shared memory), and writing and hashing release the GIL. Nothing in the thread
touches a process group, so the training's collectives never interleave with it. A crash or a kill
before the publish leaves ``iter_N.tmp`` unpublished and the previous checkpoint ``latest``; a save
said to be done has been published. The training thread polls the writer every iteration (a failure
on any rank stops every rank, agreed in ``RunControl``'s per-iteration all-reduce), and waits for it
before the next save and at the end.
"""

from __future__ import annotations

import datetime
import json
import threading
import time

import torch

from parallel.process_groups import ParallelGroups, rendezvous_store
from pretrain.checkpoint.checkpointer import (SaveAttempt, SaveError, Written, manifest_base, map_tensors,
                                              model_state, rank_content, storage_key, whole_storages)
from pretrain.checkpoint.stateful import Stateful


def host_copy(value, copies: dict, spare: dict | None = None):
    """``value`` with every tensor copied to host memory (pinned where an accelerator holds it), so the
    training can go on changing the originals. A storage the tensors view almost wholly
    (``checkpointer.whole_storages``) is copied once (into ``copies``, by the original's device and
    address) and its tensors view the copy, as the synchronous save writes them; any other tensor is
    copied alone. ``spare``: the previous save's copies, reused where the original is the same (the ZeRO
    buffers are: no new memory, no page faults, after the first save)."""
    whole, spare = whole_storages(value), spare or {}

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        pinned = tensor.device.type != "cpu"
        if storage_key(tensor) not in whole:  # a part of a larger storage: its elements alone
            key = ("view", str(tensor.device), tensor.data_ptr(), tensor.numel(), tensor.dtype)
            if key not in copies:
                host = spare.pop(key, None)
                if host is None:
                    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
                copies[key] = host.copy_(tensor, non_blocking=pinned)
            return copies[key]
        key, storage = storage_key(tensor), tensor.untyped_storage()
        if key not in copies:
            host = spare.pop(key, None)
            if host is None:
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned).untyped_storage()
            copies[key] = host.copy_(storage, non_blocking=pinned)
        return torch.empty(0, dtype=tensor.dtype).set_(copies[key], tensor.storage_offset(), tensor.shape,
                                                       tensor.stride())
    return map_tensors(value, copy)


class AsyncSaver:
    """Owns the writer thread and the host copy of one save at a time, and the outcome of the last one.
    Never writes from the training thread, and never touches a process group from the writer thread."""

    def __init__(self, groups: ParallelGroups, timeout_s: float, log=print):
        self.groups, self.timeout = groups, datetime.timedelta(seconds=timeout_s)
        self.log = log
        self._thread: threading.Thread | None = None
        self._outcome: dict | None = None
        self._copies: dict = {}  # the last save's host copies, by the storage they copied
        self._local_problem: str | None = None
        self.published: int | None = None  # the newest iteration this saver published

    def reserve(self, states: dict[str, Stateful]) -> None:
        """Allocate (and fault in) the host copies a save will need, before training: the first save then
        copies into memory it already has, as the later ones do."""
        with model_state(states).in_memory():
            host_copy(rank_content(states), self._copies)

    def start(self, directory: str, iteration: int, states: dict[str, Stateful], config: dict, keep_last: int,
              retain_interval: int | None, protected: str | None = None) -> None:
        """Begin the save of ``iteration``: wait for the previous one, copy, and hand it to the thread."""
        started = time.perf_counter()  # the thread says how long after this the checkpoint was published
        self.wait()
        attempt = SaveAttempt(directory, iteration, self.groups)
        copies: dict = {}
        with model_state(states).in_memory():
            content = host_copy(rank_content(states), copies, self._copies)
        self._copies = copies  # the next save copies into these
        manifest = manifest_base(states, iteration, config) if self.groups.rank == 0 else None
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the pinned copies are complete before the thread reads them
        self._outcome, self._local_problem = None, None
        self._thread = threading.Thread(target=self._write, name=f"checkpoint-{iteration}", daemon=True,
                                        args=(attempt, content, manifest, keep_last, retain_interval,
                                              protected, started))
        self._thread.start()

    def _write(self, attempt: SaveAttempt, content: dict, manifest: dict | None, keep_last: int,
               retain_interval: int | None, protected: str | None, requested: float) -> None:
        try:
            self._outcome = self._written(attempt, content, manifest, keep_last, retain_interval, protected,
                                          requested)
        except Exception as error:  # noqa: BLE001 - a store that timed out or went away: said on wait()
            self._outcome = {"error": attempt.failure(self.groups.rank,
                                                      f"the checkpoint writer failed ({error})")}

    def _written(self, attempt: SaveAttempt, content: dict, manifest: dict | None, keep_last: int,
                 retain_interval: int | None, protected: str | None, requested: float) -> dict:
        store, prefix = rendezvous_store(), f"checkpoint/{attempt.token}"
        try:
            written = attempt.write(content)
        except Exception as error:  # noqa: BLE001 - reported to every rank, not lost in a thread
            written = Written(attempt.entry, problem=f"cannot write its file ({error})")
        del content
        self._local_problem = written.problem
        store.set(f"{prefix}/file/{self.groups.rank}", json.dumps(written.__dict__))
        if self.groups.rank == 0:
            outcome = self._publish(attempt, store, prefix, manifest, keep_last, retain_interval, protected)
            store.set(f"{prefix}/outcome", json.dumps(outcome))
        store.wait([f"{prefix}/outcome"], self.timeout)
        outcome = json.loads(store.get(f"{prefix}/outcome"))
        if self.groups.rank == 0 and "path" in outcome:
            self.log(f"published checkpoint {outcome['path']} (iteration {attempt.iteration}, written "
                     f"{time.perf_counter() - requested:.2f} s after it was requested)")
        return outcome

    def _publish(self, attempt: SaveAttempt, store, prefix: str, manifest: dict, keep_last: int,
                 retain_interval: int | None, protected: str | None) -> dict:
        """Rank 0's thread: every rank's report, then the manifest and the publish; the outcome."""
        keys = [f"{prefix}/file/{rank}" for rank in range(self.groups.world.size)]
        store.wait(keys, self.timeout)
        written = [Written(**json.loads(store.get(key))) for key in keys]
        failed = [(rank, w.problem) for rank, w in enumerate(written) if w.problem]
        if failed:
            return {"error": attempt.failure(*failed[0])}
        try:
            attempt.publish(written, manifest, keep_last, retain_interval, protected)
        except OSError as error:
            return {"error": attempt.failure(0, f"{error.strerror or error}: "
                                                f"{error.filename or attempt.staging}")}
        return {"path": attempt.final, "iteration": attempt.iteration}

    def failed_here(self) -> bool:
        """Whether this rank's writer has failed (polled each iteration; the world agrees on it)."""
        return self._local_problem is not None or (self._outcome is not None and "error" in self._outcome)

    def poll(self) -> None:
        """Take in a finished save's outcome without waiting (``published``). A failure is left for the
        world to agree on (``failed_here``, then ``wait`` on every rank at the same iteration): raised here,
        on the rank whose writer happened to finish first, it ended that rank while the others went on
        into the next step's collectives."""
        if self._thread is not None and not self._thread.is_alive() and not self.failed_here():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight; SaveError, alike on every rank, if it failed."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread, outcome = None, self._outcome
        if outcome is None:
            raise SaveError("the checkpoint writer thread ended without an outcome (see its traceback above)")
        if "error" in outcome:
            raise SaveError(outcome["error"])
        self.published = outcome["iteration"]
