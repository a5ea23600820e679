"""Dynamic loss scaling for fp16 whose overflow decision is shared by every stage.

Owns ``LossScaler``: the scale multiplies the loss on the last stage only (the other stages
back-propagate the already-scaled gradient they receive); gradients are unscaled before the
all-reduce; the skip/step decision comes from the world-wide overflow flag, so an inf in one
stage skips the step everywhere (varuna-original.md §8.1–8.2, without apex).

Plain arithmetic: imports neither torch nor anything of ``varuna_sdk``, and must never.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LossScaler:
    """Dynamic loss scale: halve on overflow (not below ``min_scale``), double after
    ``growth_interval`` clean steps. ``enabled=False`` keeps the scale at 1 (fp32/bf16)."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    enabled: bool = True
    clean_steps: int = 0

    def __post_init__(self) -> None:
        if not self.enabled:
            self.scale = 1.0
        if self.scale <= 0:
            raise ValueError(f"loss scale {self.scale} must be > 0")

    def update(self, overflow: bool) -> None:
        """Record one step's world-wide overflow decision and adapt the scale."""
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0

    def state_dict(self) -> dict:
        """Every field (scale, growth settings, clean steps) as a plain dict, for a checkpoint."""
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore the fields of a ``state_dict()``."""
        for k, v in state.items():
            setattr(self, k, v)
