"""Launch ``python -m pretrain`` on this machine with torchrun: ``python -m launch.torchrun --nproc N
[pretrain flags]``. Divides the CPU cores among the processes (one OMP thread at least) and rendezvous
over loopback; every flag after ``--nproc`` goes to pretrain unchanged."""

from __future__ import annotations

import argparse
import os
import sys


# torchrun shares its rendezvous store with the workers' process groups by default; a restarted world
# can then read the previous attempt's addresses and fail to connect (pytorch/pytorch#135712)
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_command(nproc: int, pretrain_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "pretrain", *pretrain_args]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.torchrun", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="processes (= world size) on this machine")
    args, rest = parser.parse_known_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    env = dict(RESTARTABLE, **os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    command = torchrun_command(args.nproc, rest)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main()
