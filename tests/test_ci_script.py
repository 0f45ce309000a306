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


def test_uv_gets_the_indexes_find_links_and_constraints_pip_would_use(tmp_path):
    """scripts/venvs.sh installs with uv, which reads no pip configuration: every index, find-links and
    constraint that pip's files and PIP_* variables name must reach uv, once each, or the two installers
    see different packages (a machine whose wheels sit in a local find-links dir would resolve elsewhere)."""
    conf = tmp_path / "pip.conf"
    conf.write_text(
        "[global]\nindex-url = https://mirror.example/simple\n"
        "extra-index-url = file:///srv/a/simple\n    file:///srv/b/simple\n"
        "find-links = /srv/wheels\nconstraint = /srv/caps.txt\ntimeout = 60\n"
    )
    script = f"python={shutil.which('python3')}; . {ROOT / 'scripts' / 'venvs.sh'}; pip_settings_for_uv"
    env = {**os.environ, "PIP_CONFIG_FILE": str(conf), "PIP_FIND_LINKS": "/srv/wheels /srv/more"}
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, env=env, check=True)
    args = done.stdout.split("\n")[:-1]
    pairs = list(zip(args[::2], args[1::2], strict=True))
    for pair in [
        ("--index-url", "https://mirror.example/simple"),
        ("--extra-index-url", "file:///srv/a/simple"),
        ("--extra-index-url", "file:///srv/b/simple"),
        ("--find-links", "/srv/wheels"),
        ("--find-links", "/srv/more"),
        ("--constraint", "/srv/caps.txt"),
    ]:
        assert pair in pairs, (pair, pairs)
    assert len(pairs) == len(set(pairs)), pairs  # /srv/wheels is named twice, passed once
    assert not any(flag == "--timeout" or value == "60" for flag, value in pairs), pairs
