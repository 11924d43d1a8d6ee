"""``python -m pretrain`` with faults injected, for tests, ``launch.tools.fault_sweep`` and ``launch.chaos``:
one rank dies by SIGKILL on its first start (torchrun's restart count 0), at ``DIE_AT``: ``iteration:N``
(as iteration N begins, the other ranks already inside it), ``collective:N`` (as it enters its third
collective of iteration N, the others waiting inside it), ``hangcollective:N`` (it stops there, SIGSTOP),
``save:N`` (right after writing its file of checkpoint N, before the others finished theirs) or
``hang:N`` (it stops, SIGSTOP, as iteration N begins: alive but silent) or ``full:N`` (as iteration N
begins its files may grow to 1 KiB only, RLIMIT_FSIZE: a full disk for its next save) or ``startup:1`` (it
stops, SIGSTOP, before it joins the job's store and the process groups) or ``startup:2`` (it stops once the
process groups have formed, before the first collective) or ``killstartup:1`` / ``killstartup:2`` (SIGKILL
there). Rank ``DIE_RANK`` dies; a restarted job does not. Faults in a save's writer (an asynchronous save's
thread): ``write:N`` (before its first byte), ``midfile:N`` (part of its file written), ``publish:N``
(every file written, before rank 0 publishes: give DIE_RANK 0), ``fullsave:N`` (its file may grow to
1 KiB only: the disk fills as it is written). ``DIE_AT`` may list one fault per start,
``FAULT@RANK,FAULT@RANK,...``: the i-th for torchrun's i-th restart. A rank ``local:N`` is local rank N
of whichever node runs with it (nodes get their group ranks at the rendezvous). With ``FAULT_LOG=FILE``
each fault appends a JSON line (fault, rank, pid, time) to FILE just before it strikes. Launched by torchrun:
``-m launch.tools.faults.fault_injection [pretrain flags]``."""

import json
import os
import resource
import signal
import time

from pretrain import __main__ as pretrain_main  # torch comes in later, as in python -m pretrain


FAULT = ""  # the armed fault, as DIE_AT names it


def _die(how: int = signal.SIGKILL) -> None:
    _log()
    os.kill(os.getpid(), how)


def _log() -> None:
    if os.environ.get("FAULT_LOG"):
        with open(os.environ["FAULT_LOG"], "a") as handle:
            handle.write(json.dumps({"fault": FAULT, "rank": int(os.environ["RANK"]), "pid": os.getpid(),
                                     "time": time.time()}) + "\n")


def _arm(kind: str, number: int) -> None:
    from pretrain.training.trainer import Trainer

    if kind in ("startup", "killstartup"):
        _arm_startup(number, signal.SIGSTOP if kind == "startup" else signal.SIGKILL)
    elif kind in ("iteration", "hang", "full", "collective", "hangcollective"):
        train_step, started = Trainer.train_step, [0]

        def dying_step(self, batches, measure=True):
            started[0] += 1
            if self.start_iteration + started[0] == number:
                if kind == "full":
                    _log()
                    resource.setrlimit(resource.RLIMIT_FSIZE,
                                       (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
                elif kind in ("collective", "hangcollective"):
                    _arm_collective(signal.SIGSTOP if kind == "hangcollective" else signal.SIGKILL)
                else:
                    _die(signal.SIGSTOP if kind == "hang" else signal.SIGKILL)
            return train_step(self, batches, measure)
        Trainer.train_step = dying_step
    else:
        _arm_writer(kind, number)


def _arm_startup(point: int, how: int) -> None:
    """Strike (SIGSTOP or SIGKILL) before the process groups form (1) or right after (2)."""
    from parallel import process_groups

    init = process_groups.init_distributed

    def stopping_init(*args, **kwargs):
        if point == 1:
            _die(how)
        device = init(*args, **kwargs)
        if point == 2:
            _die(how)
        return device
    process_groups.init_distributed = stopping_init


def _arm_collective(how: int) -> None:
    """Strike as this rank enters its third collective from now (counted as it is issued)."""
    from parallel.comm_stats import CommStats

    add, calls = CommStats.add, [0]

    def dying_add(self, operation, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            _die(how)
        return add(self, operation, *args, **kwargs)
    CommStats.add = dying_add


def _arm_writer(kind: str, number: int) -> None:
    """Faults inside a save's writer: before its first byte, in the middle of its file, right after it,
    before publish."""
    from data.file_digest import HashingWriter
    from pretrain.checkpoint.checkpointer import SaveAttempt

    write, publish, chunk, current = SaveAttempt.write, SaveAttempt.publish, HashingWriter.write, [None]

    def dying_write(self, content):
        if kind == "write" and self.iteration == number:
            _die()
        if kind == "fullsave" and self.iteration == number:
            _log()
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        current[0] = self.iteration
        written = write(self, content)
        if kind == "save" and self.iteration == number:
            _die()
        return written

    def dying_chunk(self, data):
        if kind == "midfile" and current[0] == number and self.size > 4096:
            _die()
        return chunk(self, data)

    def dying_publish(self, *args, **kwargs):
        if kind == "publish" and self.iteration == number:
            _die()
        return publish(self, *args, **kwargs)
    SaveAttempt.write, HashingWriter.write, SaveAttempt.publish = dying_write, dying_chunk, dying_publish


def _faults() -> list[tuple[str, str]]:
    """(fault, rank) per start: DIE_AT as FAULT@RANK,... or one FAULT for DIE_RANK's first start."""
    spec = os.environ["DIE_AT"]
    if "@" not in spec:
        return [(spec, os.environ["DIE_RANK"])]
    return [tuple(part.split("@")) for part in spec.split(",")]


if __name__ == "__main__":
    start = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    faults = _faults()
    if start < len(faults) and faults[start][1] in (os.environ["RANK"], f"local:{os.environ['LOCAL_RANK']}"):
        FAULT = faults[start][0]
        kind, number = FAULT.split(":")
        _arm(kind, int(number))
    pretrain_main.main()
