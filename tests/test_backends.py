"""Request/response mapping of each server protocol, against the payloads their docs show.

SGLang: docs "Sampling Parameters" / "Native APIs" (``/generate`` with ``input_ids``,
``sampling_params``, ``return_logprob``; ``meta_info.output_token_logprobs`` as
``[logprob, token_id, text]``; ``finish_reason`` ``{"type": "length", "length": n}``;
``/update_weights_from_disk`` ``{"model_path"}`` -> ``{"success", "message"}``).
vLLM: OpenAI completions with token-id prompts, ``logprobs``, ``return_tokens_as_token_ids``
(tokens read ``"token_id:<id>"``), RL routes ``/pause?mode=abort`` and ``/resume``.
"""

from __future__ import annotations

import pytest

from relayrl.api.io import GenerationConfig
from relayrl.inference.remote import vllm_transfer
from relayrl.inference.remote.peers import make_backend
from relayrl.inference.remote.protocol import ProtocolError
from relayrl.inference.remote.relayrl import RelayrlBackend
from relayrl.inference.remote.sglang import SGLangBackend
from relayrl.inference.remote.vllm import VLLMBackend

G = GenerationConfig(
    max_new_tokens=16,
    min_new_tokens=2,
    temperature=0.7,
    top_p=0.9,
    top_k=0,
    stop=["\n\n"],
    stop_token_ids=[7],
    ignore_eos=False,
)

# A reply in the shape of SGLang's documented /generate output (return_logprob=True).
SGLANG_REPLY = {
    "text": " Paris.",
    "output_ids": [12366, 13],
    "meta_info": {
        "id": "a1b2",
        "finish_reason": {"type": "stop", "matched": 151645},
        "prompt_tokens": 7,
        "weight_version": "3",
        "completion_tokens": 2,
        "cached_tokens": 0,
        "output_token_logprobs": [[-0.25, 12366, None], [-1.5, 13, None]],
        "e2e_latency": 0.05,
    },
}

# A reply in the shape of vLLM's /v1/completions with return_tokens_as_token_ids=True.
VLLM_REPLY = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "text": " Paris.",
            "finish_reason": "length",
            "stop_reason": None,
            "logprobs": {
                "text_offset": [0, 6],
                "token_logprobs": [-0.25, -1.5],
                "tokens": ["token_id:12366", "token_id:13"],
                "top_logprobs": None,
            },
        }
    ],
    "usage": {"prompt_tokens": 7, "total_tokens": 9, "completion_tokens": 2},
}


def test_sglang_generate_request_matches_documented_fields():
    call = SGLangBackend().generate("rid-1", [1, 2, 3], G, 10, 2)
    assert (call.method, call.path) == ("POST", "/generate")
    body = call.json
    assert body["input_ids"] == [1, 2, 3] and body["return_logprob"] is True and body["rid"] == "rid-1"
    sp = body["sampling_params"]
    assert sp == {
        "max_new_tokens": 10,
        "min_new_tokens": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "stop": ["\n\n"],
        "stop_token_ids": [7],
        "ignore_eos": False,
        "skip_special_tokens": False,
    }
    greedy = SGLangBackend().generate("r", [1], G.new(greedy=True, top_k=5), 4, 0).json["sampling_params"]
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 5


def test_sglang_reply_parsing():
    p = SGLangBackend().parse_generate(SGLANG_REPLY)
    assert p.tokens == [12366, 13] and p.logprobs == [-0.25, -1.5]
    assert p.stop_reason == "stop" and p.weight_version == 3 and p.versions is None
    batch = SGLangBackend().parse_generate([SGLANG_REPLY])  # a batch of one is a list
    assert batch.tokens == [12366, 13]
    aborted = {
        **SGLANG_REPLY,
        "meta_info": {**SGLANG_REPLY["meta_info"], "finish_reason": {"type": "abort", "message": "x"}},
    }
    assert SGLangBackend().parse_generate(aborted).stop_reason == "abort"
    length = {
        **SGLANG_REPLY,
        "meta_info": {**SGLANG_REPLY["meta_info"], "finish_reason": {"type": "length", "length": 2}},
    }
    assert SGLangBackend().parse_generate(length).stop_reason == "length"
    with pytest.raises(ProtocolError, match="meta_info"):
        SGLangBackend().parse_generate({"text": "x"})
    bad = {**SGLANG_REPLY, "output_ids": [1, 2, 3]}
    with pytest.raises(ProtocolError, match="3 output_ids but 2"):
        SGLangBackend().parse_generate(bad)


def test_relayrl_reply_carries_per_token_versions():
    reply = {
        **SGLANG_REPLY,
        "meta_info": {**SGLANG_REPLY["meta_info"], "output_token_versions": [2, 3], "weight_version": 3},
    }
    p = RelayrlBackend().parse_generate(reply)
    assert p.versions == [2, 3] and p.weight_version == 3


def test_weight_and_control_calls():
    sg, rr, vl = SGLangBackend(), RelayrlBackend(), VLLMBackend()
    c = sg.update_from_disk("/ckpt/v3", 3)
    assert (c.path, c.json["model_path"], c.json["weight_version"], c.json["abort_all_requests"]) == (
        "/update_weights_from_disk",
        "/ckpt/v3",
        "3",
        True,
    )
    assert rr.update_from_disk("/ckpt/v3", 3).json == {"model_path": "/ckpt/v3", "weight_version": 3}
    assert rr.upload(4).path == "/update_weights_from_tensor?weight_version=4"
    with pytest.raises(NotImplementedError, match="weight_sync=disk"):
        sg.upload(1)
    assert (sg.pause().path, sg.resume().path) == ("/pause_generation", "/continue_generation")
    assert (vl.pause().path, vl.resume().path) == ("/pause?mode=abort", "/resume")
    vc = vl.update_from_disk("/w", 1)
    assert (vc.method, vc.path) == ("POST", "/collective_rpc")
    assert vc.json == {"method": "reload_weights", "kwargs": {"weights_path": "/w"}}
    assert sg.parse_version({"weight_version": "7"}) == 7
    assert vl.parse_version({"weight_version": "7"}) == 7 and vl.parse_version({"weight_version": None}) is None
    sg.parse_update({"success": True, "message": "ok", "num_paused_requests": 0})
    with pytest.raises(RuntimeError, match="refused: bad path"):
        sg.parse_update({"success": False, "message": "bad path"})


def test_weight_broadcast_calls_are_sglangs_documented_bodies():
    """SGLang's InitWeightsUpdateGroupReqInput / UpdateWeightsFromDistributedReqInput fields."""
    sg = SGLangBackend()
    init = sg.init_weight_group("10.0.0.5", 29500, 2, 3, "nccl")
    assert (init.method, init.path) == ("POST", "/init_weights_update_group")
    assert init.json == {
        "master_address": "10.0.0.5",
        "master_port": 29500,
        "rank_offset": 2,
        "world_size": 3,
        "group_name": "weight_update_group",
        "backend": "nccl",
    }
    up = sg.update_distributed(["a.weight", "b.bias"], ["bfloat16", "float32"], [[4, 2], [4]], 9)
    assert (up.method, up.path) == ("POST", "/update_weights_from_distributed")
    assert up.json == {
        "names": ["a.weight", "b.bias"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[4, 2], [4]],
        "group_name": "weight_update_group",
        "weight_version": "9",
        "abort_all_requests": True,
    }
    assert RelayrlBackend().init_weight_group("h", 1, 1, 2, "gloo").json == {
        **init.json,
        "master_address": "h",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",
    }


def test_vllm_weight_transfer_calls_are_vllms_request_bodies():
    """vLLM's RL router: {"init_info": NCCLWeightTransferInitInfo fields}, {"update_info": NCCLWeightTransferUpdateInfo
    fields} (packed buffers of the bucket size), the disk backend's {"path"} and the session routes."""
    init = vllm_transfer.init_transfer("10.0.0.5", 29500, 1, 3)
    assert (init.path, init.json) == (
        "/init_weight_transfer_engine",
        {"init_info": {"master_address": "10.0.0.5", "master_port": 29500, "rank_offset": 1, "world_size": 3}},
    )
    assert vllm_transfer.init_disk_transfer().json == {"init_info": {}}
    up = vllm_transfer.transfer_update(["a", "b"], ["bfloat16", "float32"], [[4, 2], [4]], 1 << 20)
    assert (up.path, up.json) == (
        "/update_weights",
        {
            "update_info": {
                "names": ["a", "b"],
                "dtype_names": ["bfloat16", "float32"],
                "shapes": [[4, 2], [4]],
                "packed": True,
                "packed_buffer_size_bytes": 1 << 20,
            }
        },
    )
    assert vllm_transfer.disk_update("/w/v1").json == {"update_info": {"path": "/w/v1"}}
    assert (
        vllm_transfer.start_update().path,
        vllm_transfer.finish_update(4).path,
        vllm_transfer.finish_update(4).json,
    ) == (
        "/start_weight_update",
        "/finish_weight_update",
        {"weight_version": "4"},
    )


def test_vllm_completion_request_and_reply():
    call = VLLMBackend(model="m").generate("r9", [5, 6], G, 12, 1)
    assert (call.method, call.path) == ("POST", "/v1/completions")
    b = call.json
    assert b["prompt"] == [5, 6] and b["max_tokens"] == 12 and b["min_tokens"] == 1 and b["model"] == "m"
    assert b["logprobs"] == 0 and b["return_tokens_as_token_ids"] is True and b["top_k"] == -1
    assert b["stop_token_ids"] == [7] and b["temperature"] == 0.7 and b["n"] == 1 and b["stream"] is False
    p = VLLMBackend().parse_generate(VLLM_REPLY)
    assert p.tokens == [12366, 13] and p.logprobs == [-0.25, -1.5] and p.stop_reason == "length"
    with_ids = {**VLLM_REPLY, "choices": [{**VLLM_REPLY["choices"][0], "token_ids": [1, 2], "finish_reason": "stop"}]}
    assert VLLMBackend().parse_generate(with_ids).tokens == [1, 2]
    texts = {
        **VLLM_REPLY,
        "choices": [
            {**VLLM_REPLY["choices"][0], "logprobs": {"tokens": [" Paris", "."], "token_logprobs": [-0.1, -0.2]}}
        ],
    }
    with pytest.raises(ProtocolError, match="token_id"):
        VLLMBackend().parse_generate(texts)


def test_make_backend():
    assert [make_backend(p).name for p in ("relayrl", "sglang", "vllm")] == ["relayrl", "sglang", "vllm"]
    with pytest.raises(ValueError, match="protocol"):
        make_backend("tgi")


def test_sglang_batch_is_the_documented_batch_form():
    """SGLang's GenerateReqInput: ``rid`` / ``input_ids`` / ``sampling_params`` as lists, one per item;
    the reply is a list of per-item replies."""
    sg = SGLangBackend()
    calls = [sg.generate(f"r{i}", [1, 2 + i], G.new(max_new_tokens=4 + i), 4 + i, 0) for i in range(3)]
    [(call, idx)] = sg.batch(calls)
    assert (call.method, call.path, idx) == ("POST", "/generate", [0, 1, 2])
    b = call.json
    assert b["rid"] == ["r0", "r1", "r2"] and b["input_ids"] == [[1, 2], [1, 3], [1, 4]]
    assert [sp["max_new_tokens"] for sp in b["sampling_params"]] == [4, 5, 6]
    assert b["sampling_params"][0] == calls[0].json["sampling_params"] and b["return_logprob"] is True
    assert sg.batch(calls[:1]) == [(calls[0], [0])]  # one item keeps the single form
    assert "stream_items" not in call.json and not sg.streams_items
    rr = RelayrlBackend()  # relayrl's server answers a batch item by item (NDJSON) as items finish
    [(rcall, _)] = rr.batch([rr.generate(f"r{i}", [1], G, 4, 0) for i in range(2)])
    assert rcall.json["stream_items"] is True and rr.streams_items
    assert "stream_items" not in rr.batch([calls[0]])[0][0].json
    reply = [
        SGLANG_REPLY,
        {
            **SGLANG_REPLY,
            "output_ids": [7],
            "meta_info": {
                **SGLANG_REPLY["meta_info"],
                "output_token_logprobs": [[-0.5, 7, None]],
                "finish_reason": {"type": "length"},
            },
        },
    ]
    parts = [sg.parse_generate(x) for x in sg.split(reply, 2)]
    assert [p.tokens for p in parts] == [[12366, 13], [7]] and [p.stop_reason for p in parts] == ["stop", "length"]
    with pytest.raises(ProtocolError, match="of 3 items answered 2 items"):
        sg.split(reply, 3)
    with pytest.raises(ProtocolError, match="answered dict"):
        sg.split(SGLANG_REPLY, 2)


def test_vllm_batch_shares_one_call_per_set_of_sampling_params():
    """vLLM's /v1/completions takes a list of token-id prompts with one set of sampling parameters;
    choice i (n=1) answers prompt i."""
    vl = VLLMBackend(model="m")
    calls = [
        vl.generate("a", [1, 2], G, 8, 0),
        vl.generate("b", [3], G, 8, 0),
        vl.generate("c", [4], G, 5, 0),
        vl.generate("d", [5, 6], G, 8, 0),
    ]
    groups = vl.batch(calls)
    assert [idx for _, idx in groups] == [[0, 1, 3], [2]]
    (shared, _), (alone, _) = groups
    assert shared.path == "/v1/completions" and shared.json["prompt"] == [[1, 2], [3], [5, 6]]
    assert {k: v for k, v in shared.json.items() if k not in ("prompt", "request_id")} == {
        k: v for k, v in calls[0].json.items() if k not in ("prompt", "request_id")
    }
    assert alone is calls[2]
    choice = VLLM_REPLY["choices"][0]
    reply = {
        **VLLM_REPLY,
        "choices": [
            {**choice, "index": 1, "token_ids": [9]},
            {**choice, "index": 0},
            {**choice, "index": 2, "finish_reason": "stop"},
        ],
    }
    reply["choices"][0]["logprobs"] = {"token_logprobs": [-0.1], "tokens": ["token_id:9"]}
    parts = [vl.parse_generate(x) for x in vl.split(reply, 3)]
    assert [p.tokens for p in parts] == [[12366, 13], [9], [12366, 13]]
    assert [p.stop_reason for p in parts] == ["length", "length", "stop"]
    with pytest.raises(ProtocolError, match="of 2 prompts answered 3 choices"):
        vl.split(reply, 2)


def _getter(routes: dict[str, object]):
    return lambda path: (200, routes[path]) if path in routes else (404, {"detail": "Not Found"})


def test_peer_detection_picks_the_routes_each_version_has():
    from relayrl.inference.remote.protocol import UnsupportedServer, version_tuple
    from relayrl.inference.remote.vllm_transfer import require_routes

    assert version_tuple("0.5.3.post1") == (0, 5, 3) and version_tuple("0.4.10rc1") == (0, 4, 10)
    old_layout = {
        "/get_server_info": {"version": "0.5.2", "tp_size": 2},
        "/get_model_info": {"model_path": "m"},
        "/get_weight_version": {"weight_version": "default"},
    }
    info = make_backend("sglang").detect("u", _getter(old_layout))
    assert (info.tp_size, info.version_path, info.live_path) == (2, "/get_weight_version", "/get_model_info")
    new_layout = {"/server_info": {"version": "0.5.15"}, "/model_info": {"model_path": "m", "weight_version": "3"}}
    info = make_backend("sglang").detect("u", _getter(new_layout))
    assert (info.tp_size, info.version_path, info.live_path) == (1, "/model_info", "/model_info")
    with pytest.raises(UnsupportedServer, match=r"SGLang 0\.4\.9; relayrl needs SGLang >= 0\.5\.0"):
        make_backend("sglang").detect("u", _getter({"/get_server_info": {"version": "0.4.9"}}))
    with pytest.raises(UnsupportedServer, match="neither /get_server_info nor /server_info"):
        make_backend("sglang").detect("u", _getter({}))
    vllm = {
        "/version": {"version": "0.15.0"},
        "/v1/models": {"data": [{"id": "Qwen/Qwen3-8B"}]},
        "/openapi.json": {"paths": {"/v1/completions": {}, "/health": {}}},
    }
    info = make_backend("vllm").detect("u", _getter(vllm))
    assert info.model == "Qwen/Qwen3-8B" and info.version_path is None
    with pytest.raises(UnsupportedServer, match=r"/pause .*/collective_rpc \(VLLM_SERVER_DEV_MODE=1"):
        require_routes(info, "u", "disk")
    with pytest.raises(UnsupportedServer, match="lists no served model"):
        make_backend("vllm").detect("u", _getter({**vllm, "/v1/models": {"data": []}}))


def test_broadcast_buckets_carry_the_version_last_and_the_abort_first():
    sg = SGLangBackend()
    first = sg.update_distributed(["a"], ["float32"], [[2]], None, abort=True).json
    last = sg.update_distributed(["b"], ["float32"], [[2]], 7, abort=False).json
    assert "weight_version" not in first and first["abort_all_requests"] is True
    assert last["weight_version"] == "7" and last["abort_all_requests"] is False
    assert sg.destroy_weight_group().path == "/destroy_weights_update_group"
