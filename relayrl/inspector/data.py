"""What the inspector page reads: JSON when served, small JavaScript files when exported.

The page loads the manifest (each run's steps and metrics curves) at once and one step's saved
rollouts when that step is opened, so opening a run reads its index and metrics only, whatever its
size. The server answers ``data/manifest.json`` / ``data/r{R}/step_{N}.json`` (JSON: a foreign page
can include a script but cannot read JSON cross-origin); the export writes ``.js`` files calling
``relayrlData(key, value)`` instead, since browsers refuse ``fetch`` from ``file://``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from relayrl.utils.rollouts import read_index, run_names, step_file

CALLBACK = "relayrlData"


class RunDirError(ValueError):
    """A path that is not a run directory the inspector can show."""


def check_run_dir(path: Path) -> Path:
    """``path`` if it holds ``metrics.jsonl`` or saved rollouts, else a one-line error (naming the run
    directories inside it, as ``runs/demo`` holds ``grpo`` and ``sft``)."""
    if (path / "metrics.jsonl").exists() or (path / "rollouts").is_dir():
        return path
    if not path.is_dir():
        raise RunDirError(f"{path}: no such directory")
    inner = sorted(str(p.parent) for p in path.glob("*/metrics.jsonl"))
    hint = f" (run directories inside it: {', '.join(inner)})" if inner else ""
    raise RunDirError(f"{path} has neither metrics.jsonl nor rollouts/: not a run directory{hint}")


def metrics_rows(run_dir: Path) -> list[dict[str, float]]:
    """metrics.jsonl's numeric fields per row (the row ids a step trained on stay out)."""
    path = run_dir / "metrics.jsonl"
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                raw = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            row = {
                k: float(v)
                for k, v in raw.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            }
            if "step" in row:
                rows.append(row)
    return rows


def script(key: str, payload_json: str) -> str:
    return f"{CALLBACK}({json.dumps(key)},{payload_json});\n"


def manifest_json(run_dirs: list[Path]) -> str:
    """Every run's name, saved steps (index entries) and metrics rows."""
    runs = [
        {"name": name, "dir": str(d), "steps": read_index(d), "metrics": metrics_rows(d)}
        for name, d in zip(run_names(run_dirs), run_dirs, strict=True)
    ]
    return json.dumps({"runs": runs}, separators=(",", ":"))


def manifest_script(run_dirs: list[Path]) -> str:
    return script("manifest", manifest_json(run_dirs))


def step_json(run_dirs: list[Path], run: int, step: int) -> str | None:
    """One step's rollouts as a JSON array (the saved lines as they are, not re-parsed); None if not saved."""
    if not 0 <= run < len(run_dirs):
        return None
    path = step_file(run_dirs[run], step)
    if not path.exists():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return "[" + ",".join(lines) + "]"


def step_script(run_dirs: list[Path], run: int, step: int) -> str | None:
    body = step_json(run_dirs, run, step)
    return None if body is None else script(f"r{run}/{step}", body)


def step_path(run: int, step: int) -> str:
    """Where the page finds a step's script, relative to the page."""
    return f"data/r{run}/step_{step:06d}.js"
