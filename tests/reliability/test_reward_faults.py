"""Reward functions that raise, hang, kill their worker or score NaN.

Each such call fails its episode (counted as failed); the worker pool replaces hung and dead
workers and the run completes with full batches of healthy prompts only.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import Counter

import pytest
from audit import FAST, audit_prompts, check_steps, metrics_rows
from faults import DIE, HANG, NAN, RAISE, fault_of, faulty_reward

from relayrl.api.config import RunConfig, load_config
from relayrl.rewards.pool import RewardError, RewardPool, RewardWorkerDied
from relayrl.trainer import Trainer

KW = {"prompt": "", "completions": "12", "prompt_ids": [1], "completion_ids": [2], "answer": "12"}


def test_pool_survives_raising_hanging_and_dying_reward_fns():
    # 3 s: healthy calls, a replaced worker's first among them, return within it however loaded the machine
    with RewardPool(faulty_reward, n_workers=2, timeout=3.0) as pool:
        assert pool.call(id="t/0", **KW) == 1.0 and pool.call(id="t/1", **{**KW, "completions": "13"}) == 0.0
        with pytest.raises(RewardError, match=r"ValueError: injected reward failure for t/3 \(at .*faults.py"):
            pool.call(id="t/3", **KW)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="did not return within 3.0s"):
            pool.call(id="t/5", **KW)
        assert 3.0 <= time.monotonic() - t0 < 600  # waited its timeout, not the hung call's hour
        with pytest.raises(RewardWorkerDied, match=r"died \(exit code -9\)"):
            pool.call(id="t/7", **KW)
        assert math.isnan(pool.call(id="t/9", **KW))
        assert pool.n_alive == 2  # the hung and the dead worker were replaced
        assert dict(pool.stats) == {"calls": 6, "ok": 3, "errors": 1, "timeouts": 1, "worker_deaths": 1, "replaced": 2}
        with pytest.raises(AttributeError, match="pickle"):  # a row column that cannot travel to a worker
            pool.call(id="t/0", **KW, column=lambda: 0)
        assert pool.n_alive == 2 and pool.call(id="t/0", **KW) == 1.0  # ... costs no worker

        # a hanging call holds one worker; the other keeps serving meanwhile: the three calls return
        # while the hanging one still waits (its 8 s outlasts any stall a loaded machine makes)
        pool.timeout = 8.0
        timeouts: list[TimeoutError] = []

        def hang() -> None:
            try:
                pool.call(id="t/15", **KW)
            except TimeoutError as e:
                timeouts.append(e)

        hung = threading.Thread(target=hang)
        hung.start()
        while pool.stats["calls"] < 9:  # the hanging call has its worker
            time.sleep(0.01)
        assert [pool.call(id=f"t/{i}", **KW) for i in (20, 21, 22)] == [1.0, 1.0, 1.0]
        assert hung.is_alive() and not timeouts  # did not wait for the hung worker
        hung.join()
        assert len(timeouts) == 1

        async def many():  # the async path the workflows use, 40 calls over 2 workers
            return await asyncio.gather(*(pool.acall(id=f"t/{i}", **KW) for i in range(40) if i % 10 in (0, 1, 2)))

        assert asyncio.run(many()) == [1.0] * 12
        assert pool.n_alive == 2
    assert pool.n_alive == 0  # closed: no worker left behind
    with pytest.raises(RuntimeError, match="closed"):
        pool.call(id="t/0", **KW)


def test_training_with_faulty_rewards_completes_on_healthy_prompts(tmp_path):
    steps, faults = 6, (RAISE, HANG, DIE, NAN)
    cfg = load_config(
        RunConfig,
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            *FAST,
            f"total_steps={steps}",
            "rollout.max_staleness=0",
            "rollout.reward_workers=2",
            "rollout.reward_timeout=5",  # healthy calls in a stalled worker still return within it
            "rollout.max_failure_rate=0.9",
        ],
    )
    trainer = Trainer(cfg, reward_fn=faulty_reward)
    pool = trainer.workflow.reward_pool
    try:
        t0 = time.monotonic()
        trainer.fit()
        seconds = time.monotonic() - t0
        trainer.executor.pause()  # let the episodes started after the last step finish: counts settle
        while trainer.executor.stats()["running_prompts"]:
            time.sleep(0.05)
        state = {"dataloader": trainer.dataloader.state_dict(), "executor": trainer.executor.state_dict()}
        failed, alive, stats = trainer.executor.stats()["failed"], pool.n_alive, dict(pool.stats)
    finally:
        trainer.close()
    rows = metrics_rows(cfg.run_dir)
    check_steps(rows, steps, eta=0, batch_size=2)
    trained, _, dropped = audit_prompts(trainer.dataloader.rows, rows, state, batch_size=2, seed=cfg.seed)
    assert not any(fault_of(i, faults) for i in trained), "a prompt with a faulty reward was trained on"
    assert dropped and all(fault_of(i, faults) for i in dropped), f"healthy prompts lost: {dict(dropped)}"
    kinds = Counter(fault_of(i, faults) for i in dropped.elements())
    assert failed == 2 * sum(kinds.values())  # group_size episodes each
    assert stats["errors"] == 2 * kinds[RAISE] and stats["timeouts"] == 2 * kinds[HANG]
    assert stats["worker_deaths"] == 2 * kinds[DIE] and stats["replaced"] == 2 * (kinds[HANG] + kinds[DIE])
    assert alive == 2 and pool.n_alive == 0  # recovered during the run, cleaned up by close()
    assert 0 < rows[-1]["rollout/failed"] <= failed and rows[-1]["reward/calls"] > 0  # reported per step
    assert seconds < 600, "hung reward calls stalled the run"  # they sleep an hour
