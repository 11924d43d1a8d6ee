"""Launch ``python -m pretrain`` on this machine with torchrun: ``python -m launch.torchrun --nproc N
[pretrain flags]``. Divides the CPU cores among the processes (one OMP thread at least) and rendezvous
over loopback; every flag after ``--nproc`` goes to pretrain unchanged.

torchrun runs in this process, so that a failed job ends with the workers' own ``error:`` lines and,
for a worker that a signal ended (``kill -9``, the out-of-memory killer), one line naming its rank,
host and signal, instead of torchrun's traceback; the exit status is the failed worker's (128 + the
signal for a signal). ``LOGLEVEL=INFO`` (torchrun's variable) keeps torchrun's own log lines."""

from __future__ import annotations

import argparse
import os
import sys


# torchrun shares its rendezvous store with the workers' process groups by default; a restarted world
# can then read the previous attempt's addresses and fail to connect (pytorch/pytorch#135712)
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_arguments(nproc: int, pretrain_args: list[str]) -> list[str]:
    return ["--standalone", f"--nproc-per-node={nproc}", "-m", "pretrain", *pretrain_args]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.torchrun", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="processes (= world size) on this machine")
    args, rest = parser.parse_known_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    env = dict(RESTARTABLE, **os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    os.environ.update(env)
    sys.exit(run_torchrun(torchrun_arguments(args.nproc, rest)))


def run_torchrun(torchrun_args: list[str]) -> int:
    """Run torchrun with ``torchrun_args`` here; return the job's exit status (see the module)."""
    import logging
    import signal
    import socket

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if "LOGLEVEL" not in os.environ:  # the workers say what failed; torchrun's warnings only repeat it
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(torchrun_args))
    except ChildFailedError as failed:
        failures = sorted(failed.failures.items())
        # SIGTERM is torchrun's own, to the rest of the workers once one failed: not a cause
        killed = [(rank, failure) for rank, failure in failures
                  if failure.exitcode < 0 and -failure.exitcode != signal.SIGTERM]
        if not killed:
            said = [failure.exitcode for _, failure in failures if failure.exitcode > 0]
            return said[0] if said else 128 - failures[0][1].exitcode  # the workers printed their error lines
        rank, failure = killed[0]
        name = signal.Signals(-failure.exitcode).name
        sys.stderr.write(f"error: rank {rank} (pid {failure.pid} on {socket.gethostname()}) was ended "
                         f"by {name}"
                         + (" (kill -9, the out-of-memory killer, or torchrun once it ignored SIGTERM)"
                            if name == "SIGKILL" else "") + "\n")
        return 128 - failure.exitcode
    return 0


if __name__ == "__main__":
    main()
