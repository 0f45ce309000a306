"""SIGKILL one of two real inference servers while the Trainer is mid-rollout.

The run must finish on the surviving server, every prompt handed out must be trained on
exactly once or still be pending (checked by row id), and the dead server must be reported
(``inference/live_servers``, ``inference/evictions`` in metrics.jsonl and a warning).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
from audit import TOKEN, audit_prompts, check_steps, metrics_rows, remote_cfg

from relayrl.api.config import InferenceConfig
from relayrl.api.io import WeightUpdate
from relayrl.data.models import build_tiny_model
from relayrl.inference.remote import RemoteEngine
from relayrl.inference.server.launcher import launch_servers
from relayrl.trainer import Trainer

T = 8


@pytest.fixture(scope="module")
def servers():
    group = launch_servers(2, admin_token=TOKEN)
    yield group
    group.shutdown()


def test_a_health_probe_racing_a_weight_update_never_rolls_the_version_back(servers):
    """Found by the soak: a probe that read the version just before an update and wrote it back
    just after made the next ``update_weights`` fail ("no server confirmed weight version")."""
    eng = RemoteEngine(
        InferenceConfig(backend="remote", admin_token=TOKEN, health_interval=0.3, weight_sync="http"),
        addresses=servers.addresses[:1],
    )
    eng.initialize()
    read, release = threading.Event(), threading.Event()
    parse = eng.backend.parse_version

    def late_parse(body):  # the health thread's reading of the version reaches it late
        if threading.current_thread().name == "relayrl-health":
            read.set()
            release.wait(30)
        return parse(body)

    eng.backend.parse_version = late_parse
    try:
        read.wait(1)  # a probe holds the old version now (a fixed engine does not read it at all)
        eng.update_weights(WeightUpdate(kind="tensors", version=1, tensors=build_tiny_model("tiny").state_dict()))
        release.set()
        seen = set()
        for _ in range(20):  # until well before the next probe (0.3 s) could correct a rollback
            seen.add(eng.servers[0].version)
            time.sleep(0.01)
        assert seen == {1} and eng.get_version() == 1, f"the engine believed the server was at versions {seen}"
    finally:
        release.set()
        eng.destroy()


def test_server_sigkilled_mid_rollout_run_finishes_and_nothing_is_lost(tmp_path, servers, caplog):
    cfg = remote_cfg(tmp_path / "run", servers.addresses, f"total_steps={T}")
    trainer = Trainer(cfg)
    killed_at: list[int] = []

    def killer() -> None:  # once step 2 is done, wait for a request in flight on server 1, then kill it
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and trainer.step < T - 2:
            if trainer.step >= 2 and trainer.engine.servers[1].in_flight > 0:
                killed_at.append(trainer.step)
                servers.kill(1)
                return
            time.sleep(0.001)

    thread = threading.Thread(target=killer)
    thread.start()
    logging.getLogger("relayrl").addHandler(caplog.handler)  # relayrl's logger does not propagate to root
    try:
        trainer.fit()
        thread.join()
        state = {"dataloader": trainer.dataloader.state_dict(), "executor": trainer.executor.state_dict()}
    finally:
        logging.getLogger("relayrl").removeHandler(caplog.handler)
        trainer.close()
    assert killed_at, "server 1 was never seen with a request in flight"
    assert servers.procs[1].poll() is not None  # really dead

    rows = metrics_rows(cfg.run_dir)
    check_steps(rows, T, eta=1, batch_size=2)
    _, _, dropped = audit_prompts(trainer.dataloader.rows, rows, state, batch_size=2, seed=cfg.seed)
    assert not dropped, f"prompts lost with the server: {dict(dropped)}"
    assert rows[-1]["rollout/failed"] == 0  # requests on the dead server were re-issued, not failed
    # reported: in the metrics of the steps after the kill, and in the log
    assert rows[0]["inference/live_servers"] == 2  # logged before the kill (at step >= 2)
    assert rows[-1]["inference/live_servers"] == 1 and rows[-1]["inference/evictions"] >= 1
    assert any("evicted" in r.getMessage() and servers.addresses[1] in r.getMessage() for r in caplog.records)
