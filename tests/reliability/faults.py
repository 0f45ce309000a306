"""Faults the reliability suite injects: reward functions that raise, hang or kill their
worker, chosen by the row id so every test knows exactly which prompts must fail."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

from relayrl.rewards.tasks import arithmetic_reward_fn

RAISE, HANG, DIE, NAN = 3, 5, 7, 9  # row number % 10 -> fault


def row_number(row_id: object) -> int:
    """``'arithmetic/train/17'`` -> 17."""
    return int(str(row_id).rsplit("/", 1)[-1])


def fault_of(row_id: object, faults: tuple[int, ...]) -> int | None:
    n = row_number(row_id) % 10
    return n if n in faults else None


def faulty_reward(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    id: str,
    answer: str,
    **data: object,
) -> float:
    """The arithmetic verifier, except: rows ending in 3 raise, in 5 hang, in 7 SIGKILL their own
    process (run it in a RewardPool!), in 9 score NaN."""
    fault = fault_of(id, (RAISE, HANG, DIE, NAN))
    if fault == RAISE:
        raise ValueError(f"injected reward failure for {id}")
    if fault == HANG:
        time.sleep(3600)
    if fault == DIE:
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == NAN:
        return math.nan
    return arithmetic_reward_fn(prompt, completions, prompt_ids, completion_ids, answer=answer)


def nan_reward(**kwargs: object) -> float:
    return math.nan


STUCK = threading.Event()  # set by a test to let stuck_reward return
STUCK_CALLS: list[float] = []  # when each stuck_reward call began


def stuck_reward(**kwargs: object) -> float:
    """A reward function that never returns (until a test sets ``STUCK``; 10 minutes at most)."""
    STUCK_CALLS.append(time.monotonic())
    STUCK.wait(600)
    return 0.0
