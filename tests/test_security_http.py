"""What a web page, a foreign Host or a careless client can do to relayrl's local HTTP servers
(issue #38): `relayrl serve` (a real process), the agent proxy and the inspector refuse cross-site
and foreign-Host requests, bodies are JSON, capped and time-limited, client-named files are never
read, and servers launched without a token still have one."""

from __future__ import annotations

import base64
import os
import socket
import stat
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import safetensors.torch

from relayrl.data.models import build_tiny_model
from relayrl.inference.server import LISTEN_PREFIX
from relayrl.inference.server.launcher import launch_servers

TOKEN = "s3cret-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EVIL = {"Origin": "http://evil.example"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = tmp_path_factory.mktemp("sechttp")
    root, outside = base / "root", base / "outside"
    state = {k: v.clone() for k, v in build_tiny_model("tiny", seed=3).state_dict().items()}
    (root / "links").mkdir(parents=True)
    (root / "notweights").mkdir()
    outside.mkdir()
    safetensors.torch.save_file(state, str(outside / "model.safetensors"))
    os.symlink(outside / "model.safetensors", root / "links" / "model.safetensors")  # a file link out of the root
    (root / "notweights" / "model.safetensors").write_text("not safetensors")
    return root


@pytest.fixture(scope="module")
def server(root):
    overrides = [f"allowed_weight_roots=['{root}']", "max_request_mb=1"]
    group = launch_servers(1, admin_token=TOKEN, overrides=overrides)
    yield f"http://{group.addresses[0]}", group.addresses[0]
    group.shutdown()


def _paused(url: str) -> bool:
    return httpx.get(url + "/get_model_info", timeout=30).json()["paused"]


def _raw(address: str, request: bytes, timeout: float = 60.0) -> bytes:
    """Send ``request`` as is on a fresh connection; the reply's bytes (until the server closes or replies)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_cross_site_and_foreign_host_requests_are_refused(server):
    url, address = server
    # the issue's attack: a text/plain POST from another site paused generation (with the token even)
    for headers in ({**EVIL, "Content-Type": "text/plain"}, {**EVIL, **AUTH}, {"Sec-Fetch-Site": "cross-site", **AUTH}):
        r = httpx.post(url + "/pause_generation", headers=headers, content=b"{}", timeout=30)
        assert r.status_code == 403 and "refused" in r.json()["error"]["message"], (headers, r.text)
    r = httpx.post(url + "/pause_generation", headers={**AUTH, "Content-Type": "text/plain"}, content=b"{}", timeout=30)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert not _paused(url)
    # DNS rebinding: a name that is not this machine's
    r = httpx.get(url + "/get_model_info", headers={"Host": "evil.example"}, timeout=30)
    assert r.status_code == 403 and "Host" in r.json()["error"]["message"]
    port = address.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost"):
        assert httpx.get(url + "/health", headers={"Host": host}, timeout=30).status_code == 200
    same = {"Origin": f"http://127.0.0.1:{port}", **AUTH}  # the server's own origin is fine
    assert httpx.post(url + "/continue_generation", headers=same, timeout=30).status_code == 200


def test_bodies_are_capped_bounded_in_time_and_batches_in_items(server):
    url, address = server
    head = "POST /generate HTTP/1.1\r\nHost: {a}\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
    # 40 MB announced: refused before a byte of it is read
    reply = _raw(address, head.format(a=address, n=40 << 20).encode())
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    # over the cap without a Content-Length (chunked)
    r = httpx.post(
        url + "/generate",
        content=iter([b"[" + b" " * (2 << 20) + b"]"]),
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413
    # batches: at most MAX_BATCH_ITEMS prompts
    from relayrl.inference.server.schemas import MAX_BATCH_ITEMS

    r = httpx.post(url + "/generate", json={"input_ids": [[1]] * (MAX_BATCH_ITEMS + 1)}, timeout=60)
    assert r.status_code == 400 and "input_ids" in r.json()["error"]["message"]


def test_a_half_sent_body_is_answered_408(tmp_path):
    group = launch_servers(1, admin_token=TOKEN, overrides=["body_timeout=1"])
    try:
        address = group.addresses[0]
        head = f"POST /generate HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
        t0 = time.monotonic()
        reply = _raw(address, head.encode(), timeout=60)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert time.monotonic() - t0 < 50  # not the minutes of the issue (the server's own 1 s timer)
    finally:
        group.shutdown()


def test_image_data_never_names_a_server_file(server, tmp_path):
    url, _ = server
    secret = tmp_path / "shadow"
    secret.write_bytes(b"x" * 631)
    for image in (str(secret), "/dev/zero", str(tmp_path), "/missing/file.png"):
        body = {"input_ids": [3, 4], "image_data": image, "sampling_params": {"max_new_tokens": 1}}
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 400, (image, r.status_code, r.text[:200])
        msg = r.json()["error"]["message"]
        assert "file paths" in msg and "631 bytes" not in msg and "No such file" not in msg
    chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(secret)}}]}]}
    r = httpx.post(url + "/v1/chat/completions", json={"model": "x", **chat}, timeout=60)
    assert r.status_code == 400 and "631" not in r.text
    ok = base64.b64encode(b"\x89PNG not really").decode()
    from relayrl.data.vision import inline_image

    assert inline_image("data:image/png;base64," + ok, "x") == b"\x89PNG not really"


def test_weight_files_are_confined_by_their_real_path(server, root):
    url, _ = server
    v0 = httpx.get(url + "/get_weight_version", timeout=30).json()["weight_version"]
    r = httpx.post(
        url + "/update_weights_from_disk", headers=AUTH, json={"model_path": str(root / "links")}, timeout=60
    )
    assert r.status_code == 403 and "links outside" in r.json()["error"]["message"]
    r = httpx.post(
        url + "/update_weights_from_disk", headers=AUTH, json={"model_path": str(root / "notweights")}, timeout=60
    )
    assert r.status_code == 400 and "not a readable safetensors file" in r.json()["error"]["message"]
    assert httpx.get(url + "/get_weight_version", timeout=30).json()["weight_version"] == v0


def _cmdlines() -> str:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        out.append(" ".join(p.info["cmdline"] or []))
    return "\n".join(out)


def test_launched_servers_always_have_a_token_kept_off_the_command_line(monkeypatch):
    monkeypatch.delenv("RELAYRL_ADMIN_TOKEN", raising=False)
    group = launch_servers(1)
    try:
        url = f"http://{group.addresses[0]}"
        assert len(group.admin_token) >= 32
        assert httpx.post(url + "/pause_generation", json={}, timeout=30).status_code == 401
        assert group.admin_token not in _cmdlines()
        ok = httpx.post(url + "/pause_generation", json={}, headers={"Authorization": f"Bearer {group.admin_token}"})
        assert ok.status_code == 200
    finally:
        group.shutdown()


def test_standalone_serve_without_a_token_writes_one_to_a_private_file(tmp_path):
    env = {**os.environ, "RELAYRL_CACHE": str(tmp_path)}
    env.pop("RELAYRL_ADMIN_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert line.startswith(LISTEN_PREFIX), line
        url = line[len(LISTEN_PREFIX) :].strip()
        port = url.rsplit(":", 1)[1]
        token_file = tmp_path / "serve" / f"admin-token-{port}"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert httpx.post(url + "/pause_generation", json={}, timeout=30).status_code == 401
        ok = httpx.post(url + "/pause_generation", json={}, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert ok.status_code == 200
    finally:
        proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert f"the token in {token_file}" in err
    assert not token_file.exists()  # removed with the server


def test_admin_token_flag_warns_and_the_file_option_is_checked(tmp_path, capsys):
    from relayrl import cli

    assert cli.main(["serve", "--admin-token", "x", "--admin-token-file", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "--admin-token shows the token to every user" in err and "nope: No such file" in err
    (tmp_path / "empty").write_text("\n")
    assert cli.main(["serve", "--admin-token-file", str(tmp_path / "empty")]) == 2
    assert "is empty" in capsys.readouterr().err


def test_peers_get_their_key_outside_argv(tmp_path):
    from relayrl.api.config import InferenceConfig
    from relayrl.inference.remote.sglang import SGLangBackend
    from relayrl.inference.remote.vllm import VLLMBackend

    args, env = SGLangBackend().api_key("k3y", tmp_path)
    assert args == ["--config", str(tmp_path / "sglang-key.yaml")] and env == {}
    assert (tmp_path / "sglang-key.yaml").read_text() == 'api-key: "k3y"\n'
    assert stat.S_IMODE((tmp_path / "sglang-key.yaml").stat().st_mode) == 0o600
    assert VLLMBackend().api_key("k3y", tmp_path) == ([], {"VLLM_API_KEY": "k3y"})
    cfg = InferenceConfig(backend="remote", protocol="vllm")
    with pytest.raises(ValueError, match="loopback only"):
        VLLMBackend().server_command(cfg, "tiny", 8000, host="10.1.2.3")
    assert "--host" in VLLMBackend().server_command(cfg, "tiny", 8000)


def test_weight_store_listens_on_its_host_only():
    from datetime import timedelta

    from relayrl.inference.weight_group import master_store

    store = master_store("127.0.0.1", 0, 1, timedelta(seconds=30))
    listening = {
        c.laddr.ip
        for c in psutil.Process().net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port
    }
    assert listening == {"127.0.0.1"}  # TCPStore alone listens on '::' whatever host it is given
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_agent_proxy_refuses_foreign_requests_and_answers_engine_refusals_with_400(tiny_model):
    from relayrl.agents.proxy import AgentProxy
    from relayrl.api.config import InferenceConfig
    from relayrl.api.io import GenerationConfig
    from relayrl.data.models import build_tokenizer
    from relayrl.inference.local import LocalEngine

    tok = build_tokenizer()
    eng = LocalEngine(InferenceConfig(seed=1), model=tiny_model, tokenizer=tok)
    eng.initialize()
    proxy = AgentProxy(eng, tok, GenerationConfig(max_new_tokens=2, greedy=True)).start()
    try:
        sid = proxy.open_session()
        auth = {"Authorization": f"Bearer {sid}"}
        url = proxy.base_url + "/v1/completions"
        ok = httpx.post(url, json={"model": "m", "prompt": [3, 4], "max_tokens": 2}, headers=auth, timeout=60)
        assert ok.status_code == 200, ok.text
        for body in ({"model": "m", "prompt": [1000000]}, {"model": "m", "prompt": [3], "max_tokens": 10**9}):
            r = httpx.post(url, json=body, headers=auth, timeout=60)
            assert r.status_code == 400, (body, r.status_code, r.text[:300])
            assert r.json()["error"]["message"]
        r = httpx.post(url, json={"model": "m", "prompt": [3]}, headers={**auth, **EVIL}, timeout=60)
        assert r.status_code == 403
        r = httpx.post(url, content=b'{"model": "m", "prompt": [3]}', headers={**auth, "Content-Type": "text/plain"})
        assert r.status_code == 415
        r = httpx.get(proxy.base_url + "/v1/models", headers={"Host": "rebind.evil.example"}, timeout=60)
        assert r.status_code == 403
    finally:
        proxy.stop()
        eng.destroy()


@pytest.fixture()
def inspector(tmp_path):
    import threading

    from relayrl.inspector.server import make_server

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "rollout/reward": 0.5}\n')
    srv = make_server([run])
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_inspector_serves_json_to_its_own_origin_only(inspector):
    r = httpx.get(inspector + "/data/manifest.json", timeout=30)
    assert r.status_code == 200 and r.json()["runs"][0]["metrics"][0]["rollout/reward"] == 0.5
    assert r.headers["x-content-type-options"] == "nosniff"
    # no script a foreign page could include (the issue: relayrlData(...) read by any site's <script>)
    assert httpx.get(inspector + "/data/manifest.js", timeout=30).status_code == 404
    for headers in (
        {"Host": "evil.example"},
        {"Origin": "http://evil.example"},
        {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Dest": "script"},
    ):
        r = httpx.get(inspector + "/data/manifest.json", headers=headers, timeout=30)
        assert r.status_code == 403, headers
    assert httpx.get(inspector + "/", headers={"Sec-Fetch-Site": "none"}, timeout=30).status_code == 200


def test_inspector_answers_a_huge_step_number_with_400(inspector):
    r = httpx.get(inspector + "/data/r0/step_" + "9" * 5000 + ".json", timeout=30)
    assert r.status_code == 400
    assert httpx.get(inspector + "/data/r0/step_000001.json", timeout=30).status_code == 404  # still serving
