"""Learning-rate schedule of the train engine (warmup, then constant / linear / cosine decay)."""

from __future__ import annotations

import math

from relayrl.api.config import OptimizerConfig


def lr_factor(step: int, opt: OptimizerConfig, total_steps: int) -> float:
    """LR multiplier after ``step`` scheduler steps.

    Warmup: ``(step + 1) / warmup_steps`` for ``step < warmup_steps`` (the first step
    already trains, the last warmup step is at the peak). Then ``constant`` = 1; ``linear`` /
    ``cosine`` decay from the peak to ``min_lr_ratio``, reached at step ``total_steps - 1``.

    Not ``transformers.get_scheduler``: its warmup starts at LR 0 (the first optimizer step would not
    train), its linear decay has no floor and it ends one step later; these 15 lines keep the schedule
    that checkpoints and tests already hold.
    """
    if step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    if opt.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step + 1 - opt.warmup_steps) / max(1, total_steps - opt.warmup_steps))
    if opt.lr_schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return opt.min_lr_ratio + (1.0 - opt.min_lr_ratio) * decay
