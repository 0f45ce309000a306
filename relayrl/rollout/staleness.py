"""The capacity rule of bounded-staleness rollout (AReaL-lite style), as pure functions.

Counting in prompts (groups) and in versions relative to the executor's start:

- the trainer consumes ``batch_size`` prompts per step and bumps the version once per step,
  so the batch consumed after ``k`` consumed batches is consumed at version ``>= k``; and it is
  consumed at a version ``>= version`` (the current one). Call ``ahead = max(version *
  batch_size, consumed)``: the prompts that are "used up" by the schedule so far.
- a prompt started now (at ``version``) with ``accepted + running`` prompts ahead of it lands
  (in start order) in a batch consumed at version ``v_c`` with
  ``v_c * batch_size <= ahead + accepted + running``; its staleness ``v_c - version`` stays
  ``<= eta`` when ``ahead + accepted + running < (eta + 1 + version) * batch_size``.

That gives AReaL-lite's rule ``(eta + version + 1) * B - (consumed + accepted + running)``
with ``consumed`` replaced by ``ahead``, so a version bumped ahead of consumption (several
weight updates per batch) never starves the producer. A consumer blocked on ``waiting``
prompts always gets enough capacity to fill its batch (progress). Episodes that still end up
too stale (one slow episode overtaken by later ones) are caught by ``is_expired`` at
consumption time, so the bound holds unconditionally; the capacity rule keeps that rare.
"""

from __future__ import annotations

import torch


def rollout_capacity(
    *,
    max_staleness: int,
    batch_size: int,
    version: int,
    consumed: int,
    accepted: int,
    running: int,
    max_concurrent: int,
    waiting: int = 0,
) -> int:
    """How many new prompts may start now.

    Args:
        max_staleness: eta; 0 is synchronous RL.
        batch_size: prompts per training step.
        version: current weight version minus the version the executor started at.
        consumed: prompts handed to the trainer so far (since the start version).
        accepted: prompts finished and accepted, not yet consumed.
        running: prompts in flight.
        max_concurrent: most prompts in flight at once.
        waiting: prompts the consumer is blocked on right now (0 when nobody waits).
    """
    for name, value in (("batch_size", batch_size), ("max_concurrent", max_concurrent)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    for name, value in (
        ("max_staleness", max_staleness),
        ("version", version),
        ("consumed", consumed),
        ("accepted", accepted),
        ("running", running),
        ("waiting", waiting),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    ahead = max(version * batch_size, consumed)
    budget = (max_staleness + 1 + version) * batch_size - ahead - accepted - running
    budget = max(budget, waiting - accepted - running)  # a blocked consumer always gets its batch
    return max(0, min(budget, max_concurrent - running))


def is_expired(oldest_version: int, current_version: int, max_staleness: int) -> bool:
    """True when a trajectory whose oldest generated token has ``oldest_version`` may not be
    trained on at ``current_version`` (it lags by more than ``max_staleness`` versions)."""
    return oldest_version < current_version - max_staleness


def default_max_concurrent(batch_size: int, max_staleness: int, configured: int = 0) -> int:
    """``configured`` or, when 0, ``batch_size * (max_staleness + 1)``."""
    return configured if configured > 0 else batch_size * (max_staleness + 1)


def token_staleness(versions: torch.Tensor, loss_mask: torch.Tensor, version: int) -> dict[str, float]:
    """``staleness_mean`` / ``staleness_max`` of ``version - token version`` over the loss tokens
    (0 without any): the one measure the driver (``rollout/``) and the actor (``actor/``) report."""
    lag = (version - versions[loss_mask.bool()]).double()
    if not lag.numel():
        return {"staleness_mean": 0.0, "staleness_max": 0.0}
    return {"staleness_mean": float(lag.mean()), "staleness_max": float(lag.max())}
