"""vLLM stand-in: the OpenAI server surface RemoteEngine depends on, as vLLM's own source defines it.

Follows vLLM's ``vllm/entrypoints/openai/api_server.py`` and ``protocol.py`` (``CompletionRequest``
with ``return_tokens_as_token_ids``, ``min_tokens``, ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``request_id``; unknown fields are ignored with a warning, as vLLM's
``extra="allow"`` models do), ``vllm/entrypoints/serve/rlhf/api_router.py`` (``/pause`` with
``mode`` ``abort`` (default) | ``wait`` | ``keep``, ``/resume``, ``/is_paused``, attached only with
``VLLM_SERVER_DEV_MODE=1`` in the release read) and the dev-mode ``/collective_rpc``. Reported as
version ``0.15.0`` (the layout read; the number is the stand-in's label).

Facts reproduced: a ``model`` other than the served name (``--served-model-name``, default the
model path) is a 404 ``{"error": {"message", "type": "NotFoundError", "param": "model", "code": 404}}``;
``--logprobs-mode raw_logprobs`` (vLLM's default) reports the model's logprobs before temperature,
``processed_logprobs`` after it; ``top_logprobs`` entries come from the same distribution;
replies carry no weight version; ``/metrics`` has ``vllm:generation_tokens_total``; a request aborted by ``/pause`` (mode ``abort``) ends with
``finish_reason`` ``abort`` and the tokens generated so far; ``/health`` does not generate.

Run: ``python tests/peers/vllm_server.py [--port 0] [--served-model-name NAME] [--logprobs-mode M]``
(``VLLM_SERVER_DEV_MODE=1`` in the environment adds the RL and ``/collective_rpc`` routes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

import torch
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _core import TinyPeer, listen  # noqa: E402

from relayrl.api.io import GenerationConfig  # noqa: E402

VERSION = "0.15.0"


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    kinds = {400: "BadRequestError", 404: "NotFoundError"}
    return JSONResponse(
        {"error": {"message": message, "type": kinds.get(status, "Error"), "param": param, "code": status}},
        status_code=status,
    )


class VLLMStandIn:
    def __init__(self, served: str, logprobs_mode: str) -> None:
        self.served, self.logprobs_mode = served, logprobs_mode
        self.peer = TinyPeer()
        self.paused = False
        self.version = 0  # weights loaded so far (vLLM reports none)

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        if body.get("model") not in (None, self.served):
            return _error(f"The model `{body.get('model')}` does not exist.", 404, "model")
        prompt = body.get("prompt")
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
        if not all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts):
            return _error("the stand-in takes token-id prompts only", 400, "prompt")
        t = float(body.get("temperature", 1.0))
        stop = body.get("stop") or []
        g = GenerationConfig(
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
        while self.paused:  # new requests wait while paused
            await asyncio.sleep(0.01)
        rid = body.get("request_id") or f"cmpl-{uuid.uuid4().hex}"
        outs = await asyncio.gather(*(self.peer.generate(f"{rid}-{i}", p, g) for i, p in enumerate(prompts)))
        k = body.get("logprobs")
        choices = []
        for i, (p, r) in enumerate(zip(prompts, outs, strict=True)):
            lp = None
            if k is not None:
                token_lps, tops = self.logprobs(p, r.output_tokens, r.output_logprobs, t, int(k))
                names = [f"token_id:{x}" if body.get("return_tokens_as_token_ids") else str(x) for x in r.output_tokens]
                lp = {
                    "tokens": names,
                    "token_logprobs": token_lps,
                    "top_logprobs": tops if k else None,
                    "text_offset": list(range(len(names))),
                }
            choices.append(
                {
                    "index": i,
                    "text": "",
                    "logprobs": lp,
                    "finish_reason": r.stop_reason,
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
            )
        usage = {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": sum(r.output_len for r in outs)}
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.served,
                "choices": choices,
                "usage": {**usage, "total_tokens": sum(usage.values())},
            }
        )

    def logprobs(
        self, ids: list[int], out: list[int], sampled: list[float], t: float, k: int
    ) -> tuple[list[float], list[dict[str, float]]]:
        """Sampled-token logprobs and top-k dicts: raw (before temperature) or processed (after)."""
        if not out:
            return [], []
        logits = self.peer.logits(ids, out)
        if self.logprobs_mode == "processed_logprobs" and t >= 1e-5:
            logits = logits / t
        logp = torch.log_softmax(logits, dim=-1)
        token_lps = (
            sampled if self.logprobs_mode == "processed_logprobs" else [float(logp[i, x]) for i, x in enumerate(out)]
        )
        tops = []
        for i, x in enumerate(out):
            vals, idx = logp[i].topk(max(k, 1))
            top = {f"token_id:{int(j)}": float(v) for v, j in zip(vals, idx, strict=True)}
            top[f"token_id:{x}"] = token_lps[i]
            tops.append(top)
        return token_lps, tops


def build_app(s: VLLMStandIn, dev_mode: bool) -> FastAPI:
    app = FastAPI()
    app.post("/v1/completions")(s.completions)

    @app.get("/stand_in")
    async def stand_in() -> dict[str, object]:  # test introspection, not a vLLM route: how it was started
        return {
            "argv": sys.argv,
            "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "VLLM_SERVER_DEV_MODE")},
        }

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:  # vLLM's Prometheus counter of generated tokens (the one the tests watch)
        n = s.peer.engine.counters["tokens"]
        return Response(
            f'vllm:generation_tokens_total{{model_name="{s.served}"}} {float(n)}\n', media_type="text/plain"
        )

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": s.served, "object": "model", "owned_by": "vllm", "root": "tiny"}]}

    if not dev_mode:
        return app
    rl = APIRouter()

    @rl.post("/pause")
    async def pause(mode: str = Query("abort"), clear_cache: bool = Query(True)) -> JSONResponse:
        if mode not in ("abort", "wait", "keep"):
            return JSONResponse({"error": f"invalid pause mode {mode!r}"}, status_code=400)
        if mode == "wait":
            while s.peer.engine._rows:  # noqa: SLF001 - in-flight requests finish first
                await asyncio.sleep(0.01)
        s.paused = True
        await asyncio.to_thread(s.peer.engine.pause)
        if mode == "abort":
            await asyncio.to_thread(s.peer.abort_running)
        return JSONResponse({"status": "paused"})

    @rl.post("/resume")
    async def resume() -> JSONResponse:
        s.paused = False
        await asyncio.to_thread(s.peer.engine.resume)
        return JSONResponse({"status": "resumed"})

    @rl.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": s.paused})

    @rl.post("/collective_rpc")
    async def collective_rpc(request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("method") != "reload_weights":
            return JSONResponse(
                {"error": f"the stand-in implements reload_weights only, got {body.get('method')!r}"}, status_code=400
            )
        path = (body.get("kwargs") or {}).get("weights_path")
        try:
            await asyncio.to_thread(s.peer.load_dir, path, s.version + 1)
        except (OSError, ValueError) as e:
            return JSONResponse({"error": str(e)}, status_code=500)
        s.version += 1
        return JSONResponse({"results": [None]})

    app.include_router(rl)
    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--served-model-name", default="tiny")
    ap.add_argument("--logprobs-mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"])
    args, _ = ap.parse_known_args()
    dev = os.environ.get("VLLM_SERVER_DEV_MODE", "0") == "1"
    listen(
        build_app(VLLMStandIn(args.served_model_name, args.logprobs_mode), dev), "vllm stand-in", args.host, args.port
    )


if __name__ == "__main__":
    main()
