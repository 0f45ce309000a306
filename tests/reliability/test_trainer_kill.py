"""SIGKILL the trainer process at a random point (several seeds), then ``relayrl train --recover``.

The run kills itself (``signal_hooks``): a seed picks the hook and the step, so the kill lands in
rollout, inside the update, in the weight push or in a checkpoint write (as it begins, or with its
files written and not yet committed), whatever the machine's load. Sync mode must end bitwise equal
to an uninterrupted run (same weights, same prompts in the same steps); async mode must lose no
prompt, train none twice and never exceed eta.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
import torch
from audit import FAST, audit_prompts, check_steps, latest_state, metrics_rows, start_cli, train_rows_of
from safetensors.torch import load_file

T = 8
COMMON = [*FAST, f"total_steps={T}", "checkpoint.every_n_steps=1", "checkpoint.keep_last=3"]
SYNC = [*COMMON, "rollout.max_staleness=0", "actor.loss=signal_hooks:ppo_loss"]
# Long completions: episodes are still generating when checkpoints are written.
ASYNC = [
    *COMMON,
    "rollout.max_staleness=1",
    "actor.loss=signal_hooks:decoupled_ppo_loss",
    "gconfig.max_new_tokens=24",
    "gconfig.min_new_tokens=24",
]
# Where the kill lands: rollout (an episode finished, others still generating), the update (its loss), the weight
# push, a checkpoint write as it begins (save) or with its files written, its state and rename still to come (commit).
HOOKS = ("episode", "loss", "push", "save", "commit")


def _log(run_dir: Path) -> Path:
    return run_dir.parent / f"{run_dir.name}.log"


def _train(run_dir: Path, args: list[str]) -> None:
    proc = start_cli(["train", f"run_dir={run_dir}", *args], _log(run_dir))
    proc.join(timeout=400)
    if proc.is_alive():  # never leave a trainer behind
        proc.kill()
        proc.join()
    assert proc.exitcode == 0, _log(run_dir).read_text()[-3000:]


def _point(seed: int, first: int, pushes_per_step: int = 1) -> tuple[str, int, int]:
    """The seed's hook (each seed the next of HOOKS, so a few seeds cover them all) at a random step s in
    ``first``..T: (hook, call, s). Episode 4(s-1)+1..4s (batch 2 x group 2), loss s (one optimizer step a step),
    push s + 1 (the set-up's is the first; with n servers each counts one), save and commit s. Each leaves step
    s - 1's checkpoint the latest; in an asynchronous run episode n may be another step's (generation runs ahead)."""
    rng = random.Random(seed)
    hook, step = HOOKS[seed % len(HOOKS)], rng.randint(first, T)
    call = {
        "episode": 4 * (step - 1) + rng.randint(1, 4),
        "loss": step,
        "push": pushes_per_step * step + rng.randint(1, pushes_per_step),
        "save": step,
        "commit": step,
    }[hook]
    return hook, call, step


def _train_and_kill(run_dir: Path, args: list[str], hook: str, call: int) -> None:
    """Start a run that SIGKILLs itself at the ``call``-th run of ``hook``."""
    env = {"RELAYRL_SIGNAL": "SIGKILL", "RELAYRL_SIGNAL_IN": hook, "RELAYRL_SIGNAL_AT": str(call)}
    proc = start_cli(["train", f"run_dir={run_dir}", *args], _log(run_dir), env=env)
    proc.join(timeout=300)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert proc.exitcode == -signal.SIGKILL, f"{hook} {call}: not killed there:\n{_log(run_dir).read_text()[-3000:]}"
    assert not (run_dir / "checkpoints" / f"step_{T:06d}").exists()


def _latest_step(run_dir: Path) -> int:
    """The step of the newest complete checkpoint (0: none)."""
    return latest_state(run_dir)["step"] if list((run_dir / "checkpoints").glob("step_*/trainer_state.json")) else 0


def _check_resumed(run_dir: Path, step: int) -> None:
    """The recovered run resumed from step ``step``'s checkpoint."""
    log = _log(run_dir).read_text()
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step:06d}'} at step {step}" in log, log[-2000:]


def _actor(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{T:06d}" / "actor" / "model.safetensors"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight") / "run"
    _train(run, SYNC)
    return run


@pytest.mark.parametrize("seed", [0, 2, 4])  # episode, push, commit
def test_sync_run_killed_and_recovered_is_bitwise_equal(tmp_path, straight, seed):
    run = tmp_path / "run"
    hook, call, step = _point(seed, first=2)
    _train_and_kill(run, SYNC, hook, call)
    assert _latest_step(run) == step - 1, f"killed in {hook} {call}"  # the step the kill landed in is not saved
    if hook == "commit":  # its files were written under a temporary name
        assert (run / "checkpoints" / f".tmp_step_{step:06d}").is_dir()
    _train(run, [*SYNC, "--recover"])
    _check_resumed(run, step - 1)
    a, b = _actor(straight), _actor(run)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{hook} {call}: weights differ after recover: {k}"
    ours, theirs = metrics_rows(run), metrics_rows(straight)
    assert [r["prompt_ids"] for r in ours] == [r["prompt_ids"] for r in theirs]  # same prompts, same steps
    assert [r["rollout/reward"] for r in ours] == [r["rollout/reward"] for r in theirs]
    check_steps(ours, T, eta=0, batch_size=2)


def _kill_and_recover(run: Path, args: list[str], seed: int, pushes_per_step: int = 1) -> None:
    """SIGKILL the run while prompts are in flight, resume it with ``--recover``: none lost, none trained twice."""
    # from step 4: episode 13 on needs weights v2 (eta=1 starts two batches a version), so step 1's checkpoint is complete
    hook, call, step = _point(seed, first=4, pushes_per_step=pushes_per_step)
    _train_and_kill(run, args, hook, call)
    saved = _latest_step(run)
    if hook == "episode":
        assert 1 <= saved < T, f"killed in {hook} {call}: step {saved} saved"
    else:
        assert saved == step - 1, f"killed in {hook} {call}: step {saved} saved"
    assert latest_state(run)["executor"]["pending"]  # the checkpoint it resumes from holds prompts in flight
    _train(run, [*args, "--recover"])
    _check_resumed(run, saved)
    rows = metrics_rows(run)
    check_steps(rows, T, eta=1, batch_size=2)
    state = latest_state(run)
    assert state["step"] == T
    trained, pending, dropped = audit_prompts(train_rows_of(run), rows, state, batch_size=2, seed=1)
    assert sum(trained.values()) == 2 * T
    assert not dropped, f"prompts lost across the kill: {dict(dropped)}"


@pytest.mark.parametrize("seed", [1, 3, 5])  # loss, save, episode
def test_async_run_killed_and_recovered_loses_no_prompt(tmp_path, seed):
    _kill_and_recover(tmp_path / "run", ASYNC, seed)


# Generation on two `relayrl serve` servers the run launches (they die with the killed trainer; the
# resumed run launches its own).
REMOTE = [*ASYNC, "inference.backend=remote", "inference.n_servers=2", "inference.health_interval=0.2"]


@pytest.mark.timeout(240)
def test_async_run_over_servers_killed_and_recovered_loses_no_prompt(tmp_path):
    _kill_and_recover(tmp_path / "run", REMOTE, seed=7, pushes_per_step=2)  # push: one server has the weights


# Episodes of an agent written against the OpenAI API (relayrl.agents.OpenAIAgentWorkflow).
AGENT = [*ASYNC, "workflow=tests.reliability.agent_workflow:make"]


@pytest.mark.timeout(240)
def test_async_agent_run_killed_and_recovered_loses_no_prompt(tmp_path):
    _kill_and_recover(tmp_path / "run", AGENT, seed=10)  # episode: the agent's other chats in flight
