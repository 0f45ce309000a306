"""The vLLM stand-in's render and token-in/token-out routes (images with a token-id prompt).

As read in vLLM's ``vllm/entrypoints/serve/disagg/protocol.py`` and ``serving.py`` (0001948b):
``/v1/chat/completions/render`` answers a ``GenerateRequest``: ``token_ids`` of the chat template
with each image's placeholder tokens expanded, and ``features`` ``{"mm_hashes": {"image": [...]},
"mm_placeholders": {"image": [{"offset", "length"}]}, "kwargs_data": {"image": [base64 | null]} | null}``
(``vllm/entrypoints/scale_out/token_in_token_out/protocol.py`` in 0.32.0: ``null`` for a metadata-only,
cache-hit render, an item ``null`` to be resolved from the cache by its hash: here, images rendered before);
``/inference/v1/generate`` takes ``token_ids``, ``features``, ``sampling_params`` (vLLM's
``SamplingParams`` fields), ``model``, ``request_id`` and answers ``{"request_id", "choices": [{"index",
"logprobs": {"content": [{"token", "logprob", ...}]}, "finish_reason", "token_ids"}]}``.

What the stand-in does not reproduce: vLLM's ``kwargs_data`` items are its msgpack-serialized processed
tensors; here an item is the image's PNG, base64 (opaque to clients either way). Render takes messages
with images only (the tiny text model has no chat template here).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import sys
import typing
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from relayrl.api.io import GenerationConfig  # noqa: E402

if typing.TYPE_CHECKING:
    from vllm_server import VLLMStandIn


def sampling(body: dict[str, typing.Any]) -> tuple[float, GenerationConfig]:
    """The temperature and the generation settings of a ``CompletionRequest`` or ``SamplingParams`` dict
    (vLLM's sampling fields have the same names in both)."""
    t = float(body.get("temperature", 1.0))
    stop = body.get("stop") or []
    return t, GenerationConfig(
        max_new_tokens=int(body.get("max_tokens") or 16),
        min_new_tokens=int(body.get("min_tokens", 0)),
        greedy=t < 1e-5,
        temperature=1.0 if t < 1e-5 else t,
        top_p=float(body.get("top_p", 1.0)),
        top_k=max(0, int(body.get("top_k", -1) or -1)),
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=list(body.get("stop_token_ids") or []),
        ignore_eos=bool(body.get("ignore_eos", False)),
    )


def _bad(message: str, param: str | None = None) -> JSONResponse:
    error = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    return JSONResponse({"error": error}, status_code=400)


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of ``token`` in ``ids``."""
    out: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def token_routes(app: FastAPI, s: VLLMStandIn) -> None:
    pad = getattr(s.peer.model.config, "image_token_id", None)  # None: a text model, which takes no images
    if pad is not None:  # the processor and chat template of relayrl's tiny VL presets
        from relayrl.data.models import build_vl_tokenizer
        from relayrl.data.vision import build_image_processor

        tok, proc = build_vl_tokenizer(), build_image_processor()
    rendered: dict[str, str] = {}  # vLLM's multimodal cache: hash -> item, for kwargs_data null

    @app.post("/v1/chat/completions/render")
    async def render(request: Request) -> Response:
        from relayrl.data.vision import encode_prompt

        body = await request.json()
        if pad is None:
            return _bad(f"{s.served} is not a multimodal model (the stand-in renders image prompts only)", "messages")
        try:
            vp = encode_prompt(tok, proc, list(body.get("messages") or []), [])
        except ValueError as e:
            return _bad(str(e), "messages")
        ranges = _runs(vp.input_ids, int(pad))
        hashes = [hashlib.sha256(png).hexdigest() for png in vp.image_data]
        cached = all(h in rendered for h in hashes)  # a cache hit: metadata only, as vLLM answers it
        rendered.update({h: base64.b64encode(png).decode() for h, png in zip(hashes, vp.image_data, strict=True)})
        features = {
            "mm_hashes": {"image": hashes},
            "mm_placeholders": {"image": [{"offset": o, "length": n} for o, n in ranges]},
            "kwargs_data": None if cached else {"image": [rendered[h] for h in hashes]},
        }
        return JSONResponse(
            {
                "request_id": f"render-{uuid.uuid4().hex}",
                "token_ids": vp.input_ids,
                "features": features,
                "sampling_params": {"max_tokens": body.get("max_tokens")},
                "model": body.get("model"),
                "stream": False,
            }
        )

    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        body = await request.json()
        model = body.get("model")
        if model not in (None, s.served) and model not in s.peer.adapters:
            error = {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "param": "model"}
            return JSONResponse({"error": {**error, "code": 404}}, status_code=404)
        adapter = model if model in s.peer.adapters else ""
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            return _bad("token_ids must be a non-empty list of non-negative ints", "token_ids")
        sp = body.get("sampling_params")
        if not isinstance(sp, dict):
            return _bad("sampling_params is required", "sampling_params")
        t, g = sampling(sp)
        images: list[str] = []
        features = body.get("features")
        if features is not None:
            if pad is None:
                return _bad(f"{s.served} is not a multimodal model", "features")
            try:
                got = [(int(p["offset"]), int(p["length"])) for p in features["mm_placeholders"]["image"]]
                items = (features.get("kwargs_data") or {}).get("image") or [None] * len(got)
                items = [
                    k if k is not None else rendered[h]
                    for k, h in zip(items, features["mm_hashes"]["image"], strict=True)
                ]
                images = [f"data:image/png;base64,{k}" for k in items]
                for k in items:
                    base64.b64decode(k, validate=True)
            except (KeyError, TypeError, ValueError) as e:
                return _bad(f"features: {e!r}", "features")
            if got != _runs(ids, int(pad)) or len(images) != len(got):
                return _bad(f"features.mm_placeholders {got} do not match the image tokens of token_ids", "features")
        raw = s.logprobs_mode == "raw_logprobs" and not g.greedy and abs(t - 1.0) > 1e-6
        if images and raw and sp.get("logprobs") is not None:
            return _bad("stand-in: raw logprobs of image prompts only at temperature 1", "sampling_params")
        while s.paused:  # new requests wait while paused
            await asyncio.sleep(0.01)
        rid = f"generate-tokens-{body.get('request_id') or uuid.uuid4().hex}"
        r = await s.peer.generate(rid, ids, g, images, adapter)
        lp = None
        if sp.get("logprobs") is not None:
            if images:  # the engine's own: after temperature, equal to raw at temperature 1 (checked above)
                values = list(r.output_logprobs)
            else:
                values, _ = s.logprobs(ids, r.output_tokens, r.output_logprobs, t, 0, adapter)
            content = [
                {"token": f"token_id:{x}", "logprob": v, "bytes": None, "top_logprobs": []}
                for x, v in zip(r.output_tokens, values, strict=True)
            ]
            lp = {"content": content}
        choice = {"index": 0, "logprobs": lp, "finish_reason": r.stop_reason, "token_ids": r.output_tokens}
        return JSONResponse(
            {"request_id": rid, "choices": [choice], "prompt_logprobs": None, "kv_transfer_params": None}
        )
