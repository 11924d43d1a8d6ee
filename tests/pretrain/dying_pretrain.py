"""``python -m pretrain`` in which one rank dies by SIGKILL on its first start (torchrun's restart count
0), at ``DIE_AT``: ``iteration:N`` (as iteration N begins, the other ranks already inside it),
``save:N`` (right after writing its file of checkpoint N, before the others finished theirs) or
``hang:N`` (it stops, SIGSTOP, as iteration N begins: alive but silent) or ``full:N`` (as iteration N
begins its files may grow to 1 KiB only, RLIMIT_FSIZE: a full disk for its next save). Rank
``DIE_RANK`` dies; a restarted job does not. Launched by torchrun from tests/pretrain/test_faults.py."""

import os
import resource
import signal

from pretrain import __main__ as pretrain_main  # torch comes in later, as in python -m pretrain


def _die(how: int = signal.SIGKILL) -> None:
    os.kill(os.getpid(), how)


def _arm(kind: str, number: int) -> None:
    import torch

    from pretrain.training.trainer import Trainer

    if kind in ("iteration", "hang", "full"):
        train_step, started = Trainer.train_step, [0]

        def dying_step(self, batches, measure=True):
            started[0] += 1
            if self.start_iteration + started[0] == number:
                if kind == "full":
                    resource.setrlimit(resource.RLIMIT_FSIZE,
                                       (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
                else:
                    _die(signal.SIGSTOP if kind == "hang" else signal.SIGKILL)
            return train_step(self, batches, measure)
        Trainer.train_step = dying_step
    else:
        save = torch.save

        def dying_save(obj, path, *args, **kwargs):
            save(obj, path, *args, **kwargs)
            if f"iter_{number:07d}.tmp" in str(path):
                _die()
        torch.save = dying_save


if __name__ == "__main__":
    if (os.environ["RANK"] == os.environ["DIE_RANK"]
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        kind, number = os.environ["DIE_AT"].split(":")
        _arm(kind, int(number))
    pretrain_main.main()
