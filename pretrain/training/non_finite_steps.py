"""Non-finite steps: stop at the first (--check-for-nan-in-loss-and-grad) or skip up to --bad-step-limit."""

from __future__ import annotations

import math

import torch

from parallel import comm, zero
from parallel.process_groups import ParallelGroups
from pretrain.config.schema import Config
from pretrain.observability.metrics import print_rank0


class NonFiniteSteps:
    """Owns the current run of consecutive non-finite steps. Never changes parameters: the optimizer has
    already skipped such a step on every rank; this decides whether the run goes on."""

    def __init__(self, config: Config, groups: ParallelGroups, device: torch.device):
        self.config, self.groups, self.device = config, groups, device
        self.bad_steps: list[int] = []

    def after(self, iteration: int, loss: float, local_loss: float, step: zero.StepResult) -> None:
        """Stop at the first step whose loss or gradient norm is not finite (--check-for-nan-in-loss-and-grad,
        naming the ranks whose own loss was not), or count consecutive ones and stop at --bad-step-limit.

        Every rank sees the same loss (the pipeline broadcasts it, data parallelism averages it) and the
        same norm (reduced over the world), so every rank decides alike. A non-finite loss makes
        non-finite gradients, and the optimizer then skips the update on every rank: the parameters and
        the newest checkpoint are as before the step."""
        training = self.config.training
        if math.isfinite(loss) and (math.isfinite(step.grad_norm) or training.fp16):
            self.bad_steps = []
            return
        if training.check_for_nan_in_loss_and_grad:
            seen = comm.all_gather_object(self.groups.is_last_stage and not math.isfinite(local_loss),
                                          self.groups.world, self.device)
            ranks = [rank for rank, bad in enumerate(seen) if bad]
            where = (f"the loss of rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} was not "
                     "finite" if ranks else "every rank's loss was finite, the gradient norm was not")
            raise FloatingPointError(
                f"iteration {iteration}: {where} (loss {loss}, grad norm {step.grad_norm}); the step was not "
                "applied and the run stops here, the newest checkpoint intact: resume from it with a lower "
                "--lr or more warm-up (--no-check-for-nan-in-loss-and-grad skips such steps instead)")
        self.bad_steps.append(iteration)
        limit = training.bad_step_limit
        print_rank0(self.groups.rank == 0,
                    f"iteration {iteration}: loss {loss}, grad norm {step.grad_norm}: step skipped "
                    f"({len(self.bad_steps)} in a row, the run stops at {limit})")
        if len(self.bad_steps) >= limit:
            raise FloatingPointError(
                f"{limit} consecutive steps with a non-finite loss or gradient norm (iterations "
                f"{self.bad_steps[0]}-{iteration}; the last: loss {loss}, grad norm {step.grad_norm}). The "
                "run stops "
                f"here without saving; resume from the last checkpoint with a lower --lr or more warm-up")
