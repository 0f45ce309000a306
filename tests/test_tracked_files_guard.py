"""The suite's guard (tests/conftest.py): a test run that modifies a tracked file fails, naming it; and the
file order conftest gives the workers names real files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def _repo(tmp_path: Path, test_body: str) -> Path:
    """A git checkout holding one tracked file, this suite's conftest.py and one test."""
    (tmp_path / "tests").mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "tests" / "conftest.py")
    (tmp_path / "results.json").write_text("{}\n")
    (tmp_path / "tests" / "test_one.py").write_text(test_body)
    for cmd in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", *cmd], cwd=tmp_path, check=True)
    return tmp_path


def _pytest(repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=repo, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_run_that_rewrites_a_tracked_file_fails(tmp_path):
    body = "from pathlib import Path\n\ndef test_it():\n    Path(__file__).parent.parent.joinpath('results.json').write_text('{\"x\": 1}')\n"
    p = _pytest(_repo(tmp_path, body))
    assert p.returncode == 1, p.stdout[-2000:]
    assert "tests modified tracked files" in p.stdout and "results.json" in p.stdout


def test_a_clean_run_passes(tmp_path):
    p = _pytest(_repo(tmp_path, "def test_it():\n    pass\n"))
    assert p.returncode == 0, p.stdout[-2000:]


def test_the_longest_first_order_names_files_that_exist():
    """conftest's LONGEST_FIRST hands the longest files to the workers first; a renamed file would silently
    fall back to the end of the queue."""
    from tests.conftest import LONGEST_FIRST

    root = Path(__file__).resolve().parents[1]
    assert [p for p in LONGEST_FIRST if not (root / p).is_file()] == []
