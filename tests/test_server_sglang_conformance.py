"""`relayrl serve` where an SGLang or OpenAI client would notice a difference (issue #17, point 8).

Each behaviour follows SGLang v0.5.x's ``http_server.py`` / ``io_struct.py`` (pause modes,
string weight versions, stop strings trimmed from the text, the disk-update extras, the cache
and abort routes, the server/model info routes) or OpenAI's error object (what the SDK reads).
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import safetensors.torch

from relayrl.inference.server.launcher import launch_servers

TOKEN = "conf"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TRIES = 6  # of holding a request mid-generation: a try is lost only when it finished before the hold


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("w")


@pytest.fixture(scope="module")
def server(root):
    g = launch_servers(1, admin_token=TOKEN, overrides=[f"allowed_weight_roots=['{root}']"])
    yield f"http://{g.addresses[0]}"
    g.shutdown()


def _generate(url: str, n: int, **sp) -> httpx.Response:
    body = {
        "input_ids": [3, 20, 21, 22, 4],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **sp},
    }
    return httpx.post(url + "/generate", json=body, timeout=120)


def _info(url: str) -> dict:
    return httpx.get(url + "/get_model_info", timeout=10).json()


def _held(url: str, threads: list[threading.Thread], tokens: int, total: int) -> bool:
    """Start ``threads`` (each sends one /generate); once all their calls have arrived and ``tokens``
    more tokens are out, pause in place (generation holds where it is). Whether no request had
    finished by then (fewer than ``total`` tokens out, ``total`` the tokens of the shortest): what
    the test does next lands mid-generation however loaded the machine; if not, the requests are
    resumed and finished (the caller tries again)."""
    base = _info(url)
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while (info := _info(url))["generate_calls"] - base["generate_calls"] < len(threads):  # each one queued
        assert time.monotonic() < deadline, "the requests never arrived"
        time.sleep(0.005)
    start = info["tokens_generated"]  # every request is queued: it is running once tokens come after this
    while _info(url)["tokens_generated"] - start < tokens and any(t.is_alive() for t in threads):
        assert time.monotonic() < deadline, "nothing generated"
        time.sleep(0.005)
    assert httpx.post(url + "/pause_generation", json={"mode": "in_place"}, headers=AUTH, timeout=30).status_code == 200
    if _info(url)["tokens_generated"] - base["tokens_generated"] < total:
        return True
    httpx.post(url + "/continue_generation", json={}, headers=AUTH, timeout=30)
    for t in threads:
        t.join(timeout=60)
    return False


def test_pause_with_an_empty_body_aborts_in_flight_requests(server):
    """SGLang's PauseGenerationReqInput.mode defaults to 'abort': in-flight requests come back at
    once with finish_reason abort and the tokens generated so far. The request is held mid-generation
    by a pause in place first (``_held``), so the abort lands there whatever the machine's load."""
    for _ in range(TRIES):
        replies = []
        t = threading.Thread(target=lambda out=replies: out.append(_generate(server, 400)))
        if _held(server, [t], 5, 400):
            break
    else:
        pytest.fail(f"the request finished before the pause on all {TRIES} tries")
    assert httpx.post(server + "/pause_generation", json={}, headers=AUTH, timeout=30).status_code == 200
    try:
        t.join(timeout=30)
        assert not t.is_alive(), "the in-flight request was kept while paused"
        meta = replies[0].json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 400
    finally:
        httpx.post(server + "/continue_generation", json={}, headers=AUTH, timeout=30)
    r = httpx.post(server + "/pause_generation", json={"mode": "in_place"}, headers=AUTH, timeout=30)
    assert r.status_code == 200
    httpx.post(server + "/continue_generation", json={}, headers=AUTH, timeout=30)
    r = httpx.post(server + "/pause_generation", json={"mode": "sideways"}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]


def test_weight_version_is_a_string(server):
    """As SGLang reports it: the string of the version the weights have (no update yet here: "0")."""
    assert _generate(server, 2).json()["meta_info"]["weight_version"] == "0"
    for path in ("/get_weight_version", "/model_info", "/get_server_info", "/server_info"):
        assert httpx.get(server + path, timeout=10).json()["weight_version"] == "0", path


def test_stop_strings_are_trimmed_from_the_text_unless_no_stop_trim(server):
    full = _generate(server, 24).json()
    text = full["text"]
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].strip())
    cut = _generate(server, 24, stop=[stop]).json()
    assert cut["meta_info"]["finish_reason"]["type"] == "stop"
    assert cut["text"] == text[: text.find(stop)] and stop not in cut["text"]
    kept = _generate(server, 24, stop=[stop], no_stop_trim=True).json()
    assert kept["text"].endswith(stop)
    body = {"prompt": [3, 20, 21, 22, 4], "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    choice = httpx.post(server + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == cut["text"]  # vLLM / OpenAI: stop string excluded


def test_sglang_disk_update_extras_and_routes_are_accepted(server, root, tiny_model):
    d = root / "v3"
    d.mkdir()
    safetensors.torch.save_file(
        {k: v.clone() for k, v in tiny_model.state_dict().items()}, str(d / "model.safetensors")
    )
    body = {
        "model_path": str(d),
        "weight_version": "3",
        "abort_all_requests": True,
        "is_async": False,
        "torch_empty_cache": True,
        "keep_pause": False,
        "recapture_cuda_graph": False,
        "token_step": 7,
        "flush_cache": True,
    }
    r = httpx.post(server + "/update_weights_from_disk", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == "3", r.text
    for method in ("GET", "POST"):
        assert httpx.request(method, server + "/flush_cache", timeout=10).status_code == 200
    assert httpx.post(server + "/abort_request", json={"abort_all": True}, headers=AUTH, timeout=30).json()["success"]
    info = httpx.get(server + "/server_info", timeout=10).json()
    assert (
        info["tp_size"] == 1 and info["version"] and httpx.get(server + "/get_server_info", timeout=10).json() == info
    )
    assert httpx.get(server + "/model_info", timeout=10).json()["weight_version"] == "3"


def test_errors_are_openai_error_objects_the_sdk_reads(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[3, 4], max_tokens=0)
    assert isinstance(e.value.body, dict) and "max_tokens" in e.value.body["message"], e.value.body
    assert e.value.body["code"] == 400 and e.value.body["type"] == "BadRequestError"
    r = _generate(server, -1)  # (0 is SGLang's "score the prompt only": tests/test_server.py)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.max_new_tokens"


def test_abort_request_ends_one_rid_with_its_partial_output_and_leaves_the_others(server):
    """SGLang's AbortReq: ``rid`` aborts that request (finish_reason abort, the tokens so far; it is
    not continued); the others run on; ``abort_all`` ends them all; an unknown rid is a no-op. Both
    requests are held mid-generation by a pause in place (``_held``) while the abort is sent."""
    n = 200
    replies: dict[str, httpx.Response] = {}

    def go(rid: str) -> None:
        body = {
            "rid": rid,
            "input_ids": [3, 20, 21, 22, 4],
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        }
        replies[rid] = httpx.post(server + "/generate", json=body, timeout=120)

    for i in range(TRIES):
        keep, drop = f"keep{i}", f"drop{i}"
        threads = [threading.Thread(target=go, args=(rid,)) for rid in (keep, drop)]
        if _held(server, threads, 10, n):
            break
    else:
        pytest.fail(f"the requests finished before the pause on all {TRIES} tries")
    try:
        r = httpx.post(server + "/abort_request", json={"rid": drop}, headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["aborted"] == 1
    finally:
        httpx.post(server + "/continue_generation", json={}, headers=AUTH, timeout=30)
    for t in threads:
        t.join(timeout=60)
    dropped, kept = replies[drop].json()["meta_info"], replies[keep].json()["meta_info"]
    assert dropped["finish_reason"]["type"] == "abort" and 0 < dropped["completion_tokens"] < n
    assert kept["finish_reason"]["type"] == "length" and kept["completion_tokens"] == n
    r = httpx.post(server + "/abort_request", json={"rid": "no-such-rid"}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["aborted"] == 0
