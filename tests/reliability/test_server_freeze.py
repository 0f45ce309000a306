"""Servers that freeze (SIGSTOP: they accept connections and never answer) rather than die, and
weight updates that freeze (a server stopped during a disk load; a weight directory whose writes block).

A frozen server is evicted by the health check (``inference.health_timeout``) and the requests
in flight on it are re-issued to the other server at once; with every server frozen the run
stops within ``inference.server_wait_timeout`` with one line naming them. Each test's own
timeout (pytest-timeout) is the failure: before the fix the first run stalled for
``request_timeout`` (set to 300 s here) and the second waited without a word.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time

import httpx
import pytest
import safetensors.torch
from audit import FAST, TOKEN, check_steps, metrics_rows, remote_cfg

from relayrl.api.config import InferenceConfig, RunConfig, load_config
from relayrl.api.io import GenerationConfig, ModelRequest, WeightUpdate
from relayrl.data.models import build_tiny_model
from relayrl.inference.remote import RemoteEngine
from relayrl.inference.server.launcher import launch_servers
from relayrl.inference.weight_group import WeightBroadcastGroup
from relayrl.trainer import Trainer
from relayrl.utils.deadline import Stalled

T = 6
# A frozen server is evicted by its health check, not by request_timeout (300 s: what the old code
# waited). 2 s: a healthy server on a loaded machine answers /health within it (one miss evicts).
FREEZE = ["inference.request_timeout=300", "inference.health_timeout=2"]


@pytest.fixture(scope="module")
def sync_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def fleet(sync_dir):
    group = launch_servers(2, admin_token=TOKEN, overrides=[f"allowed_weight_roots=[{sync_dir}]"])
    yield group
    group.shutdown()


@pytest.fixture
def servers(fleet):
    """The module's two servers, thawed (and healthy) again after each test."""
    yield fleet
    for i, p in enumerate(fleet.procs):
        p.send_signal(signal.SIGCONT)
        fleet.wait_healthy(i)


def _freeze_when(
    trainer: Trainer, servers, which: list[int], frozen: list[float], at_step: int = 2
) -> threading.Thread:
    """Once step ``at_step`` is done and server ``which[0]`` has a request in flight, SIGSTOP ``which``."""

    def run() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and trainer.step < T:
            if trainer.step >= at_step and trainer.engine.servers[which[0]].in_flight > 0:
                for i in which:
                    servers.procs[i].send_signal(signal.SIGSTOP)
                frozen.append(time.monotonic())
                return
            time.sleep(0.001)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(150)
def test_one_of_two_servers_frozen_mid_rollout_the_run_finishes(tmp_path, servers):
    # server 0 answers on; were it evicted by a stall, it has 30 s to be re-admitted
    cfg = remote_cfg(
        tmp_path / "run", servers.addresses, f"total_steps={T}", *FREEZE, "inference.server_wait_timeout=30"
    )
    trainer = Trainer(cfg)
    frozen: list[float] = []
    thread = _freeze_when(trainer, servers, [1], frozen)
    try:
        trainer.fit()
        finished = time.monotonic()
        thread.join()
        stats = trainer.engine.stats()
    finally:
        trainer.close()
    assert frozen, "server 1 was never seen with a request in flight"
    print(f"one frozen server: run finished {finished - frozen[0]:.1f}s after the freeze")
    check_steps(metrics_rows(cfg.run_dir), T, eta=1, batch_size=2)
    # evicted; what it still held went elsewhere (reissued, printed), unless its answers were on their way
    # when it froze: in flight was seen > 0 a moment before the SIGSTOP (CI once saw 0 reissued)
    print(f"evictions {stats['evictions']}, reissued {stats['reissued']}")
    assert stats["evictions"] >= 1
    assert metrics_rows(cfg.run_dir)[-1]["rollout/failed"] == 0


@pytest.mark.timeout(150)
def test_every_server_frozen_stops_the_run_with_one_line(tmp_path, servers, caplog):
    cfg = remote_cfg(
        tmp_path / "run", servers.addresses, f"total_steps={T}", *FREEZE, "inference.server_wait_timeout=5"
    )
    trainer = Trainer(cfg)
    frozen: list[float] = []
    thread = _freeze_when(trainer, servers, [0, 1], frozen)
    try:
        with pytest.raises(Stalled) as err:
            trainer.fit()
        stopped = time.monotonic()
        thread.join()
    finally:
        trainer.close()
    msg = str(err.value)
    print(f"every server frozen: stopped {stopped - frozen[0]:.1f}s after the freeze: {msg}")
    assert "\n" not in msg and "inference.server_wait_timeout" in msg
    assert all(a in msg for a in servers.addresses) and "health check failed" in msg


def _silent_listener() -> tuple[socket.socket, str]:
    """A socket that accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock, f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.timeout(60)
def test_a_server_that_accepts_and_never_answers_stops_start_up_with_one_line():
    sock, address = _silent_listener()
    eng = RemoteEngine(InferenceConfig(backend="remote", health_timeout=0.3, launch_timeout=1.0), addresses=[address])
    t0 = time.monotonic()
    try:
        with pytest.raises(Stalled, match="inference.launch_timeout") as err:
            eng.initialize()
    finally:
        eng.destroy()
        sock.close()
    print(f"silent server at start-up: stopped after {time.monotonic() - t0:.1f}s")
    assert address in str(err.value) and "\n" not in str(err.value)


@pytest.mark.timeout(90)
def test_a_request_past_its_deadline_is_retried_on_the_other_server(servers):
    """The health check never runs here (interval 1000 s): the deadline alone takes the request off
    the frozen server."""
    cfg = InferenceConfig(
        backend="remote", admin_token=TOKEN, health_interval=1000, request_timeout=1.0, token_timeout=0.0
    )
    eng = RemoteEngine(cfg, addresses=servers.addresses)
    eng.initialize()
    servers.procs[1].send_signal(signal.SIGSTOP)
    g = GenerationConfig(max_new_tokens=4, min_new_tokens=4)  # a sampled end-of-sequence cannot end one early

    async def run() -> list:
        return await asyncio.gather(
            *(eng.agenerate(ModelRequest(rid=f"r{i}", input_ids=[1, 2, 3], gconfig=g)) for i in range(4))
        )

    try:
        outs = asyncio.run(run())
    finally:
        eng.destroy()
    assert [(len(o.output_tokens), o.stop_reason) for o in outs] == [(4, "length")] * 4
    assert eng.counters["retried"] >= 1 and eng.counters["evictions"] == 0


@pytest.mark.long
@pytest.mark.timeout(600)
@pytest.mark.parametrize("frozen_servers", [[1], [0, 1]])
def test_demo_model_over_two_launched_servers_with_default_deadlines(tmp_path, frozen_servers):
    """The issue's run as a user starts it: the demo's SFT model, two launched ``relayrl serve``
    servers, every deadline at its default, SIGSTOP at step 10 (before the fix: no step for
    minutes). One frozen: the run finishes; both: it stops with one line after
    ``server_wait_timeout`` (60 s)."""
    steps = 30
    cfg = load_config(
        RunConfig,
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            *FAST,
            "model.path=tests/data/demo_sft",
            "inference.backend=remote",
            "inference.n_servers=2",
            "rollout.max_staleness=1",
            "gconfig.max_new_tokens=16",
            f"total_steps={steps}",
        ],
    )
    trainer = Trainer(cfg)
    procs = trainer.engine._launched.procs  # type: ignore[attr-defined]
    frozen: list[float] = []

    def freeze() -> None:
        while trainer.step < 10:
            time.sleep(0.005)
        for i in frozen_servers:
            procs[i].send_signal(signal.SIGSTOP)
        frozen.append(time.monotonic())

    threading.Thread(target=freeze, daemon=True).start()
    try:
        if len(frozen_servers) == 1:
            trainer.fit()
            assert trainer.step == steps
        else:
            with pytest.raises(Stalled, match="inference.server_wait_timeout"):
                trainer.fit()
        print(
            f"demo, {len(frozen_servers)} of 2 frozen: {time.monotonic() - frozen[0]:.1f}s from the freeze to the end"
        )
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
        trainer.close()


# ---------------------------------------------------------------- weight updates that freeze


def _engine(addresses: list[str], sync_dir, **kw) -> RemoteEngine:
    cfg = InferenceConfig(backend="remote", admin_token=TOKEN, weight_sync="disk", weight_sync_dir=str(sync_dir), **kw)
    eng = RemoteEngine(cfg, addresses=addresses)
    eng.initialize()
    return eng


@pytest.mark.timeout(120)
def test_a_server_frozen_during_a_disk_load_is_evicted_and_the_other_updated(servers, sync_dir):
    eng = _engine(servers.addresses, sync_dir, request_timeout=300, health_interval=0.2, health_timeout=2)
    frozen: list[float] = []

    def freeze_when_loading() -> None:  # SIGSTOP server 1 once its load call is under way
        deadline = time.monotonic() + 60
        while not eng.servers[1].updating and time.monotonic() < deadline:
            time.sleep(0.0005)
        servers.procs[1].send_signal(signal.SIGSTOP)
        frozen.append(time.monotonic())

    thread = threading.Thread(target=freeze_when_loading, daemon=True)
    thread.start()
    try:
        eng.update_weights(WeightUpdate(kind="tensors", version=1, tensors=build_tiny_model("tiny").state_dict()))
        done = time.monotonic()
        thread.join()
        versions = [(s.alive, s.version) for s in eng.servers]
    finally:
        servers.procs[1].send_signal(signal.SIGCONT)
        eng.destroy()
    print(f"server frozen during a disk load: update returned {done - frozen[0]:.1f}s after the freeze")
    assert versions[0] == (True, 1)  # the healthy server has the new weights
    assert versions[1][0] is False or versions[1][1] == 1  # the frozen one evicted (or it finished first)


@pytest.mark.timeout(60)
def test_a_weight_sync_dir_whose_writes_block_stops_with_one_line(servers, sync_dir, monkeypatch):
    """The write never returns, as on a hung network file system (safetensors' writer blocked on an event)."""
    release = threading.Event()
    save_file = safetensors.torch.save_file

    def blocked(*args: object, **kwargs: object) -> None:
        release.wait(60)
        save_file(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", blocked)
    eng = _engine(servers.addresses[:1], sync_dir, request_timeout=2)
    t0 = time.monotonic()
    try:
        with pytest.raises(Stalled) as err:
            eng.update_weights(WeightUpdate(kind="tensors", version=7, tensors=build_tiny_model("tiny").state_dict()))
        waited = time.monotonic() - t0
    finally:
        release.set()
        eng.destroy()
    msg = str(err.value)
    print(f"weight-sync dir blocks: stopped after {waited:.1f}s: {msg}")
    assert msg.startswith("writing weights v7 to inference.weight_sync_dir=")
    assert "inference.request_timeout" in msg and "\n" not in msg


@pytest.mark.timeout(120)
def test_a_server_frozen_during_a_broadcast_is_evicted_and_the_other_updated(servers, monkeypatch):
    """weight_sync=broadcast: server 1 is SIGSTOPped as the trainer starts the collective (its first
    bucket). The health check evicts it, the push ends at once and goes to server 0 through a new
    group; thawed, server 1 rejoins with the current weights. Before the fix the trainer waited for
    the frozen server's reply for ``request_timeout`` (300 s here)."""
    cfg = InferenceConfig(
        backend="remote",
        admin_token=TOKEN,
        weight_sync="broadcast",
        request_timeout=300,
        health_interval=0.2,
        health_timeout=2,  # a healthy server on a loaded machine answers /health within it
    )
    eng = RemoteEngine(cfg, addresses=servers.addresses)
    eng.initialize()
    frozen: list[float] = []
    send = WeightBroadcastGroup.broadcast

    def freeze_then_send(group: WeightBroadcastGroup, tensors: dict) -> None:
        if not frozen:  # the trainer (rank 0) is inside the broadcast: server 1 freezes now
            servers.procs[1].send_signal(signal.SIGSTOP)
            frozen.append(time.monotonic())
        send(group, tensors)

    monkeypatch.setattr(WeightBroadcastGroup, "broadcast", freeze_then_send)
    new = build_tiny_model("tiny", seed=3).state_dict()
    try:
        eng.update_weights(WeightUpdate(kind="tensors", version=11, tensors=new))  # above the other tests' versions
        done = time.monotonic()
        assert [s.alive for s in eng.servers] == [True, False] and eng.servers[0].version == 11
        servers.procs[1].send_signal(signal.SIGCONT)  # thawed: re-admitted with v11
        deadline = time.monotonic() + 60
        while not eng.servers[1].alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(s.alive, s.version) for s in eng.servers] == [(True, 11), (True, 11)]
        eng.update_weights(WeightUpdate(kind="tensors", version=12, tensors=new))  # both again, one group
        versions = [
            int(httpx.get(f"http://{a}/get_weight_version", timeout=10).json()["weight_version"])
            for a in servers.addresses
        ]
    finally:
        servers.procs[1].send_signal(signal.SIGCONT)
        eng.destroy()
    print(f"server frozen during a broadcast: update returned {done - frozen[0]:.1f}s after the freeze")
    assert versions == [12, 12]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "mode", ["disk"]
)  # broadcast: see docs/reliability.md (a member stalled behind it times out too)
def test_a_server_that_never_answers_a_weight_update_is_evicted_after_request_timeout(servers, sync_dir, mode):
    """No health check runs (interval 1000 s): server 1 accepts the update's connections and never
    answers (SIGSTOPped as the trainer sends it the load call); ``inference.request_timeout``
    alone evicts it, and the update completes on server 0."""
    cfg = InferenceConfig(
        backend="remote",
        admin_token=TOKEN,
        weight_sync=mode,
        weight_sync_dir=str(sync_dir),
        request_timeout=10,  # server 0 loads the update within it however loaded the machine
        health_interval=1000,
    )
    eng = RemoteEngine(cfg, addresses=servers.addresses)
    eng.initialize()
    frozen: list[float] = []
    admin = eng.admin

    def freeze_then_call(srv, call, *args, **kwargs):  # the update's load call to server 1 finds it frozen
        loads = call.path.startswith(("/update_weights_from_disk", "/update_weights_from_distributed"))
        if srv is eng.servers[1] and loads and not frozen:
            servers.procs[1].send_signal(signal.SIGSTOP)
            frozen.append(time.monotonic())
        return admin(srv, call, *args, **kwargs)

    eng.admin = freeze_then_call  # type: ignore[method-assign]
    try:
        eng.update_weights(WeightUpdate(kind="tensors", version=21, tensors=build_tiny_model("tiny").state_dict()))
        done = time.monotonic()
        states = [(s.alive, s.version) for s in eng.servers]
    finally:
        servers.procs[1].send_signal(signal.SIGCONT)
        eng.destroy()
    print(f"{mode}: a server that never answers the update: evicted, update returned {done - frozen[0]:.1f}s after")
    assert frozen and states[0] == (True, 21) and states[1][0] is False
