"""Megatron's schedules: a batch ramp-up resumed mid-ramp continues at the exact sample and batch size;
sample-based lengths and learning-rate schedules equal their iteration-based twins where they coincide;
--exit-interval and --exit-duration-in-mins save and stop, and the run resumes to the straight
trajectory; the per-token loss equals the mean of means when every token counts."""

import json
import os

import pytest

from pretrain.training.batch_schedule import BatchSchedule, build_batch_schedule, parse_step_schedule
from pretrain.config.schema import OptimizerConfig
from pretrain.training.lr_schedule import build_lr_schedule
from tests.parity import assert_trajectory_close
from tests.pretrain.test_trainer import TINY, _train
from tests.world import run_world


def _without(flags: list[str], *names: str) -> list[str]:
    """TINY without the given value flags."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in names:
            skip = True
        else:
            out.append(flag)
    return out


def test_ramp_up_and_step_schedules_follow_megatron():
    ramp = build_batch_schedule(1024, 8, 1, [16, 8, 300000], None, 2048)
    assert ramp.batch_size(0) == 16 and ramp.batch_size(300001) == 1024
    # 126 increments of 8, one per 300000 / 126 = 2380.95 samples: the fifth after 11904.8
    assert ramp.batch_size(11904) == 16 + 4 * 8 and ramp.batch_size(11905) == 16 + 5 * 8
    steps = parse_step_schedule("0:16, 2.4B:320 4.8b:624", 2048)
    assert steps == ((0, 16), (2_400_000_000 // 2048, 320),
                     (4_800_000_000 // 2048, 624))  # thresholds in tokens
    schedule = BatchSchedule(624, 8, steps=steps)
    assert schedule.batch_size(0) == 16 and schedule.batch_size(2_400_000_000 // 2048) == 320
    constant = BatchSchedule(8, 2)
    # a partial batch is dropped
    assert constant.iterations_for(81) == 10 and constant.samples_after(10) == 80
    with pytest.raises(ValueError, match="thresholds start at 0"):
        parse_step_schedule("100:16", 32)
    # resumed at iteration 4 after 32 samples: the same batch is the same schedule; another continues there
    assert constant.resumed_at(16, 128) is constant and ramp.resumed_at(2, 32) is ramp
    resumed = BatchSchedule(16, 4).resumed_at(4, 32)
    assert resumed.samples_after(8) == 96 and resumed.samples_after(2) == 16  # before: the checkpoint's mean
    assert resumed.iterations_for(100) == 8 and resumed.lr_samples(8) == 96 and constant.lr_samples(8) == 64


def test_sample_spellings_of_the_learning_rate_equal_the_iteration_ones():
    iterations = build_lr_schedule(OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=8,
                                                   lr_decay_style="cosine"), 10, None, BatchSchedule(8, 8))
    samples = build_lr_schedule(OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_samples=16, lr_decay_samples=64,
                                                lr_decay_style="cosine"), 10, 80, BatchSchedule(8, 8))
    fraction = build_lr_schedule(OptimizerConfig(lr=1.0, min_lr=0.1,
                                                 lr_warmup_fraction=0.25, lr_decay_iters=8,
                                                 lr_decay_style="cosine"), 10, None, BatchSchedule(8, 8))
    rates = [iterations(8 * step) for step in range(10)]
    assert rates == [samples(8 * step) for step in range(10)] == [fraction(8 * step) for step in range(10)]
    assert rates[0] == 0.0 and rates[2] == 1.0 and rates[8:] == [0.1,
                                                                 0.1]  # Megatron's: from 0, min after decay


RAMP = ["--micro-batch-size", "1", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "24"]


def test_runs_resume_mid_ramp_exit_early_and_match_their_twins(stdlib_corpus, tmp_path):
    ramp, exits = str(tmp_path / "ramp"), str(tmp_path / "exits")
    base = _without(TINY, "--train-iters", "--lr-warmup-iters")
    iters = ["--train-iters", "10", "--lr-warmup-iters",
             "2"]  # TINY's, which its sample twin spells in samples
    layouts = [
        iters + RAMP + ["--metrics-file",
                        str(tmp_path / "straight.jsonl")],                  # 0: ramp, straight
        iters + RAMP + ["--train-iters", "4", "--lr-decay-iters", "10", "--save",
                        ramp],       # 1: mid-ramp, saved
        iters + RAMP + ["--load", ramp, "--metrics-file", str(tmp_path / "resumed.jsonl")],    # 2: resumed
        # 3: iteration-based
        iters,
        ["--train-samples", "80", "--lr-warmup-samples",
         "16"],                                # 4: its sample twin
        # 5: per-token loss
        iters + ["--calculate-per-token-loss"],
        iters + ["--save", exits, "--exit-interval", "3"],                                     # 6: exits at 3
        iters + ["--load", exits, "--save", exits, "--exit-duration-in-mins",
                 "1e-9"],         # 7: ... then at 4
        iters + ["--load", exits, "--save",
                 exits],                                            # 8: ... to the end
    ]
    results = run_world(2, _train, layouts, stdlib_corpus, base, timeout_s=300)[0]
    losses = [result[0] for result in results]
    norms = [result[1] for result in results]
    straight = [json.loads(line) for line in open(tmp_path / "straight.jsonl")]
    resumed = [json.loads(line) for line in open(tmp_path / "resumed.jsonl")]
    assert [line["batch_size"] for line in straight if line["iteration"] in (1, 5, 10)] == [2, 4, 8]
    assert losses[1] + losses[2] == losses[0] and norms[1] + norms[2] == norms[0]  # bit for bit
    # the exact sample
    assert resumed[0]["iteration"] == 5 and resumed[0]["consumed_samples"] == 2 + 2 + 2 + 2 + 4
    assert losses[4] == losses[3] and norms[4] == norms[3]  # --train-samples 80 is --train-iters 10 here
    assert_trajectory_close(losses[5], losses[3], "per-token loss: loss")  # every token counts alike here
    assert len(losses[6]) == 3 and len(losses[7]) == 1  # stopped at the interval, then by the clock
    # each exit saved; the resumed runs continue exactly
    assert losses[6] + losses[7] + losses[8] == losses[3]
    assert sorted(os.listdir(exits)) == ["iter_0000003", "iter_0000004", "iter_0000010", "latest"]
