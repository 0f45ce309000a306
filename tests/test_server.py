"""`relayrl serve` as a real process on 127.0.0.1: protocol, validation, auth, weights."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest
import safetensors.torch
import torch

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.data.models import build_tiny_model, chat_ids
from relayrl.inference.local import LocalEngine
from relayrl.inference.server.launcher import launch_servers

TOKEN = "s3cret"
PROMPT = [3, 20, 21, 22, 4]


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    outside = tmp_path_factory.mktemp("outside")
    return root, outside


@pytest.fixture(scope="module")
def server(roots):
    root, _ = roots
    group = launch_servers(1, admin_token=TOKEN, overrides=[f"allowed_weight_roots=['{root}']", "max_upload_mb=24"])
    yield f"http://{group.addresses[0]}"
    group.shutdown()


def reference(model, prompts, max_new):
    """Greedy outputs of the in-process LocalEngine for ``prompts``."""
    eng = LocalEngine(InferenceConfig(), model=model)
    eng.initialize()
    g = GenerationConfig(max_new_tokens=max_new, greedy=True, ignore_eos=True)

    async def go():
        return await asyncio.gather(*(eng.agenerate(ModelRequest(f"r{i}", p, g)) for i, p in enumerate(prompts)))

    try:
        return asyncio.run(go())
    finally:
        eng.destroy()


def gen(url, ids, **sp):
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, **sp},
        "return_logprob": True,
    }
    return httpx.post(url + "/generate", json=body, timeout=60)


def test_generate_matches_in_process_engine(server, tiny_model):
    prompts = [PROMPT, [3, 30, 31, 4], [3, 40, 41, 42, 43, 44, 4]]
    refs = reference(tiny_model, prompts, 8)
    for p, ref in zip(prompts, refs, strict=True):
        r = gen(server, p)
        assert r.status_code == 200, r.text
        out = r.json()
        meta = out["meta_info"]
        assert out["output_ids"] == ref.output_tokens
        lps = [t[0] for t in meta["output_token_logprobs"]]
        assert [t[1] for t in meta["output_token_logprobs"]] == ref.output_tokens
        assert lps == pytest.approx(ref.output_logprobs, abs=1e-4)
        assert all(x <= 0 for x in lps)
        assert meta["finish_reason"] == {"type": "length", "length": 8}
        assert meta["weight_version"] == "0" and meta["output_token_versions"] == [0] * 8
    sampled = gen(server, PROMPT, temperature=0.8, top_k=5, top_p=0.9).json()
    assert len(sampled["output_ids"]) == 8 and all(t[0] <= 0 for t in sampled["meta_info"]["output_token_logprobs"])
    # a vanishing temperature decodes greedily (as SGLang and vLLM do) instead of overflowing the logits
    tiny = gen(server, PROMPT, temperature=1e-300).json()
    assert tiny["output_ids"] == refs[0].output_tokens and tiny["meta_info"]["output_token_logprobs"] == out_lps(
        gen(server, PROMPT)
    )


def out_lps(r):
    return r.json()["meta_info"]["output_token_logprobs"]


def test_replies_never_hold_invalid_json():
    from relayrl.inference.server.app import _dumps

    assert (
        _dumps({"a": [float("-inf"), 1.5, {"b": float("nan")}], "c": "é"})
        == '{"a":[null,1.5,{"b":null}],"c":"é"}'.encode()
    )


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('{"input_ids": [3, 4', "malformed JSON"),
        ('{"input_ids": [3, 4], "colour": 1}', "unknown field 'colour'"),
        (
            '{"input_ids": [3, 4], "sampling_params": {"max_new_tokenz": 3}}',
            "unknown field 'sampling_params.max_new_tokenz'",
        ),
        ('{"input_ids": [3, 999]}', "input_ids[1]=999 is out of vocabulary"),
        ('{"input_ids": [3, -1]}', "input_ids[1]=-1"),
        ('{"input_ids": [3, 4], "sampling_params": {"top_p": 1.5}}', "sampling_params.top_p"),
        ('{"input_ids": [3, 4], "sampling_params": {"temperature": -1}}', "sampling_params.temperature"),
        ('{"input_ids": [3, 4], "sampling_params": {"max_new_tokens": -1}}', "sampling_params.max_new_tokens"),
        ('{"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 5}}', "min_new_tokens"),
        ('{"input_ids": [3, 4], "sampling_params": {"stop_token_ids": [5000]}}', "stop_token_ids[0]=5000"),
        ('{"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 5000}}', "exceeds the model"),
        ('{"input_ids": []}', "empty"),
        ('{"input_ids": "abc"}', "input_ids"),
        ('{"input_ids": [3, true]}', "input_ids[1]: Input should be a valid integer"),  # a boolean is not a token id
        ('{"input_ids": [3, "4"]}', "input_ids[1]: Input should be a valid integer"),
        ("[1, 2]", "body"),
        ('{"input_ids": [3, 4], "return_routed_experts": true}', "return_routed_experts: the served model has no"),
    ],
)
def test_bad_requests_get_4xx_naming_the_field(server, body, needle):
    r = httpx.post(server + "/generate", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_batch_generate_matches_single_requests(server, tiny_model):
    """SGLang's batch form: one reply per prompt, in order, each as the single form answers it."""
    prompts = [PROMPT, [3, 30, 31, 4], [3, 40, 41, 42, 43, 44, 4]]
    refs = reference(tiny_model, prompts, 8)
    toks = refs[2].output_tokens
    k = next((k for k in range(1, len(toks)) if toks[k] not in toks[:k]), 0)  # stop at the first new token
    info = httpx.get(server + "/get_model_info", timeout=10).json()
    calls0, served0 = info["generate_calls"], info["requests_served"]
    body = {
        "input_ids": prompts,
        "return_logprob": True,
        "rid": ["a", "b", "c"],
        "sampling_params": [
            {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
            {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [toks[k]]},
        ],
    }
    r = httpx.post(server + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and [o["meta_info"]["id"] for o in out] == ["a", "b", "c"]
    assert out[0]["output_ids"] == refs[0].output_tokens and out[0]["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 8,
    }
    assert out[1]["output_ids"] == refs[1].output_tokens[:3] and out[1]["meta_info"]["completion_tokens"] == 3
    assert out[2]["output_ids"] == toks[: k + 1] and out[2]["meta_info"]["finish_reason"]["type"] == "stop"
    for o, ref in zip(out, refs, strict=True):
        n = len(o["output_ids"])
        assert [t[0] for t in o["meta_info"]["output_token_logprobs"]] == pytest.approx(
            ref.output_logprobs[:n], abs=1e-4
        )
        assert o["meta_info"]["output_token_versions"] == [0] * n
    single = gen(server, PROMPT).json()  # the same item alone: the same reply (timings aside)
    assert {k: v for k, v in single.items() if k != "meta_info"} == {
        k: v for k, v in out[0].items() if k != "meta_info"
    }
    assert set(single["meta_info"]) == set(out[0]["meta_info"])
    # shared sampling_params / return_logprob and a rid prefix; text prompts
    shared = httpx.post(
        server + "/generate",
        json={
            "input_ids": prompts[:2],
            "rid": "grp",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        },
        timeout=60,
    ).json()
    assert [o["output_ids"] for o in shared] == [refs[0].output_tokens, refs[1].output_tokens]
    assert [o["meta_info"]["id"] for o in shared] == ["grp-0", "grp-1"] and "output_token_logprobs" not in shared[0][
        "meta_info"
    ]
    texts = httpx.post(
        server + "/generate", json={"text": ["1+1=", "2+2="], "sampling_params": {"max_new_tokens": 2}}, timeout=60
    )
    assert texts.status_code == 200 and [len(o["output_ids"]) for o in texts.json()] == [2, 2]
    info = httpx.get(server + "/get_model_info", timeout=10).json()
    assert (info["generate_calls"] - calls0, info["requests_served"] - served0) == (4, 8)  # a batch is one call


def test_batch_items_stream_as_they_finish(server, tiny_model):
    """relayrl's ``stream_items``: one NDJSON line per item, in finishing order, each the item's reply."""
    prompts = [PROMPT, [3, 30, 31, 4], [3, 40, 41, 4]]
    lengths = [60, 2, 5]
    refs = reference(tiny_model, prompts, 60)
    sps = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in lengths]
    body = {
        "input_ids": prompts,
        "sampling_params": sps,
        "return_logprob": True,
        "rid": ["a", "b", "c"],
        "stream_items": True,
    }
    with httpx.stream("POST", server + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert sorted(x["index"] for x in lines) == [0, 1, 2] and lines[-1]["index"] == 0  # the longest comes last
    for x in lines:
        i = x["index"]
        assert x["meta_info"]["id"] == "abc"[i] and x["output_ids"] == refs[i].output_tokens[: lengths[i]]
        assert [t[0] for t in x["meta_info"]["output_token_logprobs"]] == pytest.approx(
            refs[i].output_logprobs[: lengths[i]], abs=1e-4
        )
    bad = httpx.post(server + "/generate", json={**body, "input_ids": [PROMPT, [3, 999], PROMPT]}, timeout=60)
    assert (
        bad.status_code == 400 and "input_ids[1][1]=999" in bad.json()["error"]["message"]
    )  # validated before streaming


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('{"input_ids": [[3, 4], [3, 999]]}', "input_ids[1][1]=999 is out of vocabulary"),
        ('{"input_ids": [[3, 4], []]}', "input_ids[1]: the prompt is empty"),
        ('{"input_ids": [[3, 4], 5]}', "input_ids[1]: Input should be a valid list"),
        ('{"input_ids": [[3, 4], [3, 5]], "sampling_params": [{}, {"top_p": 1.5}]}', "sampling_params[1].top_p"),
        (
            '{"input_ids": [[3, 4], [3, 5]], "sampling_params": [{}, {"max_new_tokenz": 1}]}',
            "unknown field 'sampling_params[1].max_new_tokenz'",
        ),
        ('{"input_ids": [[3, 4], [3, 5]], "sampling_params": [{}]}', "sampling_params: 1 values for 2 prompts"),
        ('{"input_ids": [[3, 4], [3, 5]], "rid": ["a"]}', "rid: 1 values for 2 prompts"),
        (
            '{"input_ids": [[3, 4], [3, 5]], "return_logprob": [true, 1, false]}',
            "return_logprob: 3 values for 2 prompts",
        ),
        (
            '{"input_ids": [[3, 4], [3, 5]], "sampling_params": [{}, {"max_new_tokens": 5000}]}',
            "input_ids[1]: input length 2 + sampling_params[1].max_new_tokens=5000 exceeds",
        ),
        (
            '{"input_ids": [[3, 4], [3, 5]], "sampling_params": [{}, {"stop_token_ids": [7000]}]}',
            "sampling_params[1].stop_token_ids[0]=7000",
        ),
        ('{"input_ids": [[3, 4]], "text": ["a"]}', "exactly one of input_ids or text"),
        ('{"input_ids": [[3, 4]], "colour": 1}', "unknown field 'colour'"),
        ('{"input_ids": [[3, 4], [3, 5]], "return_routed_experts": [false, true]}', "return_routed_experts[1]: the"),
    ],
)
def test_bad_batches_get_4xx_naming_the_item(server, body, needle):
    served = httpx.get(server + "/get_model_info", timeout=10).json()["requests_served"]
    r = httpx.post(server + "/generate", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()["error"]["message"]
    assert httpx.get(server + "/get_model_info", timeout=10).json()["requests_served"] == served  # nothing generated


def test_admin_needs_the_token(server):
    assert httpx.post(server + "/pause_generation", timeout=10).status_code == 401
    bad = httpx.post(server + "/pause_generation", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert bad.status_code == 403
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(server + "/pause_generation", headers=auth, timeout=10).json()["success"] is True
    assert httpx.get(server + "/get_model_info", timeout=10).json()["paused"] is True
    assert httpx.post(server + "/continue_generation", headers=auth, timeout=10).status_code == 200
    assert gen(server, PROMPT).status_code == 200  # generation is not admin
    no_auth_update = httpx.post(server + "/update_weights_from_disk", json={"model_path": "/tmp"}, timeout=10)
    assert no_auth_update.status_code == 401


def test_weight_group_routes_are_admin_and_validate(server):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    init = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2}
    update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[320]]}
    for path, body in (
        ("/init_weights_update_group", init),
        ("/update_weights_from_distributed", update),
        ("/destroy_weights_update_group", {}),
    ):
        assert httpx.post(server + path, json=body, timeout=10).status_code == 401, path
    r = httpx.post(server + "/update_weights_from_distributed", json=update, headers=auth, timeout=10)
    assert r.status_code == 400 and "no weight group 'weight_update_group'" in r.json()["error"]["message"]
    for field, value in (
        ("world_size", 1),
        ("world_size", 2**70),
        ("rank_offset", 0),
        ("backend", "mpi"),
        ("master_port", 70000),
    ):
        r = httpx.post(server + "/init_weights_update_group", json={**init, field: value}, headers=auth, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(field), (field, r.text)
    r = httpx.post(server + "/init_weights_update_group", json={**init, "rank_offset": 2}, headers=auth, timeout=10)
    assert r.status_code == 400 and "rank_offset=2 must be below world_size=2" in r.json()["error"]["message"], r.text
    r = httpx.post(server + "/destroy_weights_update_group", json={}, headers=auth, timeout=10)
    assert r.status_code == 200 and r.json()["success"] is False
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_disk_paths_are_confined(server, roots):
    root, outside = roots
    auth = {"Authorization": f"Bearer {TOKEN}"}
    (root / "sub").mkdir()
    safetensors.torch.save_file({"x": torch.zeros(1)}, str(outside / "model.safetensors"))
    os.symlink(outside, root / "link")
    cases = [str(root / "sub" / ".." / ".." / outside.name), str(outside), str(root / "link"), "/etc"]
    for path in cases:
        r = httpx.post(server + "/update_weights_from_disk", json={"model_path": path}, headers=auth, timeout=10)
        assert r.status_code == 403, (path, r.text)
    r = httpx.post(
        server + "/update_weights_from_disk", json={"model_path": str(root / "sub")}, headers=auth, timeout=10
    )
    assert r.status_code == 400 and "no *.safetensors" in r.json()["error"]["message"]
    assert httpx.get(server + "/get_weight_version", timeout=10).json()["weight_version"] == "0"


def test_weights_from_disk_and_upload(server, roots):
    root, _ = roots
    auth = {"Authorization": f"Bearer {TOKEN}"}
    new = build_tiny_model("tiny", seed=1).eval()
    state = {k: v.clone() for k, v in new.state_dict().items()}
    (root / "v1").mkdir()
    safetensors.torch.save_file(state, str(root / "v1" / "model.safetensors"))
    r = httpx.post(
        server + "/update_weights_from_disk",
        json={"model_path": str(root / "v1"), "weight_version": 1},
        headers=auth,
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["weight_version"] == "1", r.text
    assert httpx.get(server + "/get_weight_version", timeout=10).json()["weight_version"] == "1"
    ref = reference(new, [PROMPT], 8)[0]
    out = gen(server, PROMPT).json()
    assert out["output_ids"] == ref.output_tokens and out["meta_info"]["output_token_versions"] == [1] * 8

    # upload: a wrong shape is refused, a good payload lands with its version, an oversized one gets 413
    bad = safetensors.torch.save({"model.norm.weight": torch.ones(7)})
    r = httpx.post(server + "/update_weights_from_tensor?weight_version=9", content=bad, headers=auth, timeout=60)
    assert r.status_code == 400 and "model.norm.weight" in r.json()["error"]["message"]
    partial = safetensors.torch.save({"model.norm.weight": torch.ones(320)})
    r = httpx.post(server + "/update_weights_from_tensor?weight_version=9", content=partial, headers=auth, timeout=60)
    assert r.status_code == 400 and "missing" in r.json()["error"]["message"]
    r = httpx.post(
        server + "/update_weights_from_tensor?weight_version=9", content=b"garbage", headers=auth, timeout=60
    )
    assert r.status_code == 400 and "safetensors" in r.json()["error"]["message"]
    r = httpx.post(
        server + "/update_weights_from_tensor?weight_version=9", content=b"\0" * (25 << 20), headers=auth, timeout=60
    )
    assert r.status_code == 413
    orig = {k: v.clone() for k, v in build_tiny_model("tiny", seed=0).state_dict().items()}
    r = httpx.post(
        server + "/update_weights_from_tensor?weight_version=2",
        content=safetensors.torch.save(orig),
        headers=auth,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert httpx.get(server + "/get_weight_version", timeout=10).json()["weight_version"] == "2"
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_a_prompt_is_scored_for_a_distillation_teacher_as_sglang_scores_it(server, tiny_model):
    """``max_new_tokens: 0`` + ``logprob_start_len`` + ``top_logprobs_num`` (what ``actor.teacher.url`` with
    ``protocol: sglang`` sends): the prompt's top-k are a teacher-forced forward's, nothing is generated."""
    from tests.real_peers.servers import check_teacher_server

    check_teacher_server(server, "sglang", tiny_model)  # the top 5 per position, within 1e-4 (also at T=0.5)
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    meta = httpx.post(server + "/generate", json={**body, "logprob_start_len": 2}, timeout=30).json()["meta_info"]
    with torch.inference_mode():
        logp = torch.log_softmax(tiny_model(torch.tensor([PROMPT])).logits[0].float(), -1)
    want = [float(logp[t - 1, PROMPT[t]]) for t in range(2, len(PROMPT))]
    assert [e[1] for e in meta["input_token_logprobs"]] == PROMPT[2:] and meta["completion_tokens"] == 0
    assert max(abs(e[0] - w) for e, w in zip(meta["input_token_logprobs"], want, strict=True)) <= 1e-4
    # after generation too (SGLang's input logprobs of a generating request), first token null
    out = gen(server, PROMPT, max_new_tokens=2)
    assert "input_token_logprobs" not in out.json()["meta_info"]
    r = httpx.post(
        server + "/generate", json={**body, "sampling_params": {"max_new_tokens": 2}, "logprob_start_len": 0}
    )
    assert (
        r.json()["meta_info"]["input_token_logprobs"][0] == [None, PROMPT[0], None] and len(r.json()["output_ids"]) == 2
    )
    for bad, needle in (
        ({"logprob_start_len": 5}, "logprob_start_len=5 must be a prompt position"),
        ({"top_logprobs_num": 3}, "for top_logprobs_num"),
        ({"logprob_start_len": 0, "top_logprobs_num": 101}, "top_logprobs_num"),
    ):
        r = httpx.post(server + "/generate", json={**body, **bad}, timeout=30)
        assert r.status_code == 400 and needle in r.text, r.text
    batch = {"input_ids": [PROMPT, PROMPT], "sampling_params": {"max_new_tokens": 0}}
    r = httpx.post(server + "/generate", json=batch, timeout=30)
    assert r.status_code == 400 and "is for a single /generate request" in r.text, r.text
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_openai_endpoints(server, tiny_model, tokenizer):
    prompt = "12+3="
    ids = [int(i) for i in tokenizer.encode(prompt)]
    ref = reference(tiny_model, [ids], 6)[0]
    # what the OpenAI SDK's client.completions.create(model=..., prompt=..., max_tokens=6, temperature=0, logprobs=0) sends
    r = httpx.post(
        server + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["token_ids"] == ref.output_tokens and ch["finish_reason"] in ("length", "stop")
    assert ch["logprobs"]["token_logprobs"] == pytest.approx(ref.output_logprobs, abs=1e-4)
    assert r.json()["usage"]["completion_tokens"] == 6
    # token-id prompts (vLLM style) give the same
    r2 = httpx.post(server + "/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0}, timeout=60)
    assert r2.json()["choices"][0]["token_ids"] == ref.output_tokens
    # a list of prompts: choice p * n + j is sample j of prompt p (vLLM's order)
    other = [3, 30, 31, 4]
    oref = reference(tiny_model, [other], 6)[0]
    r3 = httpx.post(
        server + "/v1/completions",
        json={
            "prompt": [ids, other],
            "max_tokens": 6,
            "temperature": 0,
            "n": 2,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
        timeout=60,
    )
    assert r3.status_code == 200, r3.text
    chs = r3.json()["choices"]
    assert [c["index"] for c in chs] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in chs] == [ref.output_tokens] * 2 + [oref.output_tokens] * 2
    assert chs[2]["logprobs"]["tokens"] == [f"token_id:{t}" for t in oref.output_tokens]
    assert r3.json()["usage"] == {"prompt_tokens": len(ids) + 4, "completion_tokens": 24, "total_tokens": len(ids) + 28}
    r4 = httpx.post(server + "/v1/completions", json={"prompt": ["1+1=", "2+2="], "max_tokens": 2}, timeout=60)
    assert r4.status_code == 200 and len(r4.json()["choices"]) == 2
    bad = httpx.post(server + "/v1/completions", json={"prompt": [ids, [3, 999]], "max_tokens": 2}, timeout=60)
    assert bad.status_code == 400 and "prompt[1][1]=999" in bad.json()["error"]["message"]

    messages = [{"role": "user", "content": "2+2?"}]
    cref = reference(tiny_model, [chat_ids(tokenizer, messages)], 5)[0]
    r = httpx.post(
        server + "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True, "n": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and len(body["choices"]) == 2
    for ch in body["choices"]:
        assert ch["message"]["role"] == "assistant"
        assert [c["logprob"] for c in ch["logprobs"]["content"]] == pytest.approx(cref.output_logprobs, abs=1e-4)
        assert ch["token_ids"] == cref.output_tokens
    bad = httpx.post(
        server + "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}, timeout=10
    )
    assert bad.status_code == 400 and "messages[0].role" in bad.json()["error"]["message"]
    assert httpx.post(server + "/v1/completions", json={"prompt": "x", "echo": True}, timeout=10).status_code == 400
    many = httpx.post(server + "/v1/completions", json={"prompt": ["x", "y"], "stream": True}, timeout=10)
    assert many.status_code == 400 and "one prompt per streamed request" in many.json()["error"]["message"]
    info = httpx.get(server + "/get_model_info", timeout=10).json()
    assert info["vocab_size"] == tiny_model.config.vocab_size and info["is_generation"] is True
    schema = httpx.get(server + "/openapi.json", timeout=10).json()
    assert {"/generate", "/v1/completions", "/v1/chat/completions", "/update_weights_from_disk"} <= set(schema["paths"])


def test_a_stale_broadcast_failing_late_leaves_the_new_weight_group_alone(server, tiny_model):
    """A broadcast abandoned by the trainer fails on the server only when its group goes away,
    possibly after a new group of the same name was joined: the new group must survive it."""
    import gc
    import threading

    from relayrl.inference.weight_group import WeightBroadcastGroup, dtype_name

    auth = {"Authorization": f"Bearer {TOKEN}"}
    weights = dict(sorted(tiny_model.state_dict().items()))  # what the server serves: no visible change
    update = {
        "names": list(weights),
        "dtypes": [dtype_name(t.dtype) for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
        "weight_version": 0,
    }

    def join() -> WeightBroadcastGroup:
        group = WeightBroadcastGroup("127.0.0.1", 0, 2, 0, "gloo", timeout_s=60)
        init = {
            "master_address": "127.0.0.1",
            "master_port": group.port,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "gloo",
        }
        reply: list[httpx.Response] = []
        t = threading.Thread(
            target=lambda: reply.append(
                httpx.post(server + "/init_weights_update_group", json=init, headers=auth, timeout=60)
            )
        )
        t.start()
        group.join()
        t.join()
        assert reply[0].status_code == 200, reply[0].text
        return group

    old = join()
    stale: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: stale.append(
            httpx.post(server + "/update_weights_from_distributed", json=update, headers=auth, timeout=60)
        )
    )
    t.start()  # the server waits for a broadcast the trainer never sends
    time.sleep(0.5)
    new = join()  # the trainer gave up on the old group and built a new one
    del old
    gc.collect()  # the old group's connections close: the stale receive fails now
    t.join(timeout=60)
    assert stale and stale[0].status_code == 500 and "failed" in stale[0].json()["error"]["message"]
    reply: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: reply.append(
            httpx.post(server + "/update_weights_from_distributed", json=update, headers=auth, timeout=60)
        )
    )
    t.start()
    new.broadcast(weights)
    t.join(timeout=60)
    assert reply[0].status_code == 200 and reply[0].json()["weight_version"] == "0", reply[0].text
