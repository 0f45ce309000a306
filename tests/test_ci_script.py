"""scripts/test.sh (CI's command) run with every tool it calls replaced by a stub that logs its call:
a lint failure fails it, both suites still run and report, and the real-peer suite waits for its gate."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(0o755)


@pytest.mark.parametrize("failing", ["", "format", "check", "mypy", "pytest"])
def test_any_failing_step_fails_the_ci_script_and_the_tests_still_run(tmp_path, failing):
    """Before: ``ruff format --check && ruff check && mypy`` under ``set -e`` let a failing format or
    check pass CI (a failure inside an ``&&`` list does not stop the script), and a failing mypy stopped
    it before any test ran."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    for name in ("setup.sh", "peers.sh", "envs.sh"):
        stub(tmp_path / "scripts" / name, "exit 0")
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "activate").write_text(f'export PATH="{bin_}:$PATH"\n')
    log = tmp_path / "calls.log"
    fails = {"format": "ruff", "check": "ruff", "mypy": "mypy", "pytest": "python"}.get(failing)
    for tool in ("ruff", "mypy", "python", "chromium"):
        word = {"ruff": failing if failing in ("format", "check") else "@", "python": "pytest"}.get(tool, "")
        fail = f'case " $* " in *" {word} "*) exit 1;; esac' if tool == fails else ""
        stub(bin_ / tool, f'echo "{tool} $*" >> "{log}"\n{fail}\nexit 0')
    done = subprocess.run(["bash", "scripts/test.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": f"{bin_}:/usr/bin:/bin"})  # fmt: skip
    calls = log.read_text()
    assert (done.returncode != 0) == bool(failing), done.stdout + done.stderr
    assert calls.count("python -m pytest") == 2, calls  # the main suite and the real-peer suite
    # no Ray file ran to open the gate (tests/conftest.py BEFORE_PEER_SUITE): the real-peer suite waited for the main suite
    assert calls.index("-m not real_peers") < calls.index("-m real_peers"), calls
    assert "ruff format --check" in calls and "ruff check" in calls and "mypy" in calls, calls
