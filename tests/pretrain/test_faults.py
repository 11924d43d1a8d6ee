"""Faults: non-finite steps are skipped alike on every rank and stop the run at the limit; a rank killed
mid-iteration or mid-save ends the job in bounded time, leaves the previous checkpoint intact, and the
restarted job resumes from it to the same loss."""

import json
import os
import subprocess
import sys
import time

import torch

from launch.torchrun import RESTARTABLE
from pretrain.checkpoint import read_manifest

from pretrain.arguments import parse_config
from pretrain.validation import validate
from tests.pretrain.test_trainer import TINY, _pp
from tests.world import run_world


def _train_with_nan_at(rank, world_size, corpus, nan_iterations, limit):
    """Train 6 iterations in dp2 x pp2 with the last stage's hidden states made NaN at ``nan_iterations``;
    return per iteration (loss, grad norm, skipped, a parameter checksum), or the error that stopped it."""
    from pretrain.trainer import Trainer

    prefix, tokenizer = corpus
    config = parse_config(TINY + _pp(2) + ["--data-path", prefix, "--tokenizer-model", tokenizer,
                                           "--data-cache-dir", f"{prefix}-cache", "--train-iters", "6",
                                           "--bad-step-limit", str(limit), "--log-interval", "1"])
    trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
    iteration, history = [0], []
    last_chunk = trainer.model[-1]
    if last_chunk.post_process:
        last_chunk.final_norm.register_forward_hook(
            lambda module, args, out: out * float("nan") if iteration[0] in nan_iterations else out)
    step = trainer.train_step

    def counted_step(batches):
        iteration[0] += 1
        loss, result = step(batches)
        checksum = sum(p.detach().double().sum().item() for p in trainer.model.parameters())
        history.append((result.grad_norm, result.skipped, checksum))
        return loss, result
    trainer.train_step = counted_step
    try:
        result = trainer.train()
    except FloatingPointError as error:
        return str(error), history
    return result.losses, history


def test_non_finite_steps_are_skipped_everywhere_and_stop_at_the_limit(stdlib_corpus):
    outcomes = run_world(4, _train_with_nan_at, stdlib_corpus, {3, 4}, 3)
    outcomes += run_world(4, _train_with_nan_at, stdlib_corpus, {2, 3, 4}, 3)
    skipped_twice, stopped = outcomes[:4], outcomes[4:]
    for losses, history in skipped_twice:
        assert [h[1] for h in history] == [False, False, True, True, False, False]  # every rank skips alike
        assert history[2][2] == history[3][2] == history[1][2]  # skipped steps leave the parameters alone
        assert history[4][2] != history[1][2] and all(loss == loss for loss in losses[4:])  # then it trains on
    for message, history in stopped:  # the third bad step in a row stops every rank with the same message
        assert "3 consecutive steps with a non-finite loss or gradient norm (iterations 2-4" in message
        assert len(history) == 4


REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _job(corpus, tmp_path, name, max_restarts=0, die_at=None, timeout_s=60):
    """A 2-process torchrun job of 8 iterations saving every 2 into (and loading from) its directory;
    with ``die_at``, rank 1 is SIGKILLed there on the first start. Returns (the finished process, seconds
    it took, its metrics lines, its checkpoint directory)."""
    prefix, tokenizer = corpus
    directory, metrics = tmp_path / name, tmp_path / f"{name}.jsonl"
    flags = TINY + ["--data-path", prefix, "--tokenizer-model", tokenizer, "--data-cache-dir", f"{prefix}-cache",
                    "--train-iters", "8", "--save", str(directory), "--load", str(directory), "--save-interval", "2",
                    "--log-interval", "1", "--metrics-file", str(metrics), "--distributed-timeout-s", str(timeout_s)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               f"--max-restarts={max_restarts}", "-m", "tests.pretrain.dying_pretrain", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", DIE_RANK="1", DIE_AT=die_at or "never:0", WANDB_MODE="disabled",
               **RESTARTABLE)
    started = time.monotonic()
    job = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPOSITORY, timeout=300)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return job, time.monotonic() - started, lines, str(directory)


def test_a_killed_rank_ends_the_job_and_the_restart_resumes_to_the_same_loss(stdlib_corpus, tmp_path):
    reference, _, reference_lines, _ = _job(stdlib_corpus, tmp_path, "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    final_loss = reference_lines[-1]["loss"]

    # killed as iteration 5 begins: torchrun restarts the job, which resumes from iteration 4
    job, _, lines, _ = _job(stdlib_corpus, tmp_path, "mid-iteration", max_restarts=1, die_at="iteration:5")
    assert job.returncode == 0, job.stderr[-3000:]
    assert "at iteration 4" in job.stdout and lines[-1]["iteration"] == 8
    assert lines[-1]["loss"] == final_loss  # bit for bit: the same trajectory

    # killed while writing checkpoint 6: the job ends (no hang), checkpoint 4 stays latest and intact
    job, seconds, _, directory = _job(stdlib_corpus, tmp_path, "mid-save", die_at="save:6")
    assert job.returncode != 0 and seconds < 240, (job.returncode, seconds)
    checkpoint, manifest = read_manifest(directory)
    assert manifest["iteration"] == 4 and os.path.isdir(directory + "/iter_0000006.tmp")
    # started again (as a restart would be), it resumes from 4 and ends where the reference ended
    job, _, lines, _ = _job(stdlib_corpus, tmp_path, "mid-save", max_restarts=0)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "at iteration 4" in job.stdout and lines[-1]["loss"] == final_loss


def test_a_hung_rank_ends_the_job_at_the_collective_timeout(stdlib_corpus, tmp_path):
    job, seconds, lines, directory = _job(stdlib_corpus, tmp_path, "hang", die_at="hang:5", timeout_s=10)
    assert job.returncode != 0 and seconds < 120, (job.returncode, seconds)  # not a silent hang
    assert "timed out" in job.stderr.lower() or "timeout" in job.stderr.lower(), job.stderr[-3000:]
    assert read_manifest(directory)[1]["iteration"] == 4  # the last checkpoint before the hang, intact
