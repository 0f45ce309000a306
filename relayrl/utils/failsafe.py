"""Fast paths that fall back to the CPU-tested path when they fail at first use.

CUDA graphs, flash-attn (decode and varlen training), bf16 autocast, NCCL and moving weights off
the device cannot run on the CPU machines relayrl is tested on. Each is therefore tried at its
first use against the path that is tested (eager steps, SDPA / ``relayrl_varlen`` attention, fp32,
gloo, weights kept in place): an exception there, or results farther from the tested path's than
``tolerance`` allows, switch that path off for the rest of the process with one warning naming it
and the reason. ``FALLBACKS`` keeps what fell back (``relayrl selftest`` reports it).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("relayrl.failsafe")
FALLBACKS: dict[str, str] = {}  # fast path -> why it fell back (this process)


def reason(error: BaseException) -> str:
    """One line naming an exception: ``ImportError: ...``."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}"[:300]


def fall_back(path: str, why: str, instead: str) -> None:
    """Record that ``path`` fell back to ``instead`` because of ``why``; warns once per path."""
    if path not in FALLBACKS:
        log.warning("%s failed at first use (%s); using %s instead", path, why, instead)
    FALLBACKS[path] = why


def distance(fast: torch.Tensor, ref: torch.Tensor) -> float:
    """How far ``fast`` is from ``ref``: for ``[..., V]`` logits the largest total-variation distance
    between the two next-token distributions of a row (0 = equal, 1 = disjoint); for ``[..., 1]``
    scalars (value heads) the largest difference relative to the largest value."""
    a, b = fast.detach().float(), ref.detach().float()
    if a.shape != b.shape or not torch.isfinite(a).all():
        return float("inf")
    if not a.numel():
        return 0.0
    if a.shape[-1] == 1:
        return float((a - b).abs().max() / (1.0 + b.abs().max()))
    return float(0.5 * (a.softmax(-1) - b.softmax(-1)).abs().sum(-1).max())


def tolerance(dtype: torch.dtype) -> float:
    """The largest ``distance`` a correct fast path computing in ``dtype`` shows (rounding alone)."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 0.05


def check(path: str, fast: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, instead: str) -> bool:
    """Whether ``fast`` is within ``tolerance(dtype)`` of ``ref``; if not, ``path`` falls back."""
    gap, tol = distance(fast, ref), tolerance(dtype)
    if gap <= tol:
        return True
    fall_back(path, f"its first result differs from {instead}'s by {gap:.3g} > {tol:g}", instead)
    return False
