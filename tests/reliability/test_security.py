"""Security of `relayrl serve` as a real process: admin routes need the token, weight paths stay
inside the allowed roots, and the server listens on loopback unless told otherwise.

Each refused request is shown to have had no effect (weights, pause state) and the same
request with the token is shown to work, so a refusal is the token's doing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import psutil
import pytest
import safetensors.torch

from relayrl.data.models import build_tiny_model
from relayrl.inference.server import LISTEN_PREFIX
from relayrl.inference.server.launcher import launch_servers

TOKEN = "s3cret-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BAD_AUTH = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": TOKEN},
    {"Authorization": f"Bearer {TOKEN}x"},
    {"Authorization": "Bearer"},
    {"X-Admin-Token": TOKEN},
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """An allowed root with good weights in it, and a directory outside with good weights too."""
    base = tmp_path_factory.mktemp("sec")
    root, outside, sibling = base / "root", base / "outside", base / "root_evil"  # sibling shares root's prefix
    state = {k: v.clone() for k, v in build_tiny_model("tiny", seed=3).state_dict().items()}
    for d in (root / "good", outside, sibling):
        d.mkdir(parents=True)
        safetensors.torch.save_file(state, str(d / "model.safetensors"))
    os.symlink(outside, root / "escape")
    return root, outside, sibling


@pytest.fixture(scope="module")
def server(dirs):
    root, _, _ = dirs
    group = launch_servers(1, admin_token=TOKEN, overrides=[f"allowed_weight_roots=['{root}']"])
    yield f"http://{group.addresses[0]}"
    group.shutdown()


def _version(url: str) -> int:
    return int(httpx.get(url + "/get_weight_version", timeout=30).json()["weight_version"])


def _paused(url: str) -> bool:
    return httpx.get(url + "/get_model_info", timeout=30).json()["paused"]


def test_admin_routes_refuse_requests_without_the_token(server, dirs):
    root, _, _ = dirs
    good = str(root / "good")
    upload = safetensors.torch.save({k: v.clone() for k, v in build_tiny_model("tiny", seed=4).state_dict().items()})
    routes = [
        ("/update_weights_from_disk", {"json": {"model_path": good, "weight_version": 7}}),
        ("/update_weights_from_tensor?weight_version=8", {"content": upload}),
        ("/pause_generation", {"json": {}}),
        ("/continue_generation", {}),
    ]
    for path, kw in routes:
        for headers in BAD_AUTH:
            r = httpx.post(
                server + path + (f"&token={TOKEN}" if "?" in path else f"?token={TOKEN}"),
                headers=headers,
                timeout=60,
                **kw,
            )
            assert r.status_code in (401, 403), (path, headers, r.status_code, r.text)
            assert "admin endpoint" in r.json()["error"]["message"]
            assert r.status_code == 403 or r.headers.get("www-authenticate") == "Bearer"
        assert _version(server) == 0 and not _paused(server), f"{path} had an effect without the token"
    # generation needs no token
    r = httpx.post(
        server + "/generate", json={"input_ids": [3, 9, 4], "sampling_params": {"max_new_tokens": 2}}, timeout=60
    )
    assert r.status_code == 200
    # and every refused request works with it
    assert httpx.post(server + "/pause_generation", headers=AUTH, json={}, timeout=60).status_code == 200 and _paused(
        server
    )
    assert httpx.post(server + "/continue_generation", headers=AUTH, timeout=60).status_code == 200 and not _paused(
        server
    )
    r = httpx.post(
        server + "/update_weights_from_disk", headers=AUTH, json={"model_path": good, "weight_version": 7}, timeout=120
    )
    assert r.status_code == 200 and _version(server) == 7
    r = httpx.post(server + "/update_weights_from_tensor?weight_version=8", headers=AUTH, content=upload, timeout=120)
    assert r.status_code == 200 and _version(server) == 8


def test_weight_paths_outside_the_allowed_roots_are_refused(server, dirs, tmp_path):
    root, outside, sibling = dirs
    v0 = _version(server)
    attacks = {
        str(outside): 403,  # absolute path elsewhere
        str(root / ".." / "outside"): 403,  # traversal
        f"{root}/good/../../outside": 403,
        str(root / "escape"): 403,  # a symlink inside the root pointing out
        str(root / "escape" / "."): 403,
        str(sibling): 403,  # /x/root_evil is not inside /x/root
        os.path.relpath(outside): 403,  # relative to the server's working directory
        "/etc": 403,
        "/": 403,
        "~": 403,
        "/proc/self/cwd": 403,
        str(root / "good") + "\x00/../../outside": 400,  # NUL byte
        str(root / "good/..%2F..%2Foutside"): 400,  # encoded traversal is just a (missing) name
        str(root / ("x" * 5000)): 400,  # a name too long for the OS
    }
    for path, status in attacks.items():
        r = httpx.post(server + "/update_weights_from_disk", headers=AUTH, json={"model_path": path}, timeout=60)
        assert r.status_code == status, (path[:80], r.status_code, r.text[:200])
        assert "model_path" in r.json()["error"]["message"]
    assert _version(server) == v0  # nothing was loaded
    assert httpx.get(server + "/health", timeout=30).status_code == 200


def _serve(*args: str, cache: object = "") -> tuple[subprocess.Popen[str], str]:
    """``relayrl serve --port 0 ARGS`` as a process; returns it and its announced host:port."""
    env = dict(os.environ, RELAYRL_ADMIN_TOKEN="", RELAYRL_CACHE=str(cache))
    proc = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(LISTEN_PREFIX), (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line[len(LISTEN_PREFIX) :].strip().removeprefix("http://")


def _listening_on(pid: int, port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.Process(pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def _outward_ip() -> str | None:
    """An address of this machine that is not loopback (None on a machine without one)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def test_server_binds_loopback_unless_told_otherwise(tmp_path):
    default, address = _serve(cache=tmp_path)
    told, told_address = _serve("--host", "0.0.0.0", cache=tmp_path)
    try:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and _listening_on(default.pid, int(port)) == {"127.0.0.1"}
        assert httpx.get(f"http://{address}/health", timeout=30).status_code == 200
        ip = _outward_ip()
        if ip is not None:  # not reachable from outside the machine
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://{ip}:{port}/health", timeout=5)
        told_port = int(told_address.rsplit(":", 1)[1])
        assert _listening_on(told.pid, told_port) == {"0.0.0.0"}
    finally:
        for proc in (default, told):
            proc.terminate()
    _, err_default = default.communicate(timeout=30)
    _, err_told = told.communicate(timeout=30)
    assert "WARNING" not in err_default
    for err in (err_default, err_told):  # no token given: admin routes take a random one, never open
        assert "no admin token given" in err and "admin-token-" in err


def test_remote_engine_without_the_token_cannot_push_weights(server):
    from relayrl.api.config import InferenceConfig
    from relayrl.api.io import WeightUpdate
    from relayrl.inference.remote import RemoteEngine

    os.environ.pop("RELAYRL_ADMIN_TOKEN", None)
    eng = RemoteEngine(
        InferenceConfig(backend="remote", weight_sync="http"), addresses=[server.removeprefix("http://")]
    )
    eng.initialize()
    try:
        v0 = _version(server)
        state = build_tiny_model("tiny", seed=5).state_dict()
        with pytest.raises(RuntimeError, match="401"):
            eng.update_weights(WeightUpdate(kind="tensors", version=v0 + 1, tensors=state))
        assert _version(server) == v0
    finally:
        eng.destroy()
