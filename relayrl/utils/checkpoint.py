"""Run checkpoints: atomic directories under ``RUN_DIR/checkpoints/step_NNNNNN``.

A checkpoint is complete only once its directory has been renamed into place, so a run
killed mid-save (even with SIGKILL) resumes from the previous complete one.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, cast

from relayrl.api.config import CheckpointConfig

STATE_FILE = "trainer_state.json"


class CheckpointManager:
    """Decides when to save, writes atomically, keeps the last N, finds the latest."""

    def __init__(self, run_dir: str | Path, config: CheckpointConfig) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.config = config
        self._last_save = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether a checkpoint should be written after ``step`` (1-based count of done steps)."""
        if self.config.every_n_steps and step % self.config.every_n_steps == 0:
            return True
        minutes = (time.monotonic() - self._last_save) / 60
        return bool(self.config.every_minutes) and minutes >= self.config.every_minutes

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for the checkpoint of ``step`` (engines write into it)."""
        tmp = self.root / f".tmp_step_{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, step: int, tmp: Path, state: dict[str, object]) -> Path:
        """Write ``state`` (JSON) to trainer_state.json, rename ``tmp`` into place, keep the last N."""
        final = self.root / f"step_{step:06d}"
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        self._last_save = time.monotonic()
        for old in self.complete()[: -self.config.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return sorted(p for p in self.root.glob("step_*") if (p / STATE_FILE).exists())

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    @staticmethod
    def load_state(path: Path) -> dict[str, Any]:
        """The checkpoint's JSON state (step, version, the driver's parts), as written by ``commit``."""
        return cast(dict[str, Any], json.loads((path / STATE_FILE).read_text()))
