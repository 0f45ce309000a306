"""NaN / inf in the loss or the rewards, end to end through the Trainer.

A non-finite loss skips that optimizer step (weights untouched), is reported in the step's
metrics and a warning, and training goes on; ``train.max_nan_skips`` in a row stop the run
with a message naming the setting. A non-finite reward fails its episode; a reward fn that
only returns NaN stops the run with a message naming it.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from audit import FAST, check_steps, metrics_rows
from faults import nan_reward
from safetensors.torch import load_file

from relayrl.api.config import RunConfig, load_config
from relayrl.train.algorithms import ppo_loss, register_loss
from relayrl.train.engine import NonFiniteError
from relayrl.trainer import Trainer, train

POISON: dict[int, float] = {}  # loss call number (1-based) -> value added to the loss
CALLS = [0]


@register_loss("ppo_poisoned")
def ppo_poisoned(**kw):
    """PPO, except that the calls listed in POISON return NaN or inf."""
    CALLS[0] += 1
    loss, stats = ppo_loss(**kw)
    return loss + POISON.get(CALLS[0], 0.0), stats


def _cfg(tmp_path, *extra: str) -> RunConfig:
    return load_config(
        RunConfig,
        None,
        [f"run_dir={tmp_path / 'run'}", *FAST, "actor.loss=ppo_poisoned", "rollout.max_staleness=0", *extra],
    )


def _actor(run_dir: str, step: int) -> dict[str, torch.Tensor]:
    return load_file(f"{run_dir}/checkpoints/step_{step:06d}/actor/model.safetensors")


def test_nonfinite_loss_skips_the_step_reports_it_and_training_continues(tmp_path, caplog):
    CALLS[0] = 0
    POISON.clear()
    POISON.update({3: math.nan, 5: math.inf, 6: math.nan})  # one micro-batch per step: call k is step k
    cfg = _cfg(tmp_path, "total_steps=8", "checkpoint.every_n_steps=1", "checkpoint.keep_last=10")
    logging.getLogger("relayrl").addHandler(caplog.handler)
    try:
        train(cfg)
    finally:
        logging.getLogger("relayrl").removeHandler(caplog.handler)
    rows = metrics_rows(cfg.run_dir)
    check_steps(rows, 8, eta=0, batch_size=2)
    assert [r["actor/n_mbs"] for r in rows if not r["actor/skipped_steps"]] == [1.0] * 5 and CALLS[0] == 8
    assert [r["actor/skipped_steps"] for r in rows] == [0, 0, 1, 0, 1, 1, 0, 0]
    assert all(math.isfinite(r["actor/loss"]) for r in rows if "actor/loss" in r)
    for step in range(2, 9):
        before, after = _actor(cfg.run_dir, step - 1), _actor(cfg.run_dir, step)
        same = all(torch.equal(before[k], after[k]) for k in after)
        assert same == (step in POISON), f"step {step}: weights {'un' if same else ''}changed"
    warned = [r.getMessage() for r in caplog.records if "skipped for a non-finite loss" in r.getMessage()]
    assert len(warned) == 3 and "step 5:" in warned[1] and "inf" in warned[1]


def test_repeated_nonfinite_losses_stop_the_run_with_a_clear_message(tmp_path):
    CALLS[0] = 0
    POISON.clear()
    POISON.update({k: math.nan for k in range(3, 100)})
    with pytest.raises(
        NonFiniteError,
        match=r"^training stopped in step 6: 4 consecutive steps had a non-finite "
        r"loss \(nan\).*train.max_nan_skips=3$",
    ):
        train(_cfg(tmp_path, "total_steps=20"))
    assert [r["actor/skipped_steps"] for r in metrics_rows(tmp_path / "run")] == [0, 0, 1, 1, 1]


def test_nan_rewards_fail_episodes_and_stop_the_run_with_a_clear_message(tmp_path):
    cfg = load_config(
        RunConfig, None, [f"run_dir={tmp_path / 'run'}", *FAST, "total_steps=4", "rollout.failure_window=8"]
    )
    trainer = Trainer(cfg, reward_fn=nan_reward)
    try:
        with pytest.raises(
            RuntimeError,
            match=r"rollout stopped: 8 of the last 8 episodes failed.*reward fn "
            r"'nan_reward' returned nan for row 'arithmetic/train/\d+'",
        ):
            trainer.fit()
        assert trainer.step == 0  # nothing was trained on a NaN reward
    finally:
        trainer.close()
