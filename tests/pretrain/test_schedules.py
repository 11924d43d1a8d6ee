"""Megatron's schedules: a batch ramp-up resumed mid-ramp continues at the exact sample and batch size;
sample-based lengths and learning-rate schedules equal their iteration-based twins where they coincide;
every decay style and weight-decay increment is megatron-core's scheduler's; --exit-interval and
--exit-duration-in-mins save and stop mid-decay, and the run resumes to the straight trajectory; the
per-token loss equals the mean of means when every token counts."""

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
    wsd = iters + ["--lr-decay-style", "WSD", "--lr-wsd-decay-style", "minus_sqrt", "--lr-wsd-decay-iters",
                   "8", "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.01",
                   "--end-weight-decay", "0.1"]
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
        # 6-8: WSD decaying from iteration 2 (and a rising weight decay), stopped mid-decay at 3 and 4
        wsd + ["--save", exits, "--exit-interval", "3"],                                       # 6: exits at 3
        wsd + ["--load", exits, "--save", exits, "--exit-duration-in-mins", "1e-9"],           # 7: then at 4
        wsd + ["--load", exits, "--save", exits],                                              # 8: to the end
        wsd,                                                                                   # 9: straight
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
    # each exit saved; the resumed runs continue exactly, mid-decay
    assert losses[6] + losses[7] + losses[8] == losses[9] and norms[6] + norms[7] + norms[8] == norms[9]
    assert losses[9] != losses[3]
    assert sorted(os.listdir(exits)) == ["iter_0000003", "iter_0000004", "iter_0000010", "latest"]


def test_every_decay_style_and_weight_decay_increment_is_megatron_cores_scheduler():
    """WSD with each of its decay styles, inverse-square-root, and the weight-decay increments: the rate
    and weight decay of every step equal megatron-core's OptimizerParamScheduler (as Megatron-LM builds it
    from the same flags, in samples), float for float."""
    from types import SimpleNamespace

    megatron = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    from pretrain.config.arguments import parse_config
    from pretrain.training.param_scheduler import build_param_scheduler

    batch, iters, warmup, decay, wsd = 8, 45, 3, 40, 12
    cases = [(["--lr-decay-style", "WSD", "--lr-wsd-decay-style", style, "--lr-wsd-decay-iters", str(wsd)],
              dict(lr_decay_style="WSD", lr_wsd_decay_style=style, wsd_decay_steps=wsd * batch))
             for style in ("linear", "cosine", "exponential", "minus_sqrt")]
    cases += [(["--lr-decay-style", "inverse-square-root"], dict(lr_decay_style="inverse-square-root"))]
    cases += [(["--lr-decay-style", "cosine", "--weight-decay-incr-style", style, "--start-weight-decay",
                "0.01", "--end-weight-decay", "0.1"],
               dict(lr_decay_style="cosine", start_wd=0.01, end_wd=0.1, wd_incr_style=style))
              for style in ("linear", "cosine")]
    for flags, theirs in cases:
        config = parse_config(["--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", str(warmup),
                               "--lr-decay-iters", str(decay), "--train-iters", str(iters), "--weight-decay",
                               "0.05", "--global-batch-size", str(batch), *flags])
        ours = build_param_scheduler(config, BatchSchedule(batch, batch))
        optimizer = SimpleNamespace(param_groups=[{"wd_mult": 1.0}])
        settings = dict(init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=warmup * batch,
                        lr_decay_steps=decay * batch, start_wd=0.05, end_wd=0.05, wd_incr_steps=iters * batch,
                        wd_incr_style="constant")
        reference = megatron.OptimizerParamScheduler(optimizer, **{**settings, **theirs})
        groups = [{"wd_mult": 1.0}]
        for step in range(iters + 2):
            ours.step(groups)
            assert (groups[0]["lr"], groups[0]["weight_decay"]) == (
                optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"]), (flags, step)
            ours.advance(batch)
            reference.step(increment=batch)
    # WSD holds the peak until its decay starts, then reaches --min-lr at the decay's end
    config = parse_config(["--lr", "1.0", "--min-lr", "0.1", "--lr-decay-style", "WSD",
                           "--lr-wsd-decay-iters", "4", "--lr-decay-iters", "10", "--train-iters", "10",
                           "--global-batch-size", "1"])
    rates = build_param_scheduler(config, BatchSchedule(1, 1)).lr
    assert [rates(step) for step in (0, 6)] == [1.0, 1.0] and rates(10) == pytest.approx(0.1) and rates(7) < 1


def test_a_cooldown_branch_is_the_separate_run_of_its_length(stdlib_corpus, tmp_path):
    """A warmup-stable-decay run saves in its stable phase; a branch from iteration 4 cooling down over 4
    iterations (stopped mid-decay at 6, resumed from its own checkpoint to 8) takes, bit for bit, the
    steps of a separate run whose decay ends at 8: the same rates, reading on in the same data. Branches
    that cannot be are refused naming why."""
    from pretrain.config.arguments import ConfigError, parse_config
    from pretrain.startup.validation import validate

    stable, branch, separate = (str(tmp_path / name) for name in ("stable", "branch", "separate"))
    base = _without(TINY, "--train-iters", "--lr-decay-style") + [
        "--train-iters", "16", "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "cosine",
        "--lr-wsd-decay-iters", "4"]
    layouts = [base + ["--save", stable, "--save-interval", "4", "--exit-interval", "8"],
               base + ["--load", stable, "--ckpt-step", "4", "--cooldown-iters", "4", "--save", branch,
                       "--exit-interval", "6"],
               base + ["--load", branch, "--cooldown-iters", "4"],
               _without(base, "--lr-wsd-decay-iters") + ["--lr-decay-iters", "8", "--lr-wsd-decay-iters", "4",
                                                         "--save", separate, "--exit-interval", "8"]]
    losses = [result[0] for result in run_world(1, _train, layouts, stdlib_corpus, timeout_s=300)[0]]
    assert len(losses[1]) == 2 and losses[1] + losses[2] == losses[3][4:]  # bit for bit
    assert losses[0][:4] == losses[3][:4] and losses[0][4:] != losses[3][4:]
    prefix, tokenizer = stdlib_corpus
    data = ["--data-path", prefix, "--tokenizer-model", tokenizer, "--data-cache-dir", f"{prefix}-cache"]
    for extra, refusal in [
            (["--cooldown-iters", "4"], r"--cooldown-iters 4 branches from a checkpoint of a stable run"),
            (["--load", separate, "--cooldown-iters", "4"], r"iteration 8 is not in a stable phase"),
            (["--load", stable, "--cooldown-iters", "10"],
             r"from iteration 8 ends past the stable run's data"),
            (["--load", stable, "--cooldown-iters", "4", "--train-iters", "20"],
             r"--train-iters 20 differs from the stable run's 16")]:
        with pytest.raises(ConfigError, match=refusal):
            validate(parse_config(_without(base, "--train-iters") + data + extra), 1)


def _fp16_run(rank, world_size, flags, corpus):
    """The run's metrics lines, and the weight decay its groups end with."""
    from pretrain.config.arguments import parse_config
    from pretrain.startup.validation import validate
    from pretrain.training.trainer import Trainer
    import torch

    prefix, tokenizer = corpus
    config = parse_config(flags + ["--data-path", prefix, "--tokenizer-model", tokenizer, "--data-cache-dir",
                                   f"{prefix}-cache"])
    trainer = Trainer(config, validate(config, world_size), torch.device("cpu"))
    trainer.train()
    return [group["weight_decay"] for group in trainer.optimizer.param_groups if group.get("wd_mult", 1.0)]


def test_fp16_skipped_steps_do_not_advance_the_schedule(stdlib_corpus, tmp_path):
    """A --fp16 run whose loss scale starts too high skips its first updates: the rate and weight decay
    stand still over them (the data position moves on), as megatron-core's OptimizerParamScheduler does
    when driven as Megatron's train_step drives it (``step(increment)`` after a successful update only)."""
    megatron = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    from types import SimpleNamespace

    iters, batch = 8, 8
    metrics = str(tmp_path / "fp16.jsonl")
    flags = _without(TINY, "--train-iters", "--log-interval") + [
        "--train-iters", str(iters), "--log-interval", "1", "--fp16", "--initial-loss-scale", str(2.0 ** 24),
        "--hysteresis", "1",
        "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.01", "--end-weight-decay", "0.1",
        "--metrics-file", metrics]
    decay = run_world(1, _fp16_run, flags, stdlib_corpus)[0]
    lines = [json.loads(line) for line in open(metrics)]
    skipped = [line["skipped"] for line in lines]
    assert 0 < sum(skipped) < iters and skipped[0], skipped  # some steps skipped, some applied
    theirs = SimpleNamespace(param_groups=[{}])
    reference = megatron.OptimizerParamScheduler(
        theirs, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=2 * batch,
        lr_decay_steps=iters * batch, lr_decay_style="cosine", start_wd=0.01, end_wd=0.1,
        wd_incr_steps=iters * batch, wd_incr_style="linear")
    for line in lines:
        assert line["lr"] == theirs.param_groups[0]["lr"], line["iteration"]
        last_decay = theirs.param_groups[0]["weight_decay"]
        if not line["skipped"]:
            reference.step(increment=batch)
    assert lines[-1]["consumed_samples"] == iters * batch  # the data moved on over the skipped steps
    assert decay and all(value == last_decay for value in decay)  # the last step's weight decay
