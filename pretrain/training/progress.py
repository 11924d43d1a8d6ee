"""Where a run stands: the state a resumed run continues from besides the model and optimizer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainingProgress:
    """The last finished iteration and the samples consumed so far.

    Owns the data position: the sampler restarts at ``consumed_samples``, and the learning-rate
    schedule and the batch ramp-up are pure functions of it, so this is their state too. The trainer
    advances it once per step; checkpoints write ``state_dict()`` into the manifest and a resumed
    run loads it back. Never holds tensors, never depends on the layout.
    """

    iteration: int = 0
    consumed_samples: int = 0

    def advance(self, batch_size: int) -> None:
        self.iteration += 1
        self.consumed_samples += batch_size

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.iteration, self.consumed_samples = int(state["iteration"]), int(state["consumed_samples"])
