"""A stats tracker for training and rollout metrics (after AReaL-lite's ``stats_tracker``).

Record during a step, export once per step::

    from relayrl.utils import stats

    with stats.record_timing("train_step"), stats.scope("actor"):
        stats.denominator(n_tokens=batch["loss_mask"].bool())
        stats.stat(denominator="n_tokens", entropy=entropy, ratio=ratio)  # token-level [B, L]
        stats.scalar(lr=3e-6, grad_norm=1.7)
    metrics = stats.export()  # {"actor/entropy": ..., "actor/n_tokens": ..., "timing/train_step": ...}

- ``scope(name)`` nests: keys recorded inside get the prefix ``name/`` (scopes are per thread,
  so a rollout thread and the trainer thread can each use their own).
- ``denominator(**masks)`` records boolean masks; each exports as its token count (sum).
- ``stat(denominator=..., **tensors)`` records tensors shaped like that mask, reduced only over
  the elements the mask selects: ``avg`` = sum(x[mask]) / sum(mask), ``min``, ``max``, ``sum``.
  Repeated records (micro-batches) accumulate: the average is over all selected tokens.
- ``scalar(**floats)`` records plain numbers (averaged over records unless told otherwise).
- ``gauge(**floats)`` reports a value that is set once per step (a counter, a batch summary,
  another part's result): reporting the same key twice before an export is an error, so two
  parts can never silently overwrite each other's metric. Across ranks the highest is kept
  (the ranks that report one agree; the others report nothing).
- ``record_timing(name)`` records the seconds spent in a block as ``timing/<scope>/name``,
  summed over the step's entries and, across ranks, the slowest rank's total.
- ``export()`` reduces over all torch.distributed ranks when a process group exists: numerators
  and denominators are summed before dividing, so the result equals one process computing on
  the concatenated data. Every rank must call it (it is a collective). It also works with no
  torch.distributed at all.

With one reduce type a key exports under its own name; with several, as ``key/avg``,
``key/min``, ... Keys with no selected element anywhere are left out of the export.
"""

from __future__ import annotations

import math
import threading
import time
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

from relayrl.utils import dist as dist_utils

ReduceType = Literal["avg", "min", "max", "sum"]
REDUCE_TYPES: tuple[ReduceType, ...] = ("avg", "min", "max", "sum")
Kind = Literal["stat", "scalar", "denominator", "timing", "gauge"]


@dataclass
class _Acc:
    """Running partial reductions of one key on this rank."""

    kind: Kind
    reduces: tuple[ReduceType, ...]
    total: float = 0.0  # sum of selected values (timing: seconds)
    count: float = 0.0  # number of selected values
    low: float = math.inf
    high: float = -math.inf

    def add(self, total: float, count: float, low: float, high: float) -> None:
        self.total += total
        self.count += count
        self.low = min(self.low, low)
        self.high = max(self.high, high)


def _as_reduces(reduce: ReduceType | Sequence[ReduceType], key: str) -> tuple[ReduceType, ...]:
    reduces = (reduce,) if isinstance(reduce, str) else tuple(reduce)
    if not reduces or any(r not in REDUCE_TYPES for r in reduces):
        raise ValueError(f"stats key {key!r}: reduce must be one or more of {list(REDUCE_TYPES)}, got {reduce!r}")
    return reduces


def _number(kind: str, key: str, value: object) -> float:
    """``value`` (a float, an int or a one-element tensor) as a float; a TypeError naming ``key`` otherwise."""
    try:
        return float(typing.cast(float, value))
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{kind} {key!r} must be a number, got {value!r}") from None


def _as_mask(value: object, key: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"denominator {key!r} must be a boolean torch.Tensor, got {type(value).__name__}")
    if value.dtype == torch.bool:
        return value.detach()
    if value.dtype.is_floating_point or value.dtype.is_complex:
        raise TypeError(f"denominator {key!r} must be a boolean (or 0/1 integer) mask, got dtype {value.dtype}")
    return value.detach() != 0


class _Scopes(threading.local):
    def __init__(self) -> None:
        self.stack: list[str] = []  # this thread's scope names, outermost first


class StatsTracker:
    """Collects metrics during a step and exports them reduced over ranks. Thread-safe."""

    def __init__(self, name: str = "") -> None:
        self.root = [name.strip("/")] if name.strip("/") else []
        self._lock = threading.RLock()
        self._scopes = _Scopes()
        self._accs: dict[str, _Acc] = {}
        self._masks: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ scopes and keys
    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix keys recorded inside the block with ``name/`` (nests; per thread)."""
        name = name.strip("/")
        if not name:
            raise ValueError("stats scope name must be non-empty")
        self._scopes.stack.append(name)
        try:
            yield
        finally:
            self._scopes.stack.pop()

    def full_key(self, key: str) -> str:
        """``key`` with the current scopes in front, e.g. ``actor/loss``."""
        return "/".join([*self.root, *self._scopes.stack, key])

    def _acc(self, key: str, kind: Kind, reduces: tuple[ReduceType, ...]) -> _Acc:
        acc = self._accs.get(key)
        if acc is None:
            acc = self._accs[key] = _Acc(kind, reduces)
        elif (acc.kind, acc.reduces) != (kind, reduces):
            raise ValueError(
                f"stats key {key!r} was recorded as {acc.kind} with reduce {list(acc.reduces)}, "
                f"now as {kind} with reduce {list(reduces)}"
            )
        return acc

    # ------------------------------------------------------------------ recording
    def denominator(self, **masks: torch.Tensor) -> None:
        """Record boolean masks that later ``stat`` calls average over; each exports its count."""
        with self._lock:
            for key, value in masks.items():
                full = self.full_key(key)
                mask = _as_mask(value, full)
                count = float(mask.sum())
                self._acc(full, "denominator", ("sum",)).add(count, count, count, count)
                self._masks[full] = mask

    def stat(
        self, denominator: str, reduce: ReduceType | Sequence[ReduceType] = "avg", **tensors: torch.Tensor
    ) -> None:
        """Record tensors shaped like the mask ``denominator`` (recorded in this scope),
        reduced over the elements it selects."""
        with self._lock:
            den_key = self.full_key(denominator)
            mask = self._masks.get(den_key)
            if mask is None:
                raise KeyError(
                    f"stats denominator {den_key!r} was not recorded; call denominator({denominator}=mask) "
                    f"in the same scope first (recorded: {sorted(self._masks)})"
                )
            for key, value in tensors.items():
                full = self.full_key(key)
                reduces = _as_reduces(reduce, full)
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"stat {full!r} must be a torch.Tensor, got {type(value).__name__}")
                if value.shape != mask.shape:
                    raise ValueError(
                        f"stat {full!r} has shape {list(value.shape)} but its denominator {den_key!r} "
                        f"has shape {list(mask.shape)}"
                    )
                acc = self._acc(full, "stat", reduces)
                x = value.detach().to(torch.float64)[mask.to(value.device)]
                if x.numel():
                    acc.add(float(x.sum()), x.numel(), float(x.min()), float(x.max()))

    def scalar(self, reduce: ReduceType | Sequence[ReduceType] = "avg", **values: float) -> None:
        """Record plain numbers (floats, ints or one-element tensors)."""
        with self._lock:
            for key, value in values.items():
                full = self.full_key(key)
                v = _number("scalar", full, value)
                self._acc(full, "scalar", _as_reduces(reduce, full)).add(v, 1.0, v, v)

    def gauge(self, **values: float) -> None:
        """Report once-per-step values; a key reported twice before the export is a ValueError."""
        with self._lock:
            for key, value in values.items():
                full = self.full_key(key)
                v = _number("gauge", full, value)
                acc = self._acc(full, "gauge", ("max",))
                if acc.count:
                    raise ValueError(
                        f"stats key {full!r} reported twice in one step ({acc.high} then {v}): two parts export "
                        "the same metric; give one of them another name"
                    )
                acc.add(v, 1.0, v, v)

    @contextmanager
    def record_timing(self, name: str) -> Iterator[None]:
        """Add the seconds spent in the block to ``timing/<scopes>/name``."""
        key = "timing/" + self.full_key(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._acc(key, "timing", ("sum",)).add(elapsed, 1.0, elapsed, elapsed)

    # ------------------------------------------------------------------ export
    def reset(self) -> None:
        with self._lock:
            self._accs.clear()
            self._masks.clear()

    def export(self, reset: bool = True, local: bool = False) -> dict[str, float]:
        """Reduce everything recorded since the last reset into ``{key: value}``.

        With a process group (and ``local=False``) this is a collective: every rank must call it,
        and every rank gets the same dict.
        """
        with self._lock:
            accs = dict(self._accs)
            if reset:
                self.reset()
        if not local and dist_utils.is_distributed():
            accs = _reduce_across_ranks(accs)
        out: dict[str, float] = {}
        for key, acc in sorted(accs.items()):  # denominators sum, timings sum (max over ranks), gauges max
            if acc.count == 0 and acc.kind != "denominator":  # a denominator of nothing still counts 0
                continue
            values = {"avg": acc.total / max(acc.count, 1.0), "sum": acc.total, "min": acc.low, "max": acc.high}
            if len(acc.reduces) == 1:
                out[key] = values[acc.reduces[0]]
            else:
                out.update({f"{key}/{r}": values[r] for r in acc.reduces})
        return out


def _reduce_across_ranks(accs: dict[str, _Acc]) -> dict[str, _Acc]:
    """Every rank's partial reductions merged (one all-gather), in rank order, so every rank gets the
    same result: totals and counts summed, lows min'd, highs max'd; a timing total is the slowest
    rank's (its wall time). A key recorded on only some ranks merges what those ranks have."""
    out: dict[str, _Acc] = {}
    for r, theirs in enumerate(dist_utils.all_gather_object(accs)):
        for k, acc in typing.cast(dict[str, _Acc], theirs).items():
            mine = out.setdefault(k, _Acc(acc.kind, acc.reduces))
            if (mine.kind, mine.reduces) != (acc.kind, acc.reduces):
                raise ValueError(
                    f"stats key {k!r} is recorded as {(mine.kind, mine.reduces)} on one rank "
                    f"and {(acc.kind, acc.reduces)} on rank {r}"
                )
            if acc.kind == "timing":
                mine.total, mine.count = max(mine.total, acc.total), mine.count + acc.count
            else:
                mine.add(acc.total, acc.count, acc.low, acc.high)
    return out


DEFAULT_TRACKER = StatsTracker()
"""The process-wide tracker behind the module-level functions below."""

scope = DEFAULT_TRACKER.scope
record_timing = DEFAULT_TRACKER.record_timing
denominator = DEFAULT_TRACKER.denominator
stat = DEFAULT_TRACKER.stat
scalar = DEFAULT_TRACKER.scalar
gauge = DEFAULT_TRACKER.gauge
export = DEFAULT_TRACKER.export
reset = DEFAULT_TRACKER.reset
full_key = DEFAULT_TRACKER.full_key
