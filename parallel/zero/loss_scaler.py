"""Loss scaling for fp16: a dynamic scale with growth, backoff and hysteresis.

The overflow decision is made by the caller over every rank (one all-reduce), so all ranks skip the
same step and keep the same scale. bf16 and fp32 use a constant scale of 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicLossScaler:
    """The fp16 loss scale (Megatron's rule): backs off once ``hysteresis`` overflowing steps have
    been seen since the last growth, then on every further overflow; grows after ``growth_interval``
    clean steps in a row. Owns only numbers; never inspects gradients."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        self._clean_steps = 0
        self._hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:  # stays <= 0 until the next growth: overflows keep halving
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps,
                "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean_steps, self._hysteresis_left = (state["scale"], state["clean_steps"],
                                                                state["hysteresis_left"])


@dataclass
class ConstantLossScaler:
    """Scale 1 (fp32, bf16): nothing to grow or back off."""

    scale: float = 1.0

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
