"""Launch ``python -m pretrain`` on this machine with torchrun: ``python -m launch.torchrun --nproc N
[--max-restarts R] [pretrain flags]``. Divides the CPU cores among the processes (one OMP thread at
least) and rendezvous over loopback; every other flag goes to pretrain unchanged. With
``--max-restarts`` (as ``MAX_RESTARTS`` in multinode.sh and slurm.sbatch) torchrun's elastic agent
restarts every worker after a failure; with ``--save`` and ``--load`` on one directory each restart
resumes from the newest intact checkpoint: the data position, random streams and schedules too.

torchrun runs in this process, so that each failed attempt is told in ``error:`` lines instead
of torchrun's traceback: the workers' own, then the launcher's, one per worker that a signal ended
(``kill -9``, the out-of-memory killer) or that was stopped (SIGSTOP, a debugger: hung), naming its
rank, pid and host, and one saying what comes next (a restart, or the end); the exit status is the
failed worker's (128 + the signal for a signal). ``LOGLEVEL=INFO`` (torchrun's variable) keeps
torchrun's own log lines. The grace a failed group's workers get between SIGTERM and SIGKILL is
torchrun's ``--shutdown-timeout`` (or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; 30 s by default) there too:
torch's agent stops them with a fixed 30 s, which held a job 30 s after its failure was said whenever a
worker could not take SIGTERM (a stopped one)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys


# torchrun shares its rendezvous store with the workers' process groups by default, one store for every
# attempt: the workers then key their groups by the restart count (parallel.process_groups.attempt_store),
# which nodes may count apart (an agent restarts its healthy workers for another node's failure without
# counting it); a store of each world's own, in its rank 0's process, is that world's on every node
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# ``python -c IN_PROCESS <torchrun arguments>``: torchrun run as run_torchrun runs it, in a process of its own
IN_PROCESS = "import sys; from launch.torchrun import run_torchrun; sys.exit(run_torchrun(sys.argv[1:]))"
STOPPED: set[int] = set()  # the workers found stopped (hung) when torchrun ended their group
RUNNING: set[int] = set()  # ... and those found running: torchrun ended them because another one failed


def torchrun_arguments(nproc: int, pretrain_args: list[str], max_restarts: int = 0) -> list[str]:
    return ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "-m", "pretrain",
            *pretrain_args]


DESCRIPTION = """Launch python -m pretrain on this machine with torchrun: --nproc processes (torchrun's
--nproc-per-node), the CPU cores divided among them, a rendezvous over loopback, and with --max-restarts
every worker restarted after a failure, each restart resuming from the newest intact checkpoint when
--save and --load name one directory. Every other flag goes to python -m pretrain unchanged (python -m
pretrain --help lists them), e.g. python -m launch.torchrun --nproc 4 --config
launch/configs/cpu-default.yaml --zero-stage 3."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.torchrun", description=DESCRIPTION,
                                     usage="%(prog)s --nproc N [--max-restarts R] [pretrain flags]")
    parser.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int,
                        required=True, metavar="N",
                        help="processes (= world size) on this machine (torchrun's --nproc-per-node)")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=0, metavar="R",
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

    # c10's warnings (a store client's retries with their C++ stack, a socket's poll timeout) before the
    # workers' own lines name what failed; set before torch loads here, inherited by every worker
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    if "LOGLEVEL" not in os.environ:  # the workers say what failed; torchrun's warnings only repeat it
        for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:  # each sets its level
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    args = get_args_parser().parse_args(torchrun_args)
    _honour_shutdown_timeout(args.shutdown_timeout if args.shutdown_timeout is not None
                             else int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")))
    _say_failures()
    try:
        run(args)
    except SignalException as stop:  # torch's agent passed the signal on to the workers and waited for them
        name = signal.Signals(stop.sigval).name
        sys.stderr.write(f"error: the launcher on {socket.gethostname()} received {name}: the workers were "
                         "stopped (with --save, each saved a checkpoint first: the 'saved checkpoint' line "
                         "above, or 'published checkpoint' with --async-save)\n")
        return 128 + stop.sigval
    except RendezvousError as error:  # the agent hosting the rendezvous (another node's) has ended
        sys.stderr.write(f"error: the rendezvous at {args.rdzv_endpoint} stopped answering "
                         f"({type(error).__name__}: the node that hosted it ended, or the network between): "
                         "this node stops too\n")
        return 1
    except ChildFailedError as failed:
        said = [failure.exitcode for _, failure in sorted(failed.failures.items())
                if failure.exitcode > 0]  # a worker that said its error lines
        if said:
            return said[0]
        signals = [-failure.exitcode for _, failure in sorted(failed.failures.items())]
        return 128 + next((number for number in signals if number != signal.SIGTERM), signals[0])
    return 0


def failure_fates(failures: dict, workers) -> dict[int, str]:
    """How each worker of a failed attempt ended, by global rank: ended by a signal other than torchrun's
    own SIGTERM, stopped (SIGSTOP, a debugger: hung), terminated by torchrun because another failed, or
    absent where the worker exited with a status (it said its own error lines)."""
    from parallel.peers import HUNG, TERMINATED, process_state

    fates = {}
    for worker in workers:
        rank, failure = worker.global_rank, failures.get(worker.global_rank)
        if worker.id in STOPPED or (failure is None and process_state(worker.id) == "stopped"):
            fates[rank] = HUNG
        elif failure is None or failure.exitcode == -signal.SIGTERM or worker.id in RUNNING:
            fates[rank] = TERMINATED
        elif failure.exitcode < 0:
            name = signal.Signals(-failure.exitcode).name
            fates[rank] = f"ended by {name}" + (" (kill -9, or the out-of-memory killer)"
                                                  if name == "SIGKILL" else "")
    return fates


def _say_failures() -> None:
    """torch's agent restarts (or stops) a failed attempt's workers without a word once its warnings are
    off: say which worker ended how, and what comes next, as the failure is seen; and record it in the
    job's store for the survivors on other nodes (``parallel.peers.record_fate``)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from parallel.peers import HUNG, TERMINATED, record_fate

    monitor = LocalElasticAgent._monitor_workers
    if getattr(monitor, "says_failures", False):
        return

    def monitor_and_say(self, worker_group):
        result = monitor(self, worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            fates = failure_fates(result.failures, worker_group.workers)
            STOPPED.clear()  # an attempt's own: a later worker may be given a pid seen here
            RUNNING.clear()
            restarts, left = worker_group.spec.max_restarts, self._remaining_restarts
            if worker_group.group_world_size > 1:  # survivors on this node see these processes themselves
                record_fate(worker_group.master_addr, worker_group.master_port, restarts - left, fates)
            pids = {worker.global_rank: worker.id for worker in worker_group.workers}
            host = socket.gethostname()
            lines = [f"rank {rank} (pid {pids[rank]} on {host}) " + (fate if fate == HUNG else f"was {fate}")
                     for rank, fate in sorted(fates.items()) if fate != TERMINATED]
            then = (f"restarting every worker from the newest checkpoint (restart {restarts - left + 1} of "
                    f"{restarts})" if left > 0 else "the job stops"
                    + (" (no restarts left)" if restarts else ""))
            if lines or restarts:  # else the workers' own lines said it all
                sys.stderr.write("".join(f"error: {line}\n" for line in lines)
                                 + f"error: attempt {restarts - left + 1} failed; {then}\n")
                sys.stderr.flush()
        return result
    monitor_and_say.says_failures = True
    LocalElasticAgent._monitor_workers = monitor_and_say


def _honour_shutdown_timeout(grace: int) -> None:
    """torch's elastic agent stops a failed or restarting group's workers with a fixed 30 s grace between
    SIGTERM and SIGKILL (its process context's default, and ``_shutdown()``'s), using the configured
    shutdown timeout only when the agent itself ends: give them ``grace`` there too."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    from parallel.peers import process_state

    close = PContext.close
    if getattr(close, "honours_grace", False):
        close = close.__wrapped__

    def close_with_grace(self, death_sig=None, timeout=None) -> None:
        states = {pid: process_state(pid) for pid in self.pids().values()}
        STOPPED.update(pid for pid, state in states.items() if state == "stopped")
        RUNNING.update(pid for pid, state in states.items() if state == "")
        close(self, death_sig, grace if timeout is None else timeout)
    close_with_grace.honours_grace, close_with_grace.__wrapped__ = True, close
    PContext.close = close_with_grace

    def stop_workers(self, worker_group) -> None:
        self._shutdown(timeout=self._shutdown_timeout)
    LocalElasticAgent._stop_workers = stop_workers


if __name__ == "__main__":
    main()
