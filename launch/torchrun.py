"""Launch ``python -m pretrain`` on this machine with torchrun: ``python -m launch.torchrun --nproc N
[--max-restarts R] [pretrain flags]``. Divides the CPU cores among the processes (one OMP thread at
least) and rendezvous over loopback; every other flag goes to pretrain unchanged. With
``--max-restarts`` (as ``MAX_RESTARTS`` in multinode.sh and slurm.sbatch) torchrun's elastic agent
restarts every worker after a failure; with ``--save`` and ``--load`` on one directory each restart
resumes from the newest intact checkpoint: the data position, random streams and schedules too.

torchrun runs in this process, so that a failed job ends with the workers' own ``error:`` lines and,
for a worker that a signal ended (``kill -9``, the out-of-memory killer), one line naming its rank,
host and signal, instead of torchrun's traceback; the exit status is the failed worker's (128 + the
signal for a signal). ``LOGLEVEL=INFO`` (torchrun's variable) keeps torchrun's own log lines. The grace
a failed group's workers get between SIGTERM and SIGKILL is torchrun's ``--shutdown-timeout`` (or
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; 30 s by default) there too: torch's agent stops them with a fixed
30 s, which held a job 30 s after its failure was said whenever a worker could not take SIGTERM (a
stopped one)."""

from __future__ import annotations

import argparse
import os
import sys


# torchrun shares its rendezvous store with the workers' process groups by default; a restarted world
# can then read the previous attempt's addresses and fail to connect (pytorch/pytorch#135712)
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_arguments(nproc: int, pretrain_args: list[str], max_restarts: int = 0) -> list[str]:
    return ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "-m", "pretrain",
            *pretrain_args]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.torchrun", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="processes (= world size) on this machine")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart every worker this many times after a failure (torchrun's elastic "
                             "agent); give --save and --load the same directory so that each restart resumes "
                             "from the newest intact checkpoint (default 0)")
    args, rest = parser.parse_known_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    env = dict(RESTARTABLE, **os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    os.environ.update(env)
    sys.exit(run_torchrun(torchrun_arguments(args.nproc, rest, args.max_restarts)))


def run_torchrun(torchrun_args: list[str]) -> int:
    """Run torchrun with ``torchrun_args`` here; return the job's exit status (see the module)."""
    import logging
    import signal
    import socket

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if "LOGLEVEL" not in os.environ:  # the workers say what failed; torchrun's warnings only repeat it
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = get_args_parser().parse_args(torchrun_args)
    _honour_shutdown_timeout(args.shutdown_timeout if args.shutdown_timeout is not None
                             else int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")))
    try:
        run(args)
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


def _honour_shutdown_timeout(grace: int) -> None:
    """torch's elastic agent stops a failed or restarting group's workers with a fixed 30 s grace between
    SIGTERM and SIGKILL (its process context's default, and ``_shutdown()``'s), using the configured
    shutdown timeout only when the agent itself ends: give them ``grace`` there too."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    close = PContext.close
    if getattr(close, "honours_grace", False):
        close = close.__wrapped__

    def close_with_grace(self, death_sig=None, timeout=None) -> None:
        close(self, death_sig, grace if timeout is None else timeout)
    close_with_grace.honours_grace, close_with_grace.__wrapped__ = True, close
    PContext.close = close_with_grace

    def stop_workers(self, worker_group) -> None:
        self._shutdown(timeout=self._shutdown_timeout)
    LocalElasticAgent._stop_workers = stop_workers


if __name__ == "__main__":
    main()
