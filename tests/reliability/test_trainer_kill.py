"""SIGKILL the trainer process at a random point (several seeds), then ``relayrl train --recover``.

Sync mode must end bitwise equal to an uninterrupted run (same weights, same prompts in the
same steps); async mode must lose no prompt, train none twice and never exceed eta.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from audit import FAST, audit_prompts, check_steps, latest_state, metrics_rows, start_cli, train_rows_of
from safetensors.torch import load_file

T = 8
COMMON = [*FAST, f"total_steps={T}", "checkpoint.every_n_steps=1", "checkpoint.keep_last=3"]
SYNC = [*COMMON, "rollout.max_staleness=0"]
# Long completions: episodes are still generating when checkpoints are written.
ASYNC = [
    *COMMON,
    "rollout.max_staleness=1",
    "actor.loss=decoupled_ppo",
    "gconfig.max_new_tokens=24",
    "gconfig.min_new_tokens=24",
]


def _log(run_dir: Path) -> Path:
    return run_dir.parent / f"{run_dir.name}.log"


def _train(run_dir: Path, args: list[str]) -> None:
    proc = start_cli(["train", f"run_dir={run_dir}", *args], _log(run_dir))
    proc.join(timeout=400)
    if proc.is_alive():  # never leave a trainer behind
        proc.kill()
        proc.join()
    assert proc.exitcode == 0, _log(run_dir).read_text()[-3000:]


def _done_steps(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:  # a line being written
            pass
    return max(steps)


def _train_and_kill(run_dir: Path, args: list[str], seed: int) -> int:
    """Start a run, SIGKILL it a random moment after a random step; returns that step."""
    rng = random.Random(seed)
    after, fraction = rng.randint(1, T - 3), rng.uniform(0.0, 1.0)
    proc = start_cli(["train", f"run_dir={run_dir}", *args], _log(run_dir))
    deadline, seen = time.monotonic() + 300, {0: time.monotonic()}
    while _done_steps(run_dir) < after and proc.is_alive() and time.monotonic() < deadline:
        seen.setdefault(_done_steps(run_dir), time.monotonic())
        time.sleep(0.02)
    if _done_steps(run_dir) < after:
        proc.kill()
        pytest.fail(f"trainer did not reach step {after}:\n{_log(run_dir).read_text()[-3000:]}")
    # anywhere in the next step (rollout, update, metrics, checkpoint write): a fraction of the last step's
    # own duration, cut short when that next step is logged. Steps vary with the machine's load (a slow step
    # under load, then fast ones), so the time alone could outlast the run; after <= T - 3 keeps two steps
    # beyond the next one, so the run is still going whatever the machine does.
    last = max(seen)
    until = time.monotonic() + (fraction * (time.monotonic() - seen[last]) if last >= 1 else fraction * 0.3)
    while time.monotonic() < until and _done_steps(run_dir) <= after:
        time.sleep(0.01)
    assert proc.is_alive(), "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    assert not (run_dir / "checkpoints" / f"step_{T:06d}").exists()
    return after


def _actor(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{T:06d}" / "actor" / "model.safetensors"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight") / "run"
    _train(run, SYNC)
    return run


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sync_run_killed_and_recovered_is_bitwise_equal(tmp_path, straight, seed):
    run = tmp_path / "run"
    after = _train_and_kill(run, SYNC, seed)
    _train(run, [*SYNC, "--recover"])
    log = _log(run).read_text()
    if after > 1:  # a checkpoint of step >= after - 1 was complete when the process died
        assert "resumed from" in log, log[-2000:]
    a, b = _actor(straight), _actor(run)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"seed {seed}: weights differ after recover: {k}"
    ours, theirs = metrics_rows(run), metrics_rows(straight)
    assert [r["prompt_ids"] for r in ours] == [r["prompt_ids"] for r in theirs]  # same prompts, same steps
    assert [r["rollout/reward"] for r in ours] == [r["rollout/reward"] for r in theirs]
    check_steps(ours, T, eta=0, batch_size=2)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_async_run_killed_and_recovered_loses_no_prompt(tmp_path, seed):
    run = tmp_path / "run"
    _train_and_kill(run, ASYNC, seed)
    _train(run, [*ASYNC, "--recover"])
    rows = metrics_rows(run)
    check_steps(rows, T, eta=1, batch_size=2)
    state = latest_state(run)
    assert state["step"] == T
    trained, pending, dropped = audit_prompts(train_rows_of(run), rows, state, batch_size=2, seed=1)
    assert sum(trained.values()) == 2 * T
    assert not dropped, f"prompts lost across the kill: {dict(dropped)}"


def _kill_and_recover(run: Path, args: list[str], seed: int) -> None:
    """SIGKILL the run while prompts are in flight, resume it with ``--recover``: none lost, none trained twice."""
    _train_and_kill(run, args, seed)
    assert latest_state(run)["executor"]["pending"]  # the checkpoint it resumes from holds prompts in flight
    _train(run, [*args, "--recover"])
    assert "resumed from" in _log(run).read_text()
    rows = metrics_rows(run)
    check_steps(rows, T, eta=1, batch_size=2)
    trained, pending, dropped = audit_prompts(train_rows_of(run), rows, latest_state(run), batch_size=2, seed=1)
    assert sum(trained.values()) == 2 * T
    assert not dropped, f"prompts lost across the kill: {dict(dropped)}"


# Generation on two `relayrl serve` servers the run launches (they die with the killed trainer; the
# resumed run launches its own).
REMOTE = [*ASYNC, "inference.backend=remote", "inference.n_servers=2", "inference.health_interval=0.2"]


@pytest.mark.timeout(240)
def test_async_run_over_servers_killed_and_recovered_loses_no_prompt(tmp_path):
    _kill_and_recover(tmp_path / "run", REMOTE, seed=6)


# Episodes of an agent written against the OpenAI API (relayrl.agents.OpenAIAgentWorkflow).
AGENT = [*ASYNC, "workflow=tests.reliability.agent_workflow:make"]


@pytest.mark.timeout(240)
def test_async_agent_run_killed_and_recovered_loses_no_prompt(tmp_path):
    _kill_and_recover(tmp_path / "run", AGENT, seed=7)
