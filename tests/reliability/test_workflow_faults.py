"""A workflow that raises in ~10% of episodes, end to end through the asynchronous Trainer:
every batch still fills, every failure is counted, and failed episodes are never trained on
while their group-mates are."""

from __future__ import annotations

import time
import zlib
from collections import Counter

from audit import FAST, audit_prompts, check_steps, metrics_rows

from relayrl.api.config import RunConfig, load_config
from relayrl.data.models import load_tokenizer
from relayrl.rewards.tasks import task_reward_fn
from relayrl.rollout.workflows.rlvr import RLVRWorkflow
from relayrl.trainer import Trainer


class Flaky(RLVRWorkflow):
    """RLVR whose episodes raise 10% of the time: episode k of a prompt fails when a hash of
    (row id, k) says so, so which episodes fail does not depend on timing."""

    def __init__(self, tokenizer, gconfig) -> None:
        super().__init__(task_reward_fn("arithmetic"), gconfig, tokenizer)
        self.episodes, self.raised = Counter(), Counter()

    async def arun_episode(self, engine, data):
        k = self.episodes[data["id"]] = self.episodes[data["id"]] + 1
        if zlib.crc32(f"{data['id']}#{k}".encode()) % 10 == 0:
            self.raised[data["id"]] += 1
            raise RuntimeError(f"injected workflow failure on {data['id']}")
        return await super().arun_episode(engine, data)


def test_ten_percent_failing_episodes_are_counted_and_batches_fill(tmp_path):
    steps, group = 16, 2
    cfg = load_config(
        RunConfig,
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            *FAST,
            f"total_steps={steps}",
            "rollout.max_staleness=1",
            "actor.loss=decoupled_ppo",
        ],
    )
    wf = Flaky(load_tokenizer(cfg.model), cfg.gconfig)
    trainer = Trainer(cfg, workflow=wf)
    try:
        trainer.fit()
        trainer.executor.pause()  # episodes started after the last step finish, then the counts settle
        while trainer.executor.stats()["running_prompts"]:
            time.sleep(0.05)
        state = {"dataloader": trainer.dataloader.state_dict(), "executor": trainer.executor.state_dict()}
        failed = trainer.executor.stats()["failed"]
    finally:
        trainer.close()
    rows = metrics_rows(cfg.run_dir)
    check_steps(rows, steps, eta=1, batch_size=2)  # every batch is full
    assert sum(wf.raised.values()) >= 2, "the seed injected too few failures to test anything"
    assert failed == sum(wf.raised.values())
    trained, _, dropped = audit_prompts(trainer.dataloader.rows, rows, state, batch_size=2, seed=cfg.seed)
    assert set(dropped) == {i for i, n in wf.raised.items() if n == group}  # only all-failed groups are dropped
    # a group trains on the episodes that did not fail: 2 rows, or 1 when its mate raised
    assert rows[-1]["perf/samples"] == sum(group - wf.raised[i] for i in trained.elements())
    assert any(0 < wf.raised[i] < group for i in trained), "no partially failed group was trained"
