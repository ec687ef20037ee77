"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay.

A schedule is a pure function of the optimizer step, so its whole state is the
step counter the engine checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from asyncrl.config import TrainerConfig

__all__ = ["lr_schedule"]


def lr_schedule(cfg: TrainerConfig, total_steps: int) -> Callable[[int], float]:
    """``lr(step)`` for step 0, 1, ...

    Linear warm-up ``lr * (step + 1) / (warmup_steps + 1)`` reaching ``cfg.lr`` at step
    ``warmup_steps``, then ``cfg.lr_schedule`` decay to ``cfg.lr * cfg.min_lr_ratio`` at step
    ``(cfg.decay_steps or total_steps) - 1``, held there afterwards.
    """
    peak, warm, floor = cfg.lr, cfg.warmup_steps, cfg.lr * cfg.min_lr_ratio
    end = max(cfg.decay_steps or total_steps, warm + 1)
    kind = cfg.lr_schedule

    def lr(step: int) -> float:
        if step < warm:
            return peak * (step + 1) / (warm + 1)
        if kind == "constant":
            return peak
        frac = min(1.0, (step - warm) / max(1, end - 1 - warm))
        if kind == "linear":
            return peak + (floor - peak) * frac
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))

    return lr
