"""``python -m pretrain [--config FILE.yaml] [flags]``: train a GPT (launched by torchrun, or alone).

Expected faults end the process with one line per problem (``error: ...``) and no traceback: bad
flags before any process group exists (the same on every rank: said once per node), problems one rank
found in its files before the first iteration (agreed: rank 0 says them, naming the ranks), a
checkpoint that cannot be saved or loaded, a peer that died or hung, or a step that made no progress
for the timeout (``parallel.watchdog``: the lowest surviving rank names the peer and what it was doing;
every rank exits 1, so that torchrun restarts the job).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings

COMMUNICATION_FAILURES = ("Connection reset by peer", "Connection closed by peer", "Timed out", "timed out",
                          "NCCL communicator", "Broken pipe", "pair closure",
                          "wait timeout")  # (the store's: gloo's connectFullMesh waiting for a stopped peer)
TIMEOUTS = ("imed out", "pplication timeout")  # gloo's words for a collective that timed out


def say(text: str, prefix: str = "") -> None:
    """``text`` on stderr as ``error:`` lines, in one write (lines of several ranks never run together)."""
    sys.stdout.flush()
    sys.stderr.write("".join(f"error: {prefix}{line}\n" for line in text.splitlines()))
    sys.stderr.flush()


def _timeout_flag(config) -> str:
    seconds = config.parallel.distributed_timeout_s
    return (f"--distributed-timeout-minutes {seconds / 60:g}" if seconds % 60 == 0
            else f"--distributed-timeout-s {seconds:g}")


def _resume(config) -> str:
    save = config.checkpoint.save
    return f"; resume with --load {save} once it is fixed (torchrun --max-restarts does it)" if save else ""


def _peer_failure(error: RuntimeError, config, watchdog) -> str | None:
    """The line naming the peer whose death or silence broke a collective, if this rank says it."""
    closed, where = not any(text in str(error) for text in TIMEOUTS), watchdog.doing()
    handler = signal.getsignal(signal.SIGTERM)  # RunControl's, when --save: the launcher's SIGTERM came
    terminated = bool(getattr(getattr(handler, "__self__", None), "signal_received", False))
    who, says = watchdog.explain(connection_closed=closed, terminated=terminated)
    watchdog.stopping()
    if not says:
        return None
    what = ("a peer's connection closed" if closed else
            f"a collective timed out after {_timeout_flag(config)}")
    return f"{what} at {where}: {who}; the run stopped{_resume(config)}"


def _stalled(config):
    """The watchdog's answer to a step without progress: say who hung (one rank says it), exit 1."""
    def on_stall(who: str, says: bool) -> None:
        if says:
            say(f"no progress for {_timeout_flag(config)}: {who}; the run stopped{_resume(config)}")
        else:
            time.sleep(5)  # the rank that says it speaks before the launcher tears the job down
        _exit(1)
    return on_stall


def _start_stalled(config):
    """The start-up deadline's answer to a start that did not finish: say who the rank waits for (one rank
    of the node says it), exit 1."""
    def on_expiry(phase: str, who: str, says: bool) -> None:
        if says:
            say(f"the start did not finish within {_timeout_flag(config)} ({phase}): {who}; the run stopped"
                f"{_resume(config)}")
        else:
            time.sleep(5)  # the rank that says it speaks before the launcher tears the job down
        _exit(1)
    return on_expiry


def _exit(status: int) -> None:
    """Exit at once after an error, the output flushed: the process groups' threads must not meet the
    interpreter's teardown (a rank could end by SIGABRT after its error was said), and an orderly
    teardown would wait for ranks that may be elsewhere. The metrics file is written line by line."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> None:
    # Until the settings are checked, torchrun's SIGTERM (sent to the rest once a faster rank exited on the
    # same bad input) waits: the rank that says the error must live to say it. Torch is imported after this.
    terminated: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10 warnings: our lines say what failed
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from pretrain.config.arguments import ConfigError, parse_config
    from pretrain.startup.validation import validate

    rank = int(os.environ.get("RANK", "0"))
    try:
        config = parse_config(argv)
        topology = validate(config, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as error:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # every rank reads the same inputs: once per node
            say(str(error), f"rank {rank}: " if rank else "")
        sys.exit(2)
    if terminated:  # the job is being torn down: another rank failed in a way this one did not see
        sys.exit(128 + signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from parallel.comm import as_axis_group
    from parallel.process_groups import init_distributed, shutdown_distributed
    from pretrain.checkpoint.catalog import CheckpointError
    from pretrain.checkpoint.checkpointer import LoadError, SaveError
    from pretrain.startup.preflight import PreflightError, agree, local_problems
    from parallel.startup_deadline import StartupDeadline
    from parallel.watchdog import HangWatchdog
    from pretrain.training.trainer import Trainer

    # Ctrl-C reaches every worker (and the launcher, which passes it on): end at once without a traceback,
    # unless --save, where the trainer's RunControl takes it over to save and stop after the step
    signal.signal(signal.SIGINT, lambda signum, frame: _exit(128 + signum))
    timeout_s = config.parallel.distributed_timeout_s
    deadline = StartupDeadline(timeout_s, _start_stalled(config))
    try:  # every phase of the start ends within the timeout, naming whom it waits for
        device = init_distributed(timeout_s)
        deadline.at("registering with the hang watchdog through the job's store")
        watchdog = HangWatchdog(timeout_s, _stalled(config))
        deadline.at("the first collective: the ranks' pre-flight checks")
        problems = local_problems(config, topology, rank)
        agree(problems, as_axis_group(None, axis="world"), device)
    except PreflightError as error:  # every rank raised it alike (a RuntimeError: caught first)
        if rank == 0:
            say(str(error))
        _exit(2)
    except RuntimeError as error:
        if not any(text in str(error) for text in COMMUNICATION_FAILURES):
            raise
        deadline.expire()
    deadline.finished()  # the hang watchdog watches from here on
    try:
        Trainer(config, topology, device, watchdog).train()
    except (SaveError, LoadError, FloatingPointError) as error:  # every rank raised it alike
        if rank == 0:
            say(str(error))
        _exit(2)
    except CheckpointError as error:
        say(str(error), f"rank {rank}: " if topology.world_size > 1 else "")
        _exit(2)
    except RuntimeError as error:
        if not any(text in str(error) for text in COMMUNICATION_FAILURES):
            raise
        if not watchdog.claim():  # the watchdog reports this stall already, and exits
            time.sleep(60)
        line = _peer_failure(error, config, watchdog)
        if line:
            say(line)
        else:
            time.sleep(5)  # the rank that says it speaks before the launcher tears the job down
        _exit(1)  # the broken groups cannot be torn down in order
    watchdog.stop()
    shutdown_distributed()


if __name__ == "__main__":
    main()
