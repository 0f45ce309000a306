"""Fuzzing the HTTP bodies of a real `relayrl serve` process on 127.0.0.1.

Every POST endpoint gets random JSON, random field values and raw bytes (hypothesis), and
schemathesis walks the published OpenAPI schema: the answer is never a 5xx, every 4xx
carries a message, nothing outside the allowed weight roots is ever loaded, and the server
answers /health afterwards. (tests/test_server.py has the hand-written bad bodies.)
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import negative_data_rejection

from relayrl.inference.server.launcher import launch_servers

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = int(os.environ.get("RELAYRL_FUZZ_EXAMPLES", "60"))  # each example is an HTTP round trip
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

# Integers stay small or absurd: a valid request must not ask for thousands of tokens.
INT = st.integers(-3, 24) | st.sampled_from([2**31, -(2**63), 10**30, 5000])
LEAF = st.none() | st.booleans() | INT | st.floats() | st.text(max_size=12)
JSON = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
TOKENS = st.lists(st.integers(8, 70), min_size=1, max_size=6)
TEXT = st.text(alphabet="0123456789+-*= abc", min_size=1, max_size=10)
TEMP = st.floats(0.0, 2.0)
SAMPLING = st.fixed_dictionaries(
    {"max_new_tokens": st.integers(1, 8)},
    optional={
        "temperature": TEMP,
        "top_p": st.floats(0.05, 1.0),
        "top_k": st.integers(-1, 20),
        "stop": TEXT | st.lists(TEXT, max_size=2),
        "stop_token_ids": st.lists(st.integers(0, 100), max_size=2),
        "ignore_eos": st.booleans(),
        "min_new_tokens": st.just(0),
    },
)
SPECIAL_PATHS = [
    "/",
    "/etc",
    "..",
    "/tmp/../etc",
    "\x00",
    "~",
    "/proc/self",
    "x" * 5000,
    "ROOT",
    "ROOT/../..",
    "ROOT/" + "x" * 5000,
    "ROOT/\x00",
    "ROOT/a/../../etc",
    "ROOT/%2e%2e/etc",
]  # ROOT: the allowed root
VALID = {  # endpoint -> strategy of bodies it must accept (200)
    "/generate": st.fixed_dictionaries(
        {"input_ids": TOKENS, "sampling_params": SAMPLING}, optional={"return_logprob": st.booleans(), "rid": TEXT}
    ),
    "/v1/completions": st.fixed_dictionaries(
        {"prompt": TEXT | TOKENS, "max_tokens": st.integers(1, 8)},
        optional={
            "temperature": TEMP,
            "n": st.integers(1, 3),
            "logprobs": st.integers(0, 5),
            "stop": TEXT,
            "top_k": st.integers(-1, 9),
        },
    ),
    "/v1/chat/completions": st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": TEXT}),
                min_size=1,
                max_size=2,
            ).map(lambda m: [*m, {"role": "user", "content": "1+1="}]),
            "max_tokens": st.integers(1, 8),
        },
        optional={"temperature": TEMP, "n": st.integers(1, 2), "logprobs": st.booleans()},
    ),
    "/pause_generation": st.fixed_dictionaries({}, optional={"mode": st.sampled_from(["in_place", "retract"])}),
    "/continue_generation": st.builds(dict),
    # paths that must all be refused: outside the root, traversal, NUL, nothing there
    "/update_weights_from_disk": st.fixed_dictionaries(
        {
            "model_path": st.sampled_from(SPECIAL_PATHS)
            | st.text(max_size=30)
            | st.text(max_size=30).map(lambda t: "ROOT/" + t)
        },
        optional={"weight_version": st.integers(-5, 5), "flush_cache": st.booleans()},
    ),
    "/update_weights_from_tensor": st.binary(max_size=64),
}


@st.composite
def mutated(draw: st.DrawFn, path: str) -> tuple[object, int]:
    """A valid body of ``path`` with 0-2 fields (maybe nested) replaced by wild values, deleted or added;
    returns (body, number of mutations)."""
    body = draw(VALID[path])
    n = draw(st.integers(0, 2)) if isinstance(body, dict) else 0
    for _ in range(n):
        node = body
        if isinstance(node.get("sampling_params"), dict) and draw(st.booleans()):
            node = node["sampling_params"]
        keys = sorted(node)
        action = draw(st.sampled_from(["replace", "delete", "add"])) if keys else "add"
        if action == "add":
            node[draw(st.text(min_size=1, max_size=6))] = draw(JSON)
        elif action == "delete":
            del node[draw(st.sampled_from(keys))]
        else:
            node[draw(st.sampled_from(keys))] = draw(JSON)
    return body, n


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")  # the allowed weight root: empty, nothing loadable


@pytest.fixture(scope="module")
def server(root):
    # a fuzzed /init_weights_update_group waits for a trainer that never comes: at most 3 s
    group = launch_servers(
        1,
        admin_token=TOKEN,
        overrides=[f"allowed_weight_roots=['{root}']", "max_upload_mb=8", "inference.request_timeout=3"],
    )
    url = f"http://{group.addresses[0]}"
    yield url
    group.shutdown()


def _check(url: str, r: httpx.Response) -> None:
    assert r.status_code < 500, f"{r.request.method} {r.request.url.path} -> {r.status_code}: {r.text[:300]}"
    if r.status_code >= 400:
        body = r.json()
        err = body.get("error")
        msg = err.get("message") if isinstance(err, dict) else body.get("detail")
        assert msg and isinstance(msg, (str, list)), body
    if r.request.url.path == "/pause_generation" and r.status_code == 200:
        httpx.post(url + "/continue_generation", headers=AUTH, timeout=30)  # keep generation going for later examples


def _alive_and_unchanged(url: str) -> None:
    """The server still answers, generates, and loaded no weights from anything the fuzzer sent."""
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert httpx.get(url + "/get_weight_version", timeout=30).json()["weight_version"] == "0"
    r = _post(url, "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text


def _post(url: str, path: str, body: object = None, raw: bytes | None = None) -> httpx.Response:
    """POST ``body`` as JSON (NaN / Infinity included, as Python writes them) or ``raw`` bytes."""
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(url + path, headers={**AUTH, "content-type": "application/json"}, content=content, timeout=120)


MUST_ACCEPT = ("/generate", "/v1/completions", "/v1/chat/completions", "/pause_generation", "/continue_generation")


@pytest.mark.parametrize("path", sorted(VALID))
def test_endpoint_valid_bodies_with_wild_fields(server, root, path):
    @FUZZ
    @given(sample=mutated(path))
    def run(sample):
        body, n = sample
        if isinstance(body, dict) and isinstance(body.get("model_path"), str):
            body["model_path"] = body["model_path"].replace("ROOT", str(root), 1)
        r = _post(server, path, raw=body) if isinstance(body, bytes) else _post(server, path, body)
        _check(server, r)
        if n == 0 and path in MUST_ACCEPT:
            assert r.status_code == 200, (body, r.text)
        if path.startswith("/update_weights"):
            assert r.status_code in (400, 403, 404), (body, r.text)

    if path == "/update_weights_from_disk":  # every special path for sure, not just the ones hypothesis picks
        for special in SPECIAL_PATHS:
            run.hypothesis.inner_test(sample=({"model_path": special}, 0))
    run()
    _alive_and_unchanged(server)


@pytest.mark.parametrize("path", sorted(VALID))
def test_endpoint_random_json_and_raw_bytes(server, path):
    @FUZZ
    @given(body=JSON.map(lambda j: ("json", j)) | st.binary(max_size=64).map(lambda b: ("bytes", b)))
    def run(body):
        kind, value = body
        _check(server, _post(server, path, value) if kind == "json" else _post(server, path, raw=value))

    run()
    _alive_and_unchanged(server)


def test_openapi_schema_with_schemathesis(server):
    """Positive and negative cases for every operation of /openapi.json (schemathesis)."""
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/generate",
        "/v1/completions",
        "/v1/chat/completions",
        "/update_weights_from_disk",
        "/pause_generation",
        "/health",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
    }
    for op in operations:
        strategy = op.as_strategy(GenerationMode.POSITIVE) | op.as_strategy(GenerationMode.NEGATIVE)

        @settings(max_examples=max(10, EXAMPLES // 5), deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def run(case):
            _bound_generation(case.body)
            response = case.call(base_url=server, headers=AUTH, timeout=120)
            case.validate_response(response, checks=[not_a_server_error, negative_data_rejection])
            _check(
                server,
                httpx.Response(
                    response.status_code,
                    content=response.content,
                    request=httpx.Request(case.method, server + case.path),
                ),
            )

        run()
    _alive_and_unchanged(server)


def _bound_generation(body: object) -> None:
    """Cap the token counts anywhere in a schema-valid body (batches included): a valid request
    for 2000 tokens is just slow."""
    if isinstance(body, list):
        for item in body:
            _bound_generation(item)
        return
    if not isinstance(body, dict):
        return
    for key in ("max_new_tokens", "max_tokens", "max_completion_tokens", "n"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 16:
            body[key] = 16
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 16
    for value in body.values():
        _bound_generation(value)
