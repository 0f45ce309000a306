"""Weight updates that freeze: a server SIGSTOPped while it loads new weights from disk, and a
weight-sync directory whose writes block (a FIFO where the weights file goes). Each ends within
its deadline (the server evicted and the others updated; one ``Stalled`` line) instead of waiting
forever; the test's own timeout is the failure."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import safetensors.torch
from audit import TOKEN

from relayrl.api.config import InferenceConfig
from relayrl.api.io import WeightUpdate
from relayrl.data.models import build_tiny_model
from relayrl.inference.remote import RemoteEngine
from relayrl.inference.server.launcher import launch_servers
from relayrl.utils.deadline import Stalled


@pytest.fixture(scope="module")
def sync_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def servers(sync_dir):
    group = launch_servers(2, admin_token=TOKEN, overrides=[f"allowed_weight_roots=[{sync_dir}]"])
    yield group
    for p in group.procs:
        p.send_signal(signal.SIGCONT)
    group.shutdown()


def _engine(addresses: list[str], sync_dir, **kw) -> RemoteEngine:
    cfg = InferenceConfig(backend="remote", admin_token=TOKEN, weight_sync="disk", weight_sync_dir=str(sync_dir), **kw)
    eng = RemoteEngine(cfg, addresses=addresses)
    eng.initialize()
    return eng


@pytest.mark.timeout(120)
def test_a_server_frozen_during_a_disk_load_is_evicted_and_the_other_updated(servers, sync_dir):
    eng = _engine(servers.addresses, sync_dir, request_timeout=300, health_interval=0.2, health_timeout=0.5)
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
