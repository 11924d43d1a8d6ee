"""Faults: non-finite steps are skipped alike on every rank and stop the run at the limit."""

import torch

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
