"""``launcher=ray`` on a real local Ray cluster of two simulated nodes (one CPU each: this machine's two cores).

Trainer ranks and ``relayrl serve`` servers are Ray actors running relayrl's ordinary parts; the
tests check that two ranks and a server train like one process, that a killed server actor is
restarted and re-admitted with no prompt lost or trained twice, that a dead trainer rank ends
the run with its checkpoints intact and ``recover=auto`` resumes, and that bad specs fail fast.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from relayrl.api.config import ConfigError, RunConfig, load_config
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.cli import main
from relayrl.inference.remote import RemoteEngine
from relayrl.trainer import Trainer, train
from tests.reliability.audit import TOKEN, audit_prompts, check_steps, metrics_rows

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from relayrl.launch import RayLaunchError, TrainerRankDied  # noqa: E402
from relayrl.launch.ray_cluster import RayRun, run_on_ray  # noqa: E402

FAST = [
    "rollout.batch_size=4",
    "rollout.group_size=2",
    "gconfig.max_new_tokens=6",
    "data.n_train=64",
    "data.n_eval=4",
    # A random model earns no reward, so advantages are 0: the entropy bonus keeps gradients non-zero.
    "train.optimizer.lr=1e-3",
    "actor.entropy_coef=0.01",
    "logging.tensorboard=false",
    "logging.progress=off",
    "logging.rollouts_per_step=0",
]
# half a CPU per actor: two ranks and a server fit on the two one-CPU nodes
RAY = ["ray.trainer_cpus=0.5", "ray.server_cpus=0.5", "ray.placement_timeout=60"]


def test_unreachable_ray_address_is_one_line(capsys):
    """``relayrl train launcher=ray ray.address=...`` with nothing there: one line, exit code 2, at once
    (Ray itself would retry for minutes). First in the module: no Ray connection exists yet."""
    assert not ray.is_initialized()
    t0 = time.monotonic()
    code = main(["train", "launcher=ray", "ray.address=127.0.0.1:9", "total_steps=1", "logging.tensorboard=false"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and time.monotonic() - t0 < 10
    assert err.startswith("relayrl train: ray.address=127.0.0.1:9: no Ray cluster answers there (") and "\n" not in err


def test_launch_gpus_under_ray_are_refused_at_load_time():
    with pytest.raises(
        ConfigError, match=r"Ray hands each server its GPUs \(ray.server_gpus\); leave launch_gpus empty"
    ):
        load_config(
            RunConfig,
            None,
            ["launcher=ray", "inference.backend=remote", "inference.n_servers=1", "inference.launch_gpus=[0]"],
        )


def test_without_an_address_a_local_instance_starts_with_ray_num_cpus(capsys, tmp_path, monkeypatch, request):
    """No ``ray.address`` (and no RAY_ADDRESS): a Ray instance of ``ray.num_cpus`` CPUs starts here, even
    where a dead cluster's address file is left over (CI once failed on one); a spec it cannot hold is
    one line, and the instance is shut down again."""
    assert not ray.is_initialized() and "RAY_ADDRESS" not in os.environ
    ray_tmp = Path(tempfile.mkdtemp(prefix="rr", dir="/tmp"))  # short: Ray's socket paths live under it
    request.addfinalizer(lambda: shutil.rmtree(ray_tmp, ignore_errors=True))
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")  # what `ray start` leaves behind
    argv = ["train", f"run_dir={tmp_path}", "launcher=ray", "ray.num_cpus=1", "ray.trainer_cpus=2", *FAST]
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == (
        "relayrl train: ray: the cluster cannot hold this run: it needs 2 CPU (ray.trainer_ranks=1 x "
        "ray.trainer_cpus=2 + inference.n_servers=0 x ray.server_cpus=1) but the cluster has 1"
    )
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def cluster():
    """A head and a worker node (separate raylets on this machine), shared by the module's tests."""
    mem = 80 * 1024 * 1024
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": mem})
    c.add_node(num_cpus=1, object_store_memory=mem)
    ray.init(address=c.address, logging_level="ERROR")
    yield c
    ray.shutdown()
    c.shutdown()


def _cfg(run_dir: Path, *extra: str) -> RunConfig:
    return load_config(RunConfig, None, [f"run_dir={run_dir}", *FAST, *extra])


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "actor" / "model.safetensors"))


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _wait_for_step(run_dir: Path, step: int, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(json.loads(line)["step"] >= step for line in (run_dir / "metrics.jsonl").read_text().splitlines()):
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{run_dir} never reached step {step}")


def _released(timeout: float = 120.0) -> None:
    """Every CPU of the cluster is free again: the run's actors and placement group are gone."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0.0) != 2.0:
        assert time.monotonic() < deadline, f"still held: {ray.available_resources()}"
        time.sleep(0.1)


@pytest.mark.timeout(1800)  # a loaded 2-core machine starts Ray workers slowly (600 s was not enough)
def test_two_ranks_and_a_server_on_two_nodes_train_like_one_process_through_a_rank_death(cluster, tmp_path):
    """Sync RL with greedy rollouts (the server's outputs then do not depend on request order).

    Ray: two trainer ranks on the two nodes (SPREAD) and a server actor; rank 1's process is
    SIGKILLed after step 2: the run stops with ``TrainerRankDied`` and intact checkpoints, and the
    same config with ``recover=auto`` finishes it. The whole matches one process run straight
    through: the same prompts in the same steps, the same losses, the same weights up to fp32
    summation order."""
    T = 5  # steps 3-5 leave time to kill rank 1 after step 2 however fast the machine
    args = [f"total_steps={T}", "gconfig.greedy=true", "inference.backend=remote", "inference.n_servers=1"]
    args += ["inference.weight_sync=broadcast"]  # weights from rank 0 to the server over a process group (gloo)
    train(_cfg(tmp_path / "one", *args))  # one process, its server launched by RemoteEngine
    run_dir = tmp_path / "ray"
    on_ray = [*args, *RAY, "launcher=ray", "ray.trainer_ranks=2", "ray.strategy=SPREAD", "checkpoint.every_n_steps=1"]
    run = RayRun(_cfg(run_dir, *on_ray))
    try:
        run.start()
        assert len(set(run.rank_nodes)) == 2, "SPREAD put both trainer ranks on one node"
        _wait_for_step(run_dir, 2)
        os.kill(run.rank_pids[1], signal.SIGKILL)
        with pytest.raises(TrainerRankDied, match=r"^trainer rank 1 died .* run the same command with recover=auto"):
            run.wait()
    finally:
        run.close()
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert saved and all((run_dir / "checkpoints" / s / "trainer_state.json").exists() for s in saved)
    assert 1 <= int(saved[-1].removeprefix("step_")) < T  # (a kill during step 2's save leaves step 1's)
    _released()

    last = run_on_ray(_cfg(run_dir, *on_ray, "recover=auto"))
    assert last["version"] == float(T)
    a, b = _rows(tmp_path / "one"), _rows(run_dir)
    assert [r["step"] for r in b] == list(range(1, T + 1))  # each step once: the rows after the checkpoint redone
    for ra, rb in zip(a, b, strict=True):
        assert ra["prompt_ids"] == rb["prompt_ids"] and ra["rollout/reward"] == rb["rollout/reward"]
        assert rb["actor/loss"] == pytest.approx(ra["actor/loss"], abs=1e-5)
        assert rb["inference/live_servers"] == 1.0
    wa, wb = _weights(tmp_path / "one", T), _weights(run_dir, T)
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-5
    _released()


def _once_back(call, timeout: float = 600.0):
    """``call()`` once the actor it asks is back: while Ray restarts it, calls fail as unavailable."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, "the actor did not come back"
            time.sleep(0.2)


@pytest.mark.timeout(1800)  # a loaded 2-core machine starts Ray workers slowly (600 s was not enough)
def test_killed_server_actor_is_restarted_and_readmitted_with_nothing_lost(cluster, tmp_path):
    """Asynchronous training (eta=1) on two server actors; one actor's process is SIGKILLed with a
    request in flight. The run goes on with the other server; Ray restarts the actor on its node and
    port, RemoteEngine re-admits it with the current weights, and the audit holds (no prompt lost or
    trained twice). The trainer runs in this process, between server actors on the Ray cluster, so
    that the test can wait for the re-admission (seconds of imports) between the run's two halves."""
    T = 8
    run_dir = tmp_path / "run"
    cfg = _cfg(
        run_dir,
        f"total_steps={T // 2}",
        "rollout.batch_size=2",
        "rollout.max_staleness=1",
        "gconfig.max_new_tokens=16",
        "inference.backend=remote",
        "inference.n_servers=2",
        f"inference.admin_token={TOKEN}",
        "inference.health_interval=0.2",
        "inference.max_retries=12",
        "inference.request_timeout=60",
        "ray.server_max_restarts=1",  # one restart: the one this test sees (0 would leave the server dead)
        *RAY,
        "launcher=ray",
    )
    run = RayRun(cfg)
    trainer = None
    try:
        run.place()
        run.start_servers()
        address = run.cfg.inference.addresses[1]
        actor_pid, server_pid = ray.get(run.servers[1].pids.remote())
        trainer = Trainer(run.cfg)
        killed: list[int] = []

        def killer() -> None:  # once step 2 is done, wait for a request in flight on server 1, then kill its actor
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and trainer.step < T // 2:
                if trainer.step >= 2 and trainer.engine.servers[1].in_flight > 0:
                    os.kill(actor_pid, signal.SIGKILL)
                    killed.append(trainer.step)
                    return
                time.sleep(0.001)

        thread = threading.Thread(target=killer)
        thread.start()
        trainer.fit()
        thread.join()
        assert killed, "server 1 was never seen with a request in flight"
        new_pids = _once_back(lambda: ray.get(run.servers[1].pids.remote()))  # Ray restarted the actor ...
        assert new_pids[0] != actor_pid and new_pids[1] != server_pid
        assert ray.get(run.servers[1].address.remote()) == address  # ... at the address RemoteEngine knows
        deadline = time.monotonic() + 60
        while len(trainer.engine.live_servers()) < 2:
            assert time.monotonic() < deadline, "the restarted server was never re-admitted"
            time.sleep(0.1)
        trainer.cfg.total_steps = T  # the second half, on both servers again
        trainer.fit()
        state = {"dataloader": trainer.dataloader.state_dict(), "executor": trainer.executor.state_dict()}
        rows_of_data = trainer.dataloader.rows
    finally:
        if trainer is not None:
            trainer.close()
        run.close()
    rows = metrics_rows(run_dir)
    check_steps(rows, T, eta=1, batch_size=2)
    _, _, dropped = audit_prompts(rows_of_data, rows, state, batch_size=2, seed=cfg.seed)
    assert not dropped, f"prompts lost with the server: {dict(dropped)}"
    assert rows[-1]["rollout/failed"] == 0  # requests on the dead server were re-issued, not failed
    assert rows[-1]["inference/evictions"] >= 1 and rows[-1]["inference/readmissions"] >= 1
    assert rows[-1]["inference/live_servers"] == 2.0
    _released()


def test_sglang_servers_are_ray_actors_on_their_nodes_address(cluster, tmp_path):
    """``inference.launch=sglang`` under Ray: each server actor runs peer_launcher's SGLang command
    line (the stand-in of tests/peers) on its node's address; RemoteEngine connects and generates."""
    peers = Path(__file__).parent / "peers"
    cfg = _cfg(
        tmp_path,
        *RAY,
        "launcher=ray",
        "inference.backend=remote",
        "inference.protocol=sglang",
        "inference.launch=sglang",
        "inference.n_servers=1",
        f"inference.launch_command={sys.executable} {peers / 'sglang_server.py'}",
        f"inference.launch_log_dir={tmp_path / 'logs'}",
    )
    run = RayRun(cfg)
    try:
        run.place()
        run.start_servers()
        (address,) = run.cfg.inference.addresses
        host = address.rsplit(":", 1)[0]
        argv = " ".join(httpx.get(f"http://{address}/stand_in", timeout=10).json()["argv"])
        assert f"--host {host}" in argv and f"--port {address.rsplit(':', 1)[1]}" in argv
        assert "--dtype float32" in argv  # the trainer's dtype, as RemoteEngine's own launch gives it
        assert host == ray.util.get_node_ip_address()  # the node's address, not loopback
        assert (tmp_path / "logs" / "ray-server-0" / "server-0.log").read_text().startswith("$ ")
        engine = RemoteEngine(run.cfg.inference, model=run.cfg.model)
        engine.initialize()
        try:
            g = GenerationConfig(max_new_tokens=4, greedy=True, ignore_eos=True)
            assert asyncio.run(engine.agenerate(ModelRequest("a", [3, 4, 5], g))).output_len == 4
        finally:
            engine.destroy()
    finally:
        run.close()
    _released()


def test_a_relayrl_server_actor_gets_inference_launch_timeout(cluster, tmp_path, monkeypatch):
    """Its start-up deadline is ``inference.launch_timeout``, as for a server launched without Ray (it was a
    fixed 180 s, which a loaded machine's Ray worker start and imports outlasted, and whose error named
    inference.launch_timeout all the same)."""

    class RecordingServer:  # ServerActor's stand-in (defined here: Ray ships it by value), naming its deadline
        def __init__(self, args, token, port, startup_timeout, peer):
            self.timeout = startup_timeout

        def address(self) -> str:
            return f"127.0.0.1:{self.timeout:g}"

    monkeypatch.setattr("relayrl.launch.ray_cluster.ServerActor", RecordingServer)
    cfg = _cfg(tmp_path, *RAY, "inference.backend=remote", "inference.n_servers=1", "inference.launch_timeout=777")
    run = RayRun(cfg)
    try:
        run.place()
        run.start_servers()
        assert run.cfg.inference.addresses == ["127.0.0.1:777"]
    finally:
        run.close()
    _released()


def test_a_spec_the_cluster_cannot_hold_fails_at_start_naming_what_is_missing(cluster, tmp_path):
    cases = {
        "ray.trainer_gpus=1": r"needs 1 GPU \(ray.trainer_ranks=1 x ray.trainer_gpus=1 \+ inference.n_servers=1 x "
        r"ray.server_gpus=0\) but the cluster has 0$",
        "ray.server_gpus=1": r"needs 1 GPU \(ray.trainer_ranks=1 x ray.trainer_gpus=0 \+ inference.n_servers=1 x "
        r"ray.server_gpus=1\) but the cluster has 0$",
        "ray.trainer_cpus=3": r"needs 3.5 CPU \(.*\) but the cluster has 2$",
        "ray.trainer_cpus=1.5": r"needs \{'CPU': 1.5\} for a trainer rank on one node, and no node has it$",
        "ray.strategy=STRICT_SPREAD": r"needs 3 nodes \(ray.strategy=STRICT_SPREAD\) but it has 2$",
    }
    server = ["launcher=ray", *RAY, "inference.backend=remote", "inference.n_servers=1"]
    for override, message in cases.items():
        cfg = _cfg(tmp_path, *server, "ray.trainer_ranks=2" if "SPREAD" in override else "seed=1", override)
        t0 = time.monotonic()
        with pytest.raises(RayLaunchError, match=message):
            run_on_ray(cfg)
        assert time.monotonic() - t0 < 50  # refused up front, not after ray.placement_timeout=60
    # a server that cannot start (SGLang not installed where its actor runs): one line, not a Ray traceback
    missing = tmp_path / "no-sglang"
    peer = ["inference.protocol=sglang", "inference.launch=sglang", f"inference.launch_command={missing}"]
    run = RayRun(_cfg(tmp_path, *server, *peer, "ray.server_max_restarts=0"))
    try:
        run.place()
        with pytest.raises(
            RayLaunchError, match=rf"^ray: a server actor did not start: FileNotFoundError: .*{missing}"
        ):
            run.start_servers()
    finally:
        run.close()
    _released()
    # enough CPUs in all and per node, but three bundles of 0.6 CPU do not fit two nodes of one CPU
    cfg = _cfg(tmp_path, *server, "ray.trainer_ranks=2", "ray.trainer_cpus=0.6", "ray.server_cpus=0.6")
    cfg.ray.placement_timeout = 2.0
    with pytest.raises(RayLaunchError, match=r"were not placed within ray.placement_timeout=2s"):
        run_on_ray(cfg)
    _released()  # the unplaced group was removed


def test_ctrl_c_on_the_driver_names_the_latest_checkpoint_to_continue_from(cluster, tmp_path, capsys):
    """Ctrl-C to ``relayrl train launcher=ray`` (the driver) stops the ranks mid-step, so nothing is saved
    at the interrupt: the one line says so and names the latest periodic checkpoint ``--recover``
    continues from (it said "before training started" although steps were checkpointed)."""
    run_dir = tmp_path / "run"
    argv = ["train", f"run_dir={run_dir}", *FAST, *RAY, "launcher=ray", f"ray.address={cluster.address}"]
    argv += ["total_steps=1000", "checkpoint.every_n_steps=1"]

    def interrupt() -> None:
        # step 2's checkpoint renamed into place, not only its metrics row (written before the save: a Ctrl-C
        # right after the row landed in the save and left step 1 the latest on a busy machine)
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "step_000002").is_dir():
            assert time.monotonic() < deadline, f"{run_dir} never saved step 2"
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C reaches the driver

    sender = threading.Thread(target=interrupt)
    sender.start()
    code = main(argv)
    sender.join()
    # relayrl's last line, not the last line: Ray forwards the ranks' output (tqdm bars of transformers'
    # checkpoint writes among them) asynchronously, so some may land after it (CI, 2026-11-29)
    last = [line for line in capsys.readouterr().err.splitlines() if line.startswith("relayrl train:")][-1]
    latest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert code == 128 + signal.SIGINT
    assert last == (
        f"relayrl train: stopped by SIGINT during training; nothing saved at the interrupt; latest checkpoint {latest}; "
        f"continue from it with: relayrl train {run_dir}/config.yaml --recover"
    )
    assert int(latest.name.removeprefix("step_")) >= 2
    _released()
