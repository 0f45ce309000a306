"""Shared fixtures: one torch thread per process, the offline tokenizer and tiny models."""

from __future__ import annotations

import os
import signal

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
_TRACKED = pytest.StashKey[dict[str, str] | None]()


@pytest.fixture(scope="session")
def tokenizer():
    from relayrl.data.models import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model():
    """The ~5M-parameter preset, seeded; tests that train on it must deep-copy it first."""
    from relayrl.data.models import build_tiny_model

    return build_tiny_model("tiny", seed=0).eval()


# The files that take the most worker time, longest first (docs/testing.md; re-order when a file's time
# changes a lot). scripts/test.sh runs xdist with --no-loadscope-reorder, so files are handed out in
# collection order: the long ones start first and short ones fill the end, instead of one worker
# finishing its last long file alone while the other idles.
LONGEST_FIRST = [
    "tests/test_ray_launcher.py",
    "tests/test_recipes.py",
    "tests/reliability/test_trainer_interrupt.py",
    "tests/test_trainer.py",
    "tests/test_peers.py",
    "tests/test_openai_agent_recipe.py",
    "tests/test_remote.py",
    "tests/test_real_model.py",
    "tests/test_peer_launch.py",
    "tests/test_cli_first_day.py",
    "tests/test_checkpoints_standalone.py",
    "tests/reliability/test_trainer_kill.py",
    "tests/test_selftest.py",
    "tests/test_moe.py",
    "tests/real_peers/test_sglang.py",
    "tests/real_peers/test_vllm.py",
    "tests/real_peers/test_smollm2_peers.py",
]


# Files that run before the real-peer suite starts beside the main suite (scripts/test.sh): Ray's one-CPU
# simulated nodes start worker processes ~4x slower once more processes than cores compete (its run tests:
# 245 s beside one other worker, 870 s beside two), while every other file slows by ~1.3x.
BEFORE_PEER_SUITE = ["tests/test_ray_launcher.py"]


@pytest.hookimpl(trylast=True)  # after the item's own teardown: the file's module fixtures (Ray's cluster) are down
def pytest_runtest_teardown(item, nextitem):
    """The last test of a ``BEFORE_PEER_SUITE`` file done: touch ``$RELAYRL_PEER_SUITE_GATE`` (set by
    scripts/test.sh, which starts the real-peer suite when it exists or when the main suite ends)."""
    gate = os.environ.get("RELAYRL_PEER_SUITE_GATE")
    path = item.nodeid.split("::", 1)[0]
    if gate and path in BEFORE_PEER_SUITE and (nextitem is None or nextitem.nodeid.split("::", 1)[0] != path):
        open(gate, "a").close()


def pytest_collection_modifyitems(config, items):
    """The longest files first (``LONGEST_FIRST``); tests marked ``gpu`` are skipped when torch sees no
    CUDA device."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest in order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _tracked_changes() -> dict[str, str] | None:
    """Tracked files that differ from HEAD, each with its content hash (None outside a git checkout)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "-z"],
            cwd=root, capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    paths = [entry[3:] for entry in out.split("\0") if len(entry) > 3]
    hashes = {}
    for p in paths:
        f = root / p
        hashes[p] = (
            subprocess.run(["git", "hash-object", str(f)], capture_output=True, text=True).stdout.strip()
            if f.is_file()
            else "-"
        )
    return hashes


def pytest_sessionstart(session):
    session.config.stash[_TRACKED] = _tracked_changes()
    _sigint_as_in_a_terminal()


def _sigint_as_in_a_terminal() -> None:
    """Ctrl-C as a process started from a terminal has it, whoever started pytest: a shell without job
    control starts background commands (``cmd &``, CI runners) with SIGINT ignored, Python then installs
    no KeyboardInterrupt handler, and relayrl, rightly, leaves an ignored SIGINT ignored, so the tests
    of what Ctrl-C does would see nothing happen. Children started by tests get the default action."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_sessionfinish(session, exitstatus):
    """Tests never modify tracked files: a run that did fails, naming them."""
    before, after = session.config.stash.get(_TRACKED, None), _tracked_changes()
    if before is None or after is None or before == after:
        return
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    session.config.get_terminal_writer().line(
        f"tests modified tracked files (write under tmp_path instead): {', '.join(changed)}", red=True
    )
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
