"""Images over the wire: a real `relayrl serve` process (tiny Qwen2-VL) takes SGLang's ``image_data``
and OpenAI image content parts; RemoteEngine sends ``ModelRequest.image_data`` in SGLang's form, and
to vLLM (its stand-in) as rendered features on the token-in route.

Every completion is checked against an independent reference: the same seeded model in this
process, one teacher-forced Hugging Face forward over prompt + completion with the images.
"""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest
import torch

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.data.models import build_tiny_vl_model, build_vl_tokenizer
from relayrl.data.vision import build_image_processor, encode_prompt
from relayrl.inference.remote import RemoteEngine
from relayrl.inference.remote.protocol import PeerInfo, UnsupportedServer, wire_image
from relayrl.inference.remote.vllm import IMAGE_ROUTES, VLLMBackend, require_image_routes
from relayrl.inference.server.launcher import launch_servers
from tests.test_vision import squares, teacher_forced_logprobs


@pytest.fixture(scope="module")
def served():
    group = launch_servers(1, model="tiny-vl")
    yield f"http://{group.addresses[0]}", group
    group.shutdown()


@pytest.fixture(scope="module")
def local():
    tok, proc = build_vl_tokenizer(), build_image_processor()
    return tok, proc, build_tiny_vl_model("tiny-vl", seed=0).eval()  # the server's model (seed 0)


def check(model, vp, tokens, logprobs, temperature=1.0):
    ref = teacher_forced_logprobs(model, vp, tokens, temperature)
    assert torch.allclose(torch.tensor(logprobs), ref, atol=1e-4)


def test_sglang_generate_with_image_data(served, local):
    url, _ = served
    tok, proc, model = local
    vps = [
        encode_prompt(tok, proc, [{"role": "user", "content": f"count {i}"}], [squares(i + 1, seed=i)])
        for i in range(2)
    ]
    sp = {"max_new_tokens": 6, "temperature": 0.8, "ignore_eos": True}
    for vp in vps:  # one prompt: image_data as base64 text (SGLang's usual form)
        b64 = base64.b64encode(vp.image_data[0]).decode()
        body = {"input_ids": vp.input_ids, "image_data": b64, "sampling_params": sp, "return_logprob": True}
        r = httpx.post(f"{url}/generate", json=body, timeout=60).json()
        lps = [t[0] for t in r["meta_info"]["output_token_logprobs"]]
        check(model, vp, r["output_ids"], lps, 0.8)
    # the batch form: one list of images per item
    body = {
        "input_ids": [vp.input_ids for vp in vps],
        "image_data": [[wire_image(vp.image_data[0])] for vp in vps],
        "sampling_params": sp,
        "return_logprob": True,
    }
    for vp, r in zip(vps, httpx.post(f"{url}/generate", json=body, timeout=60).json(), strict=True):
        check(model, vp, r["output_ids"], [t[0] for t in r["meta_info"]["output_token_logprobs"]], 0.8)
    # bad input: a 400 naming the request and the image, the server stays up
    bad = {"input_ids": vps[0].input_ids, "image_data": ["bm90IGFuIGltYWdl"], "sampling_params": sp}
    r = httpx.post(f"{url}/generate", json=bad, timeout=60)
    assert r.status_code == 400 and "image_data[0]" in r.text and "unreadable image" in r.text
    r = httpx.post(f"{url}/generate", json={"input_ids": vps[0].input_ids, "sampling_params": sp}, timeout=60)
    assert r.status_code == 400 and "image pad tokens but image_data is empty" in r.text


@pytest.mark.parametrize("kind", ["image_url", "input_image", "image"])
def test_openai_chat_with_image_content_parts(served, local, kind):
    """Each image part form the server reads (OpenAI chat's ``image_url``, the Responses API's
    ``input_image``, plain ``image``) gives the same prompt as the processor."""
    url, _ = served
    tok, proc, model = local
    img = squares(2, (84, 56), seed=5)
    vp = encode_prompt(tok, proc, [{"role": "user", "content": "how many squares?"}], [img])
    data = wire_image(vp.image_data[0])
    part = {
        "image_url": {"type": "image_url", "image_url": {"url": data}},
        "input_image": {"type": "input_image", "image_url": data},
        "image": {"type": "image", "image": data},
    }[kind]
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "how many squares?"}]}]
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 5, "temperature": 0.9, "logprobs": True},
        timeout=60,
    ).json()
    choice = r["choices"][0]
    assert r["usage"]["prompt_tokens"] == len(vp.input_ids)
    check(model, vp, choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]], 0.9)


@pytest.mark.parametrize("protocol", ["relayrl", "sglang"])
def test_remote_engine_sends_image_data(served, local, protocol):
    url, group = served
    tok, proc, model = local
    vps = [encode_prompt(tok, proc, [{"role": "user", "content": "n?"}], [squares(k, seed=k)]) for k in (1, 2, 3)]
    eng = RemoteEngine(InferenceConfig(backend="remote", protocol=protocol), addresses=group.addresses)
    eng.initialize()
    try:
        g = GenerationConfig(max_new_tokens=6, temperature=1.0, ignore_eos=True)

        async def go():
            reqs = [ModelRequest(f"v{i}", vp.input_ids, g, image_data=vp.image_data) for i, vp in enumerate(vps)]
            return await asyncio.gather(*(eng.agenerate(r) for r in reqs))

        for vp, resp in zip(vps, asyncio.run(go()), strict=True):
            assert resp.output_len == 6
            check(model, vp, resp.output_tokens, resp.output_logprobs)
    finally:
        eng.destroy()


def test_vllm_image_features_placed_on_the_prompt():
    """vLLM's rendered features move onto our prompt's placeholder runs; a run of another length is refused."""
    rendered = {
        "token_ids": [7, 9, 5, 5, 5, 8, 9, 5, 5, 8],
        "features": {
            "mm_hashes": {"image": ["a", "b"]},
            "mm_placeholders": {"image": [{"offset": 2, "length": 3}, {"offset": 7, "length": 2}]},
            "kwargs_data": {"image": ["A", "B"]},
        },
    }
    ours = [1, 2, 3, 9, 5, 5, 5, 8, 4, 9, 5, 5, 8, 6]
    f = VLLMBackend.image_features("r", ours, rendered)
    assert f["mm_placeholders"] == {"image": [{"offset": 4, "length": 3}, {"offset": 10, "length": 2}]}
    assert f["kwargs_data"] == {"image": ["A", "B"]} and f["mm_hashes"] == {"image": ["a", "b"]}
    with pytest.raises(ValueError, match="request 'r': image 1 takes 2 placeholder tokens .* next run has 3 tokens"):
        VLLMBackend.image_features("r", [9, 5, 5, 5, 8, 9, 5, 5, 5, 8], rendered)
    with pytest.raises(ValueError, match="render_images first"):
        VLLMBackend().generate("r", [1, 2], GenerationConfig(), 4, 0, ["data:image/png;base64,AAAA"])
    # a vLLM whose openapi.json lacks the routes is refused at the first image request, naming them
    old = PeerInfo("vllm", "0.8.5", routes={"/v1/completions", "/pause"})
    with pytest.raises(UnsupportedServer, match="lacks /v1/chat/completions/render, /inference/v1/generate"):
        require_image_routes(old, "http://h:1")
    require_image_routes(PeerInfo("vllm", "0.20", routes={*IMAGE_ROUTES}), "http://h:1")


def test_remote_engine_to_the_sglang_stand_in_with_images(local):
    """The SGLang stand-in (tests/peers, GenerateReqInput.image_data) behind RemoteEngine(protocol=sglang)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from peers import start

    tok, proc, model = local
    peer = start("sglang", "--model-path", "tiny-vl")
    eng = RemoteEngine(InferenceConfig(backend="remote", protocol="sglang"), addresses=[peer.address])
    eng.initialize()
    try:
        vps = [encode_prompt(tok, proc, [{"role": "user", "content": "n?"}], [squares(k, seed=k)]) for k in (1, 3)]
        g = GenerationConfig(max_new_tokens=5, temperature=1.0, ignore_eos=True)

        async def go():
            reqs = [ModelRequest(f"s{i}", vp.input_ids, g, image_data=vp.image_data) for i, vp in enumerate(vps)]
            return await asyncio.gather(*(eng.agenerate(r) for r in reqs))

        for vp, resp in zip(vps, asyncio.run(go()), strict=True):
            check(model, vp, resp.output_tokens, resp.output_logprobs)
    finally:
        eng.destroy()
        peer.stop()


def test_remote_engine_to_the_vllm_stand_in_with_images(local):
    """The vLLM stand-in (render + /inference/v1/generate) behind RemoteEngine(protocol=vllm): image
    prompts generate through the token-in route; text prompts still go to /v1/completions."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from peers import start

    tok, proc, model = local
    peer = start("vllm", "--model-path", "tiny-vl", "--logprobs-mode", "processed_logprobs")
    eng = RemoteEngine(InferenceConfig(backend="remote", protocol="vllm"), addresses=[peer.address])
    eng.initialize()
    try:
        assert set(IMAGE_ROUTES) <= eng.servers[0].info.routes  # read from the stand-in's /openapi.json at connect
        vps = [encode_prompt(tok, proc, [{"role": "user", "content": "n?"}], [squares(k, seed=k)]) for k in (1, 3)]
        vps.append(encode_prompt(tok, proc, [{"role": "user", "content": "two"}], [squares(1), squares(2, seed=4)]))
        g = GenerationConfig(max_new_tokens=5, temperature=0.7, ignore_eos=True)

        async def go():
            reqs = [ModelRequest(f"m{i}", vp.input_ids, g, image_data=vp.image_data) for i, vp in enumerate(vps)]
            return await asyncio.gather(*(eng.agenerate(r) for r in reqs))

        calls = eng.counters["http_calls"]
        for vp, resp in zip(vps, asyncio.run(go()), strict=True):
            assert resp.output_len == 5
            check(model, vp, resp.output_tokens, resp.output_logprobs, 0.7)
        assert eng.counters["http_calls"] - calls == 2 * len(vps)  # one render + one generate per prompt
        # images rendered before: vLLM 0.32 answers kwargs_data null (a cache hit), resolved by hash
        again = asyncio.run(eng.agenerate(ModelRequest("again", vps[0].input_ids, g, image_data=vps[0].image_data)))
        check(model, vps[0], again.output_tokens, again.output_logprobs, 0.7)
        # an image prompt whose placeholder runs differ from vLLM's render: refused, naming the request
        ids, pad = vps[0].input_ids, tok.convert_tokens_to_ids("<|image_pad|>")
        cut = ids[: ids.index(pad)] + ids[ids.index(pad) + 1 :]  # one placeholder token short
        short = ModelRequest("bad", cut, g, image_data=vps[0].image_data)
        with pytest.raises(ValueError, match="request 'bad': image 0 takes"):
            asyncio.run(eng.agenerate(short))
    finally:
        eng.destroy()
        peer.stop()
