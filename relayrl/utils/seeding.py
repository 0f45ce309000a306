"""Seeding and RNG state capture for reproducible runs and exact resume.

``seed_everything(seed)`` seeds Python's ``random``, NumPy's global generator and torch (CPU
and every CUDA device). ``rng_state()`` captures all of them and ``set_rng_state(state)``
restores them, so a resumed run draws the same random numbers as an uninterrupted one.
The captured state holds only tensors, ints, floats, strings and tuples/lists, so it can be
saved with ``torch.save`` and read back with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import os
import random
import typing

import numpy as np
import torch

RngState = dict[str, object]


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU + CUDA); also sets ``PYTHONHASHSEED`` for child processes."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    os.environ["PYTHONHASHSEED"] = str(seed)


def rng_state() -> RngState:
    """The current state of every global RNG (python, numpy, torch, CUDA if present)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: RngState = {
        "python": random.getstate(),
        "numpy": (
            str(kind),
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: RngState) -> None:
    """Restore what ``rng_state()`` captured; raises ``KeyError`` naming a missing part."""
    for part in ("python", "numpy", "torch"):
        if part not in state:
            raise KeyError(f"rng state is missing {part!r} (has {sorted(state)})")
    # torch.load may turn the inner tuple into a list; random.setstate needs tuples.
    py = typing.cast(tuple[int, list[int], float | None], state["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = typing.cast(tuple[str, object, int, int, float], state["numpy"])
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(typing.cast(torch.Tensor, state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(typing.cast(list[torch.Tensor], state["cuda"]))
