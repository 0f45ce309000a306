"""``inference.launch=sglang|vllm``: RemoteEngine starts the servers, with the flags relayrl
needs, one GPU set each, logs captured, and stops them. The executables are the stand-ins of
``tests/peers/`` (``inference.launch_command``), which take the real servers' command lines."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest

from relayrl.api.config import InferenceConfig, ModelConfig
from relayrl.api.io import GenerationConfig, ModelRequest, WeightUpdate
from relayrl.inference.remote import RemoteEngine

PEERS = Path(__file__).parent / "peers"


def _engine(kind: str, tmp_path: Path, **kw) -> RemoteEngine:
    fields = dict(
        backend="remote",
        protocol=kind,
        launch=kind,
        n_servers=2,
        launch_tp_size=2,
        launch_gpus=[4, 5, 6, 7],
        launch_command=f"{sys.executable} {PEERS / f'{kind}_server.py'}",
        launch_log_dir=str(tmp_path / "logs"),
        weight_sync="disk",
        weight_sync_dir=str(tmp_path / "w"),
        launch_timeout=120,
        health_interval=0.2,
    )
    cfg = InferenceConfig(**{**fields, **kw})
    return RemoteEngine(cfg, model=ModelConfig(path="tiny"))


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_launched_servers_get_relayrls_flags_gpus_and_logs_and_stop_on_destroy(kind, tmp_path, tiny_model):
    eng = _engine(kind, tmp_path)
    eng.initialize()
    procs = list(eng._launched.procs)  # type: ignore[union-attr]
    try:
        seen = [httpx.get(f"http://{a}/stand_in", timeout=10).json() for a in eng.addresses]
        assert [s["env"]["CUDA_VISIBLE_DEVICES"] for s in seen] == ["4,5", "6,7"]
        argv = " ".join(seen[0]["argv"])
        if kind == "sglang":
            assert "--model-path tiny" in argv and "--tp-size 2" in argv and "--host 127.0.0.1" in argv
            assert seen[0]["env"]["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
        else:
            assert "--logprobs-mode processed_logprobs" in argv and "--tensor-parallel-size 2" in argv
            assert "--weight-transfer" not in argv  # weight_sync=disk: no released vLLM has a disk backend
            assert seen[0]["env"]["VLLM_SERVER_DEV_MODE"] == "1"
        assert "--dtype float32" in argv  # the trainer's dtype
        g = GenerationConfig(max_new_tokens=4, greedy=True, ignore_eos=True)
        out = asyncio.run(eng.agenerate(ModelRequest("a", [3, 4, 5], g)))
        assert out.output_len == 4
        eng.update_weights(WeightUpdate(kind="tensors", version=1, tensors=tiny_model.state_dict()))
        if kind == "vllm":
            assert [httpx.get(f"http://{a}/weight_info").json()["weight_version"] for a in eng.addresses] == ["1", "1"]
        logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
        assert logs == ["server-0.log", "server-1.log"]
        assert (tmp_path / "logs" / "server-0.log").read_text().startswith("$ ")  # the command line, then its output
    finally:
        eng.destroy()
    assert all(p.poll() is not None for p in procs)  # stopped


def test_a_server_that_fails_to_start_is_an_error_quoting_its_log(tmp_path):
    eng = _engine("sglang", tmp_path, launch_args=["--version", "not-a-version"])
    with pytest.raises(RuntimeError, match=r"server 0 exited with code .*server-0\.log ends with"):
        eng.initialize()


def test_a_server_not_healthy_within_launch_timeout_is_an_error_naming_it(tmp_path):
    t0 = time.monotonic()
    never = f"{sys.executable} -c 'import time; time.sleep(60)'"  # starts, never listens
    eng = _engine("sglang", tmp_path, n_servers=1, launch_tp_size=1, launch_command=never, launch_timeout=2)
    with pytest.raises(TimeoutError, match=r"sglang server 0 not healthy after 2s \(inference.launch_timeout\)"):
        eng.initialize()
    assert time.monotonic() - t0 < 30


def test_launch_needs_the_matching_protocol(tmp_path):
    cfg = InferenceConfig(backend="remote", protocol="relayrl", launch="vllm", n_servers=1)
    with pytest.raises(ValueError, match="inference.protocol=vllm"):
        RemoteEngine(cfg).initialize()


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
@pytest.mark.parametrize(
    "args, dtype",
    [
        ([], ["--dtype", "float32"]),
        (["--dtype=float16"], ["--dtype=float16"]),
        (["--dtype", "half"], ["--dtype", "half"]),
    ],
)
def test_the_trainers_dtype_is_served_unless_launch_args_name_one(kind, args, dtype, tmp_path):
    """The trainer's ``--dtype`` is added only when the user's ``launch_args`` name none, in either
    spelling (the server reads the last one given: ``--dtype=float16`` then ``--dtype float32`` would be fp32).
    Ray's server actors build the same ``PeerServerGroup``."""
    from relayrl.inference.remote.launch import PeerServerGroup
    from relayrl.inference.remote.peers import make_backend

    cfg = InferenceConfig(backend="remote", protocol=kind, launch=kind, n_servers=1, launch_args=args)
    cmd = PeerServerGroup(make_backend(kind), cfg, "tiny", dtype="float32").command(1234)
    flags = [a for a in cmd if a.startswith("--dtype")]
    assert flags == dtype[:1] and cmd[cmd.index(dtype[0]) : cmd.index(dtype[0]) + len(dtype)] == dtype
