"""Soak: asynchronous training against two real servers while a chaos thread SIGKILLs and
restarts them at random, for ``RELAYRL_SOAK_SECONDS`` (60 in the normal run; docs/reliability.md
records a 30-minute run).

At the end: every step trained a full batch within eta, no prompt was lost or trained twice,
no episode failed, both servers are back in service, and the figures (steps, samples,
restarts survived, failures, max staleness) are written to RUN_DIR/soak.json (and to
``RELAYRL_SOAK_REPORT`` when set).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

import pytest
from audit import TOKEN, audit_prompts, check_steps, metrics_rows, remote_cfg

from relayrl.inference.server.launcher import launch_servers
from relayrl.trainer import Trainer

SECONDS = float(os.environ.get("RELAYRL_SOAK_SECONDS", "60"))
ETA = 2


class Chaos(threading.Thread):
    """Every few seconds: SIGKILL a random server, restart it on its port, wait until the
    trainer's engine has re-admitted it (so one server is always up)."""

    def __init__(self, group, engine, seed: int) -> None:
        super().__init__(daemon=True)
        self.group, self.engine, self.rng = group, engine, random.Random(seed)
        self.stop, self.restarts, self.errors = threading.Event(), 0, []

    def run(self) -> None:
        try:
            while not self.stop.wait(self.rng.uniform(2.0, 8.0)):
                i = self.rng.randrange(len(self.group.addresses))
                self.group.kill(i)
                self.stop.wait(self.rng.uniform(0.0, 2.0))
                self.group.restart(i)
                deadline = time.monotonic() + 120
                while len(self.engine.live_servers()) < len(self.group.addresses):
                    assert time.monotonic() < deadline, f"server {i} was not re-admitted within 120 s"
                    time.sleep(0.1)
                self.restarts += 1
        except BaseException as e:  # reported by the test
            self.errors.append(e)


@pytest.mark.long
@pytest.mark.timeout(SECONDS + 600)
def test_soak_async_training_survives_random_server_restarts(tmp_path):
    group = launch_servers(2, admin_token=TOKEN)
    cfg = remote_cfg(
        tmp_path / "run",
        group.addresses,
        "total_steps=1000000000",
        f"rollout.max_staleness={ETA}",
        "actor.loss=decoupled_ppo",
        "data.n_train=2000",
        "checkpoint.every_n_steps=25",
        "checkpoint.save_final=false",
    )
    trainer = Trainer(cfg)
    chaos = Chaos(group, trainer.engine, seed=int(os.environ.get("RELAYRL_SOAK_SEED", "0")))
    t0 = time.monotonic()
    try:
        chaos.start()
        while time.monotonic() - t0 < SECONDS and not chaos.errors:
            cfg.total_steps = trainer.step + 5  # fit in short stretches, so the run ends on time
            trainer.fit()
        chaos.stop.set()
        chaos.join(timeout=180)
        trainer.executor.pause()  # let in-flight episodes finish, then audit
        while trainer.executor.stats()["running_prompts"]:
            time.sleep(0.05)
        state = {"dataloader": trainer.dataloader.state_dict(), "executor": trainer.executor.state_dict()}
        live, episodes, engine = (
            len(trainer.engine.live_servers()),
            trainer.executor.stats(),
            trainer.engine.stats(),
        )
    finally:
        chaos.stop.set()
        trainer.close()
        group.shutdown()
    seconds = time.monotonic() - t0
    assert not chaos.errors, chaos.errors
    rows = metrics_rows(cfg.run_dir)
    last = rows[-1]
    figures = {
        "seconds": round(seconds),
        "steps": len(rows),
        "samples": int(last["perf/samples"]),
        "restarts_survived": chaos.restarts,
        "evictions": engine["evictions"],
        "readmissions": engine["readmissions"],
        "requests_reissued": engine["reissued"],
        "requests_retried": engine["retried"],
        "episodes_completed": int(episodes["completed"]),
        "episodes_failed": int(episodes["failed"]),
        "episodes_expired": int(episodes["expired"]),
        "max_staleness": int(max(r["rollout/staleness_max"] for r in rows)),
        "eta": ETA,
        "steps_per_minute": round(60 * len(rows) / seconds, 1),
    }
    print("soak:", json.dumps(figures))
    (Path(cfg.run_dir) / "soak.json").write_text(json.dumps(figures, indent=1))
    if os.environ.get("RELAYRL_SOAK_REPORT"):
        Path(os.environ["RELAYRL_SOAK_REPORT"]).write_text(json.dumps(figures, indent=1))

    check_steps(rows, len(rows), eta=ETA, batch_size=2)
    _, _, dropped = audit_prompts(trainer.dataloader.rows, rows, state, batch_size=2, seed=cfg.seed)
    assert not dropped, f"prompts lost: {dict(dropped)}"
    assert figures["episodes_failed"] == 0 and live == 2
    assert figures["restarts_survived"] >= max(1, int(SECONDS // 60)), figures
    assert figures["readmissions"] >= figures["restarts_survived"]
