"""Admin calls on RemoteEngine's connect and update paths follow ``inference.request_timeout``
(issue #40): they had fixed deadlines of 30-90 s (the version confirm, vLLM's logprob probe and
disk-transfer init and resume, SGLang's update session, detection at connect), which a
just-started server under load missed (ReadTimeout) whatever the run's setting.

A stub on 127.0.0.1 answers every call after ``DELAY`` s: with a shorter ``request_timeout`` each
call times out, its HTTP request having asked for that deadline (it asked for the old fixed one
before), and the error names the call and the setting; with a longer one it passes. The deadline
is read off the request, not off a clock: a loaded machine can take longer than ``DELAY`` just to
build the call (CI did once), which says nothing about the deadline it used."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from relayrl.api.config import InferenceConfig
from relayrl.inference.remote import RemoteEngine
from relayrl.inference.remote.protocol import PeerInfo, Server
from relayrl.inference.remote.sglang import SGLangBackend, SGLangBroadcast
from relayrl.inference.remote.vllm import VLLMBackend
from relayrl.inference.remote.vllm_transfer import TRANSFER, VLLMDisk, paused_for_update
from relayrl.inference.remote.weights import DiskSync

DELAY = 0.6  # every answer of the stub
SHORT, LONG = 0.15, 10.0  # request_timeout below and above it


class _Slow(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        time.sleep(DELAY)
        if self.path == "/v1/completions":  # vLLM's logprob probe: a top logprob of 0 passes at any temperature
            body: object = {"choices": [{"logprobs": {"top_logprobs": [{"token_id:1": 0.0}]}}]}
        else:
            body = {"weight_version": "1", "success": True}
        data = json.dumps(body).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client gave up (the short request_timeout)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def slow_url() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def fleet(url: str, protocol: str, request_timeout: float) -> tuple[RemoteEngine, Server]:
    eng = RemoteEngine(InferenceConfig(backend="remote", protocol=protocol, request_timeout=request_timeout), [url])
    routes = {"/pause", "/start_weight_update", TRANSFER, "/update_weights"}
    info = PeerInfo(protocol=protocol, server=protocol, model="m", version_path="/weight_info", routes=routes)
    srv = Server(url, info=info)
    eng.servers = [srv]
    return eng, srv


# each admin call: (protocol, the call's path as the error names it, the call)
CALLS: dict[str, tuple[str, str, Callable[[RemoteEngine, Server], object]]] = {
    "detection at connect": ("vllm", "/v1/models", lambda e, s: e._get(s)("/v1/models")),
    "version confirm": (
        "vllm",
        "/weight_info",
        lambda e, s: DiskSync(e, VLLMBackend().update_from_disk, e.backend).confirm(s, 1),
    ),
    "vllm logprob probe": ("vllm", "/v1/completions", lambda e, s: e.backend.connected(e)),
    "vllm disk-transfer init": ("vllm", TRANSFER, lambda e, s: VLLMDisk(e, VLLMBackend()).connect(s)),
    "sglang session begin": ("sglang", "/abort_request", lambda e, s: SGLangBroadcast(e, SGLangBackend())._begin(s)),
    "sglang session end": (
        "sglang",
        "/end_weight_update",
        lambda e, s: SGLangBroadcast(e, SGLangBackend())._end(s, quiet=False),
    ),
}


def _deadline(e: BaseException) -> float:
    """The read deadline the timed-out HTTP request asked for (httpx keeps it on the request)."""
    while getattr(e, "_request", None) is None:  # the error raised again naming the setting has none
        assert e.__cause__ is not None, f"no httpx request behind {e!r}"
        e = e.__cause__
    return e.request.extensions["timeout"]["read"]


@pytest.mark.parametrize("name", list(CALLS))
def test_admin_calls_follow_request_timeout(slow_url, name):
    protocol, path, call = CALLS[name]
    eng, srv = fleet(slow_url, protocol, SHORT)
    with pytest.raises(httpx.TimeoutException) as err:
        call(eng, srv)
    asked = _deadline(err.value)
    assert asked == SHORT, f"{name} asked for a {asked}s deadline, not inference.request_timeout={SHORT}"
    assert path in str(err.value) and "inference.request_timeout" in str(err.value), str(err.value)
    assert f"within {SHORT:g}s" in str(err.value), str(err.value)
    eng, srv = fleet(slow_url, protocol, LONG)
    call(eng, srv)  # a slow answer within the setting passes


def test_vllm_resume_after_an_update_follows_request_timeout(slow_url, caplog):
    """The resume after an update only warns when it fails; it gives up within the setting."""
    for timeout, fails in ((SHORT, True), (LONG, False)):
        eng, srv = fleet(slow_url, "vllm", timeout)
        caplog.clear()
        with caplog.at_level(logging.WARNING):  # pause (every call within the setting), update, resume
            paused_for_update(eng, VLLMBackend(), [srv], lambda: None)
        warned = [r.getMessage() for r in caplog.records if "did not resume" in r.getMessage()]
        if fails:
            assert warned and "/resume" in warned[0] and "inference.request_timeout" in warned[0], warned
            assert f"within {SHORT:g}s" in warned[0], warned  # the deadline it gave the resume
        else:
            assert not warned
