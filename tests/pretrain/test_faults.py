"""Faults: non-finite steps are skipped alike on every rank and stop the run at the limit; a rank killed
mid-iteration or mid-save ends the job in bounded time, leaves the previous checkpoint intact, and the
restarted job resumes from it to the same loss."""

import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from launch.torchrun import IN_PROCESS, RESTARTABLE
from pretrain.checkpoint.catalog import newest_intact, read_manifest

from pretrain.config.arguments import ConfigError, parse_config
from pretrain.startup.validation import validate
from tests.pretrain.test_trainer import TINY, _pp
from tests.world import run_world


def _train_with_nan_at(rank, world_size, corpus, nan_iterations, limit, check=False):
    """Train 6 iterations in dp2 x pp2 with the last stage's hidden states made NaN at ``nan_iterations``
    (``check``: stopping at the first, Megatron's default; else skipping up to ``limit`` in a row);
    return per iteration (loss, grad norm, skipped, a parameter checksum), or the error that stopped it."""
    from pretrain.training.trainer import Trainer

    prefix, tokenizer = corpus
    config = parse_config(TINY + _pp(2) + ["--data-path", prefix, "--tokenizer-model", tokenizer,
                                           "--data-cache-dir", f"{prefix}-cache", "--train-iters", "6",
                                           "--bad-step-limit", str(limit), "--log-interval", "1"]
                          + ([] if check else ["--no-check-for-nan-in-loss-and-grad"]))
    trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
    iteration, history = [0], []
    last_chunk = trainer.model[-1]
    if last_chunk.post_process:
        last_chunk.final_norm.register_forward_hook(
            lambda module, args, out: out * float("nan") if iteration[0] in nan_iterations else out)
    step = trainer.train_step

    def counted_step(batches, measure=True):
        iteration[0] += 1
        loss, result = step(batches, measure)
        checksum = sum(p.detach().double().sum().item() for p in trainer.model.parameters())
        history.append((result.grad_norm, result.skipped, checksum))
        return loss, result
    trainer.train_step = counted_step
    try:
        result = trainer.train()
    except FloatingPointError as error:
        return str(error), history
    return result.losses, history


def test_non_finite_steps_stop_the_run_or_are_skipped_everywhere_up_to_the_limit(stdlib_corpus):
    outcomes = run_world(4, _train_with_nan_at, stdlib_corpus, {3, 4}, 3)
    outcomes += run_world(4, _train_with_nan_at, stdlib_corpus, {2, 3, 4}, 3)
    first = run_world(4, _train_with_nan_at, stdlib_corpus, {3}, 3, True)
    for message, history in first:  # --check-for-nan-in-loss-and-grad (the default): the first one stops all
        assert message.startswith("iteration 3: the loss of ranks ") and "was not finite (loss nan" in message
        named = [int(rank) for rank in message.split("ranks ")[1].split(" was")[0].split(", ")]
        assert len(named) == 2 and len(history) == 3 and history[2][1]  # both last-stage ranks; not applied
        assert history[2][2] == history[1][2]
    skipped_twice, stopped = outcomes[:4], outcomes[4:]
    for losses, history in skipped_twice:
        assert [h[1] for h in history] == [False, False, True, True, False, False]  # every rank skips alike
        assert history[2][2] == history[3][2] == history[1][2]  # skipped steps leave the parameters alone
        # then it trains on
        assert history[4][2] != history[1][2] and all(loss == loss for loss in losses[4:])
    for message, history in stopped:  # the third bad step in a row stops every rank with the same message
        assert "3 consecutive steps with a non-finite loss or gradient norm (iterations 2-4" in message
        assert len(history) == 4


REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _job(corpus, tmp_path, name, max_restarts=0, die_at=None, timeout_s=60, extra=(), load=None,
         environment=None):
    """A 2-process torchrun job of 8 iterations saving every 2 into (and loading from, or from ``load``) its
    directory; with ``die_at``, rank 1 dies there on the first start (see
    launch.tools.faults.fault_injection); ``environment``: variables over the launchers' own.
    Returns (the finished process, seconds it took, its metrics lines, its checkpoint directory)."""
    prefix, tokenizer = corpus
    directory, metrics = tmp_path / name, tmp_path / f"{name}.jsonl"
    flags = TINY + ["--data-path", prefix, "--tokenizer-model", tokenizer,
                    "--data-cache-dir", f"{prefix}-cache",
                    "--train-iters", "8", "--save", str(directory), "--load", str(load or directory),
                    "--save-interval", "2", "--log-interval", "1", "--metrics-file", str(metrics),
                    "--distributed-timeout-s", str(timeout_s), *extra]
    command = [sys.executable, "-c", IN_PROCESS, "--standalone", "--nproc-per-node=2",
               f"--max-restarts={max_restarts}", "-m", "launch.tools.faults.fault_injection", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", DIE_RANK="1", DIE_AT=die_at or "never:0",
               WANDB_MODE="disabled", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5",  # a stopped rank: killed in 5 s
               **dict(RESTARTABLE, **(environment or {})))
    started = time.monotonic()
    job = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPOSITORY, timeout=300)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return job, time.monotonic() - started, lines, str(directory)


def _errors(job) -> list[str]:
    """The job's error lines; it must have ended with them alone (no traceback, nothing trained after)."""
    assert job.returncode != 0 and "Traceback" not in job.stderr, job.stderr[-3000:]
    return [line for line in job.stderr.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def reference_job(stdlib_corpus, tmp_path_factory):
    """(the directory, the final loss) of the uninterrupted job the faulted ones must end like."""
    tmp_path = tmp_path_factory.mktemp("reference")
    reference, _, lines, directory = _job(stdlib_corpus, tmp_path, "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    return directory, lines[-1]["loss"]


def test_a_killed_rank_ends_the_job_and_the_restart_resumes_to_the_same_loss(stdlib_corpus, tmp_path,
                                                                              reference_job):
    reference_directory, final_loss = reference_job

    # killed as iteration 5 begins: torchrun restarts the job, which resumes from iteration 4
    job, _, lines, _ = _job(stdlib_corpus, tmp_path, "mid-iteration", max_restarts=1, die_at="iteration:5")
    assert job.returncode == 0, job.stderr[-3000:]
    assert "at iteration 4" in job.stdout and lines[-1]["iteration"] == 8
    assert lines[-1]["loss"] == final_loss  # bit for bit: the same trajectory

    # killed while writing checkpoint 6: the job ends (no hang), checkpoint 4 stays latest and intact
    job, seconds, _, directory = _job(stdlib_corpus, tmp_path, "mid-save", die_at="save:6")
    assert job.returncode != 0 and seconds < 240, (job.returncode, seconds)
    died = [line for line in _errors(job) if ") died (killed, or out of memory; " in line]  # by the survivor
    assert len(died) == 1 and died[0].startswith("error: a peer's connection closed at iteration 6, ")
    assert ": rank 1 (pid " in died[0], job.stderr[-3000:]
    assert "error: rank 1 (pid" in job.stderr and ") was ended by SIGKILL" in job.stderr  # and the launcher
    checkpoint, manifest = read_manifest(directory)
    assert manifest["iteration"] == 4 and os.path.isdir(directory + "/iter_0000006.tmp")
    # started again (as a restart would be), it resumes from 4 and ends where the reference ended
    job, _, lines, _ = _job(stdlib_corpus, tmp_path, "mid-save", max_restarts=0)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "at iteration 4" in job.stdout and lines[-1]["loss"] == final_loss

    # a flipped byte in rank 1's file of checkpoint 8: every rank stops before iteration 1, naming the
    # file, its piece and the intact checkpoint 6; --ckpt-step 6 resumes from it to the reference's loss,
    # bit for bit
    damaged = tmp_path / "damaged"
    shutil.copytree(reference_directory, damaged)
    rank_file = damaged / "iter_0000008" / "rank_00001.pt"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    job, _, lines, _ = _job(stdlib_corpus, tmp_path, "after-damage", load=damaged)
    error, = _errors(job)  # found by the rank reading the piece, agreed, said once
    assert error.startswith(f"error: {rank_file}: piece ") and error.endswith(
        f"differs from its sha256 in the manifest (corrupted); the newest intact checkpoint is "
        f"{damaged}/iter_0000006: resume from it with --ckpt-step 6"), job.stderr[-3000:]
    assert lines == [] and "iter " not in job.stdout
    job, _, lines, _ = _job(stdlib_corpus, tmp_path, "after-damage", load=damaged, extra=["--ckpt-step", "6"])
    assert job.returncode == 0, job.stderr[-3000:]
    assert "at iteration 6" in job.stdout and lines[-1]["loss"] == final_loss


def test_a_kill_anywhere_in_a_background_save_resumes_from_an_intact_checkpoint(stdlib_corpus, tmp_path,
                                                                               reference_job):
    """--async-save under torchrun --max-restarts: a worker killed before its writer's first byte (the save
    of 4), in the middle of its file (6), and rank 0 killed with every file written but before it
    published (8): each start resumes from the newest published checkpoint, the log never says a save was
    published that was not, and the last start ends on the uninterrupted run's loss, bit for bit."""
    job, _, lines, directory = _job(stdlib_corpus, tmp_path, "async", max_restarts=3,
                                    die_at="write:4@1,midfile:6@1,publish:8@0", extra=["--async-save"])
    assert job.returncode == 0, job.stderr[-3000:]
    resumed = [int(line.split("at iteration ")[1].split(",")[0]) for line in job.stdout.splitlines()
               if line.startswith("resumed from")]
    published = [int(line.split("(iteration ")[1].split(",")[0]) for line in job.stdout.splitlines()
                 if line.startswith("published checkpoint")]
    assert resumed == [2, 4, 6], job.stdout[-3000:]  # the newest published one, each time
    assert published == [2, 4, 6, 8], job.stdout[-3000:]  # each said once, when on disk
    assert lines[-1]["iteration"] == 8 and lines[-1]["loss"] == reference_job[1]
    assert all(line["checkpoint_published"] is None or line["checkpoint_published"] < line["iteration"]
               for line in lines)
    assert read_manifest(directory)[1]["iteration"] == 8 and not any(
        entry.endswith(".tmp") for entry in os.listdir(directory) if entry != "iter_0000008")


def test_a_failed_save_ends_every_rank_with_one_line_and_keeps_the_previous_checkpoint(stdlib_corpus,
                                                                                       tmp_path):
    # rank 1's disk is full from iteration 5 on (RLIMIT_FSIZE): the save of 6 fails there, every rank stops;
    # the same when the save is written in the background (--async-save) and the disk fills as it writes
    for name, fault, extra in (("full", "full:5", []), ("full-async", "fullsave:6", ["--async-save"])):
        job, _, lines, directory = _job(stdlib_corpus, tmp_path, name, die_at=fault, extra=extra)
        said = ("error: saving iteration 6 failed on rank 1: cannot write "
                f"{directory}/iter_0000006.tmp/rank_00001.pt (File too large); {directory}/iter_0000004 is "
                f"still the latest checkpoint, intact. Free space under --save {directory} (or choose "
                "another) and resume with --load")
        assert _errors(job) == [said], name
        assert lines[-1]["iteration"] == 6 and sorted(os.listdir(directory)) == ["iter_0000002",
                                                                                 "iter_0000004", "latest"]
        checkpoint, manifest = read_manifest(directory)
        assert manifest["iteration"] == 4 and newest_intact(directory, below=5) == (checkpoint, 4)
    # --save under a file: said before anything is built
    (tmp_path / "a-file").write_text("")
    job, _, lines, _ = _job(stdlib_corpus, tmp_path, "unused",
                            extra=["--save", str(tmp_path / "a-file" / "ckpt")])
    assert (_errors(job) == [f"error: ranks 0, 1: --save {tmp_path}/a-file/ckpt: cannot write there (Not a "
                             "directory); give a writable directory (it is created if missing)"]
            and lines == [])


@pytest.mark.slow
def test_a_rank_stopped_as_the_world_forms_is_named_within_the_timeout_and_the_restart_trains(
        stdlib_corpus, tmp_path, reference_job):
    """Start-up is bounded as training is: rank 0 (whose process holds the job's store) stops once the
    process groups have formed, then, in the restarted world, rank 1 stops before it joins them; each time
    the other names it as hung within the 6 s timeout (not after the store's own 300 s), the launcher
    restarts, and the third world trains to the reference's end. (Rank 1 names the phase it is in when
    rank 0 stops: still forming the groups through rank 0's store on a loaded machine, registering with
    the watchdog, or already in the first collective.)"""
    job, seconds, lines, _ = _job(stdlib_corpus, tmp_path, "startup", max_restarts=2,
                                  die_at="startup:2@0,startup:1@1", timeout_s=6)
    assert job.returncode == 0 and seconds < 120, (job.returncode, seconds, job.stderr[-3000:])
    said = [line for line in job.stderr.splitlines() if "the start did not finish" in line]
    assert len(said) == 2 and not [line for line in job.stderr.splitlines()
                                   if line.startswith(("[W", "[E", "Traceback"))], job.stderr
    forming = "joining the job's store and forming the process groups"
    registering = "registering with the hang watchdog through the job's store"
    preflight = "the first collective: the ranks' pre-flight checks"
    for line, rank, phases in zip(said, (0, 1), ((registering, forming, preflight), (forming,))):
        assert any(line.startswith(f"error: the start did not finish within --distributed-timeout-s 6 "
                                   f"({phase}): rank {rank} (pid ") for phase in phases), line
        assert ") hung (stopped: SIGSTOP or a debugger); the run stopped" in line, line
    assert lines[-1]["iteration"] == 8 and lines[-1]["loss"] == reference_job[1]  # the same run, exactly


@pytest.mark.slow
def test_each_restart_forms_its_world_on_its_own_keys_of_torchruns_shared_store(stdlib_corpus, tmp_path,
                                                                                 reference_job):
    """Where torchrun's agent shares its store with the workers (plain torchrun; here its c10d rendezvous with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0) one store outlives every attempt: rank 1 killed mid-run, then rank 0
    killed as the restarted world's groups formed and rank 1 stopped there in the next: each restarted world
    forms on its own keys (not on the dead ones' addresses), the stop is named within the 6 s timeout, and the
    job ends by itself on the reference's loss exactly."""
    job, seconds, lines, _ = _job(stdlib_corpus, tmp_path, "shared-store", max_restarts=3,
                                  die_at="iteration:3@1,killstartup:2@0,startup:2@1", timeout_s=6,
                                  environment={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert job.returncode == 0 and seconds < 120, (job.returncode, seconds, job.stderr[-3000:])
    errors = [line for line in job.stderr.splitlines() if line.startswith("error: ")]
    assert [line for line in errors if line.startswith("error: attempt ")] == [
        f"error: attempt {n} failed; restarting every worker from the newest checkpoint (restart {n} of 3)"
        for n in (1, 2, 3)], job.stderr[-3000:]
    assert "error: rank 0 (pid " in job.stderr and ") was ended by SIGKILL" in job.stderr
    said, = [line for line in errors if ": rank 1 (pid " in line and line.startswith(
        "error: the start did not finish within --distributed-timeout-s 6 ")]
    assert ") hung (stopped: SIGSTOP or a debugger); the run stopped" in said, said
    assert [line["iteration"] for line in lines] == list(range(1, 9))  # the last world resumed from 2
    assert lines[-1]["loss"] == reference_job[1]  # the same run, exactly


def test_a_rank_stopped_inside_a_collective_is_named_as_hung_at_the_timeout(stdlib_corpus, tmp_path):
    """Rank 1 stops (SIGSTOP) as it enters a collective of iteration 5, the other waiting inside it: rank 0
    names it as hung (stopped), with what it was last doing, once the 10 s timeout passes; the launcher
    names it as hung too, not as killed; the last checkpoint stays intact."""
    job, seconds, lines, directory = _job(stdlib_corpus, tmp_path, "hang", die_at="hangcollective:5",
                                          timeout_s=10)
    assert job.returncode != 0 and seconds < 60, (job.returncode, seconds)  # timeout + grace + start-up
    said, stopped, attempt = _errors(job)
    assert said.startswith("error: a collective timed out after --distributed-timeout-s 10 at iteration 5, ")
    assert " rank 1 (pid " in said and ") hung (stopped: SIGSTOP or a debugger; last heard " in said, said
    assert stopped.startswith("error: rank 1 (pid ") and stopped.endswith(
        " hung: stopped (SIGSTOP or a debugger)")
    assert attempt == "error: attempt 1 failed; the job stops" and "SIGKILL" not in job.stderr
    assert read_manifest(directory)[1]["iteration"] == 4  # the last checkpoint before the hang, intact


@pytest.mark.slow
def test_a_checkpoint_resumes_on_other_process_counts_with_its_batch_or_a_new_one(stdlib_corpus, tmp_path,
                                                                                   reference_job):
    """The 2-process job's checkpoint 4 (global batch 8) resumed without a batch flag on 1 and on 4
    processes keeps its batch (Megatron's default, micro-batch x dp, would change with the process count)
    and ends where the job ended, within the fp32 bound of another reduction order; with
    --global-batch-size 16 on 4 (and --override-opt_param-scheduler: the iteration-based schedule's lengths
    count the new batch's samples) it continues from sample 32 in batches of 16 to iteration 8. A kept batch
    the new layout cannot divide is refused naming --global-batch-size."""
    from tests.parity import TRAJECTORY_RTOL, assert_within, relative_error

    reference_directory, final_loss = reference_job
    prefix, tokenizer = stdlib_corpus
    at = TINY.index("--global-batch-size")
    flags = TINY[:at] + TINY[at + 2:] + ["--data-path", prefix, "--tokenizer-model", tokenizer,
                                         "--data-cache-dir", f"{prefix}-cache", "--train-iters", "8",
                                         "--load", reference_directory, "--ckpt-step", "4",
                                         "--log-interval", "1"]
    new_batch = ["--global-batch-size", "16", "--override-opt_param-scheduler"]
    for nproc, extra in ((1, []), (4, []), (4, new_batch)):
        name = f"{nproc}-{''.join(extra[1:2]) or 'kept'}"
        command = [sys.executable, "-m", "launch.torchrun", "--nproc", str(nproc), *flags, *extra,
                   "--save", str(tmp_path / name), "--metrics-file", str(tmp_path / f"{name}.jsonl")]
        job = subprocess.run(command, capture_output=True, text=True, cwd=REPOSITORY, timeout=300,
                             env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
        assert job.returncode == 0, job.stderr[-3000:]
        lines = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert [line["iteration"] for line in lines] == [5, 6, 7, 8], name
        _, manifest = read_manifest(str(tmp_path / name))
        if not extra:
            assert "at iteration 4, sample 32 (global batch 8)" in job.stdout, job.stdout
            assert {line["batch_size"] for line in lines} == {8}
            assert_within(relative_error(lines[-1]["loss"], final_loss), f"resumed on {nproc}",
                          TRAJECTORY_RTOL)
            assert manifest["states"]["progress"] == {"iteration": 8, "consumed_samples": 64}
        else:
            assert "sample 32 (global batch 16, not the checkpoint's: its schedules continue" in job.stdout
            assert {line["batch_size"] for line in lines} == {16}
            assert manifest["states"]["progress"] == {"iteration": 8, "consumed_samples": 96}
            # the cosine decay ends with iteration 8: its samples 32 + 4 x 16; iteration 8 starts at 80
            progress = (80 - 16) / (96 - 16)  # warm-up: the checkpoint's 2 iterations, 16 samples
            cosine = 0.5 * (1 + math.cos(math.pi * progress))
            assert lines[-1]["lr"] == pytest.approx(3e-4 + 2.7e-3 * cosine)
    with pytest.raises(ConfigError, match=r"^--global-batch-size 8 is not divisible by --micro-batch-size 2 "
                                          r"x data-parallel size 3 = 6: use multiples of 6 \(the batch of "
                                          "the checkpoint under --load .*, kept when resuming: give "
                                          r"--global-batch-size to change it\)$"):
        validate(parse_config(flags), 3)


@pytest.mark.slow
def test_a_signalled_launcher_saves_and_ends_in_one_line(stdlib_corpus, tmp_path):
    """SIGTERM to the launcher (a scheduler's preemption) and Ctrl-C (SIGINT to the terminal's whole
    process group): the workers save after their step and stop, the launcher says so in one line, without
    torchrun's traceback, and exits 128 + the signal."""
    import signal

    prefix, tokenizer = stdlib_corpus
    for signum, group in ((signal.SIGTERM, False), (signal.SIGINT, True)):
        directory, metrics = tmp_path / signum.name, tmp_path / f"{signum.name}.jsonl"
        command = [sys.executable, "-m", "launch.torchrun", "--nproc", "2", *TINY, "--data-path", prefix,
                   "--tokenizer-model", tokenizer, "--data-cache-dir", f"{prefix}-cache", "--train-iters",
                   "100000", "--log-interval", "1", "--save", str(directory), "--metrics-file", str(metrics)]
        job = subprocess.Popen(command, cwd=REPOSITORY, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(job.pid, signum) if group else job.send_signal(signum)
        stdout, stderr = job.communicate(timeout=120)
        assert job.returncode == 128 + signum, stderr[-3000:]
        assert "Traceback" not in stderr and stderr.count("\n") == 1, stderr[-3000:]
        assert stderr.startswith("error: the launcher on ")
        assert f"received {signum.name}: the workers" in stderr
        _, manifest = read_manifest(str(directory))
        assert f"saved checkpoint {directory}/iter_{manifest['iteration']:07d}" in stdout
        assert manifest["iteration"] >= 2
