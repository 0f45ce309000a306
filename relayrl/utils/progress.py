"""A live status line on a terminal; plain log lines when not on a TTY (CI, files).

Hand-written: tqdm (installed with transformers) writes carriage-return frames to files too and skips
updates inside its refresh interval, and rich is not a dependency.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

# Metric keys shown in the status line, with their short labels.
SHOWN = (
    ("rollout/reward", "reward"),
    ("eval/accuracy", "eval"),
    ("perf/samples_per_s", "samples/s"),
    ("rollout/staleness_max", "stale"),
)


class Progress:
    """``update(step, metrics)`` after each step; ``close()`` at the end."""

    def __init__(self, total: int, start: int = 0, mode: str = "auto", stream: TextIO | None = None) -> None:
        self.total, self.start = total, start
        self.stream = stream or sys.stderr
        self.live = mode == "bar" or (mode == "auto" and self.stream.isatty())
        self.off = mode == "off"  # e.g. the non-driver ranks of a torchrun
        self.t0 = time.monotonic()
        self.last: dict[str, float] = {}

    def line(self, step: int, metrics: dict[str, float]) -> str:
        self.last.update({k: v for k, v in metrics.items() if k in dict(SHOWN)})
        done = step - self.start
        elapsed = time.monotonic() - self.t0
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        parts = [f"step {step}/{self.total}"]
        parts += [f"{label} {self.last[key]:.3g}" for key, label in SHOWN if key in self.last]
        parts.append(f"eta {_fmt_time(eta)}")
        return " | ".join(parts)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if self.off:
            return
        text = self.line(step, metrics)
        if self.live:
            width = 30
            filled = int(width * step / max(self.total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\033[K")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()


def _fmt_time(seconds: float) -> str:
    if seconds != seconds:  # NaN
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
