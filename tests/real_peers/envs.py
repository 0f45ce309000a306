"""The OpenEnv and verifiers venvs that ``scripts/envs.sh`` builds (pins in ``scripts/envs.env``) for the
environment-adapter tests. Under ``CI=true`` a missing env fails the test; elsewhere it skips, naming the script."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def env_pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "scripts" / "envs.env").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def built_env(name: str) -> Path:
    """The venv ``scripts/envs.sh`` builds for ``name`` (``openenv-core-0.3.0``), else fail (CI) or skip."""
    root = Path(os.environ.get("RELAYRL_ENVS_DIR") or Path.home() / ".cache" / "relayrl-envs")
    env = root / name
    if not (env / ".relayrl-env").is_file():
        why = f"{name} not built in {env}: run `bash scripts/envs.sh` (about 2 minutes, once)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    return env


def env_environ(env: Path, **extra: str) -> dict[str, str]:
    """The environment of a process run from venv ``env``: its bin/ first on PATH, no PYTHONPATH of ours."""
    out = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out["PATH"] = f"{env / 'bin'}:{out.get('PATH', '')}"
    out.update(extra)
    return out
