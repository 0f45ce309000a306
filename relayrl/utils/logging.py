"""Metric sinks (``MetricLogger``) and the text logger (``get_logger``: ``relayrl.*`` loggers, one format)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType, TracebackType

from relayrl.api.config import LoggingConfig

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DATEFMT = "%H:%M:%S"


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (a redirection or a test's
    capture made after the first ``get_logger`` call is honoured; a closed one is never kept)."""

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def get_logger(name: str = "relayrl") -> logging.Logger:
    """A logger named ``relayrl.<name>`` (or ``name`` if it already starts with ``relayrl``).

    The first call installs one stderr handler on the ``relayrl`` logger with the format
    ``12:03:04 INFO relayrl.rollout: message``; the level comes from ``RELAYRL_LOG_LEVEL``
    (default INFO). Records do not propagate to the root logger, so nothing prints twice.
    """
    root = logging.getLogger("relayrl")
    if not any(isinstance(h, StderrHandler) for h in root.handlers):
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
        root.addHandler(handler)
        root.setLevel(os.environ.get("RELAYRL_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return logging.getLogger(name if name == "relayrl" or name.startswith("relayrl.") else f"relayrl.{name}")


def _import_wandb() -> ModuleType:
    try:
        import wandb
    except ImportError:
        raise ImportError(
            "logging.wandb=true but the `wandb` package is not installed; run `pip install relayrl[wandb]` "
            "(or set logging.wandb=false)"
        ) from None
    return wandb


def _number(value: object) -> float | None:
    """``value`` as a float if it is a real number (incl. numpy / one-element tensors), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "item") and math.prod(shape) == 1:  # tensor / ndarray
        return _number(value.item())
    return None


class MetricLogger:
    """Write metrics to ``run_dir/metrics.jsonl`` (always: one JSON object per ``log``, with ``step`` and
    wall-clock ``time``), ``run_dir/tensorboard`` and W&B (offline mode needs no network) when enabled.
    In a distributed run only rank 0 should create one.

    ``log({"actor/loss": 0.3, ...}, step=7)``; ``close()`` (or use as a context manager)
    flushes the sinks. Non-numeric values are kept in JSONL and skipped by the other sinks.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_mode: str = "offline",
        project: str = "relayrl",
        config: object | None = None,
        run_name: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self._jsonl = self.jsonl_path.open("a", encoding="utf-8")
        self._tb = None
        self._wandb_run = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if wandb and wandb_mode != "disabled":
            if wandb_mode not in ("online", "offline"):
                raise ValueError(f"wandb_mode must be 'online', 'offline' or 'disabled', got {wandb_mode!r}")
            wb = _import_wandb()
            from relayrl.api.fields import public_dict

            cfg = public_dict(config) if dataclasses.is_dataclass(config) and not isinstance(config, type) else config
            self._wandb_run = wb.init(
                project=project, name=run_name or self.run_dir.name, dir=str(self.run_dir), mode=wandb_mode, config=cfg
            )

    @classmethod
    def from_config(
        cls, cfg: LoggingConfig, run_dir: str | os.PathLike[str], config: object | None = None
    ) -> MetricLogger:
        """Build from the ``logging`` section of a RunConfig (``config`` is stored in W&B)."""
        return cls(run_dir, cfg.tensorboard, cfg.wandb, cfg.wandb_mode, cfg.wandb_project, config)

    def log(self, metrics: Mapping[str, object], step: int) -> None:
        """Record one step's metrics in every sink (non-numbers, e.g. the row ids, go to metrics.jsonl only)."""
        row: dict[str, object] = {"step": int(step), "time": round(time.time(), 3)}
        scalars: dict[str, float] = {}
        for key, value in metrics.items():
            number = _number(value)
            row[key] = value if number is None else number
            if number is not None and math.isfinite(number):
                scalars[key] = number
        self._jsonl.write(json.dumps(row, default=str) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=int(step))
        if self._wandb_run is not None:
            self._wandb_run.log(scalars, step=int(step))

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if not self._jsonl.closed:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# What a finished run is summed up by, in this order, when it logged them.
SUMMARY = (
    ("version", "step", "{:.0f}"),
    ("rollout/reward", "reward", "{:.3f}"),
    ("eval/accuracy", "held-out accuracy", "{:.3f}"),
    ("eval/accuracy_mean", "sampled", "{:.3f}"),
    ("actor/entropy", "entropy", "{:.2f}"),
    ("perf/samples_per_s", "samples/s", "{:.1f}"),
)


def summary(metrics: Mapping[str, object]) -> str:
    """One readable line for the end of a run (its last step's metrics), instead of ~50 keys."""
    logged = ((label, fmt, _number(metrics.get(key))) for key, label, fmt in SUMMARY)
    return " | ".join(f"{label} {fmt.format(v)}" for label, fmt, v in logged if v is not None) or "no metrics logged"
