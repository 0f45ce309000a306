"""vLLM stand-in: the OpenAI server surface RemoteEngine depends on, as vLLM's own source defines it.

Follows vLLM's ``vllm/entrypoints/openai/api_server.py`` and ``protocol.py`` (``CompletionRequest``
with ``return_tokens_as_token_ids``, ``min_tokens``, ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``request_id``; unknown fields are ignored with a warning, as vLLM's
``extra="allow"`` models do) and its RL router, attached only with ``VLLM_SERVER_DEV_MODE=1``, in
the layout of one of two commits read (``--rl-router``):

- ``1ace43ed`` (``vllm/entrypoints/serve/rlhf/api_router.py``): ``/pause`` with ``mode`` ``abort``
  (default) | ``wait`` | ``keep``, ``/resume``, ``/is_paused``, ``/get_world_size``, and the
  weight-transfer routes ``/init_weight_transfer_engine`` ``{"init_info"}`` and ``/update_weights``
  ``{"update_info"}``; ``--weight-transfer-backend nccl`` only (``vllm/config/weight_transfer.py``).
- ``0100a212`` (``vllm/entrypoints/serve/dev/rlhf/api_router.py``, the default): the above plus
  ``/start_weight_update``, ``/finish_weight_update`` ``{"weight_version"}``, ``/weight_info``,
  ``/abort_requests``, and the ``disk`` backend (``weight_transfer/disk_engine.py`` at 3b98defb:
  ``update_info`` ``{"path"}``, an absolute directory with safetensors, loaded only between
  ``/start_weight_update`` and ``/finish_weight_update``).
- ``none``: a release before the weight-transfer API (pause routes only).

The transfer group is built as ``tests/peers/vllm_transfer.py`` describes (gloo for PyNccl on CPU).
Without ``--weight-transfer-backend`` the transfer routes answer 500, as vLLM's engine does with
no transfer engine configured. The dev-mode ``/collective_rpc`` (``reload_weights``) is there in
every layout. Versions named are the stand-in's labels for the source read, not releases.

Facts reproduced: a ``model`` other than the served name (``--served-model-name``, default the
model path) is a 404 ``{"error": {"message", "type": "NotFoundError", "param": "model", "code": 404}}``;
``--logprobs-mode raw_logprobs`` (vLLM's default) reports the model's logprobs before temperature,
``processed_logprobs`` after it; ``top_logprobs`` entries come from the same distribution;
replies carry no weight version; ``/metrics`` has ``vllm:generation_tokens_total``; a request aborted by ``/pause`` (mode ``abort``) ends with
``finish_reason`` ``abort`` and the tokens generated so far; ``/health`` does not generate.

LoRA (``vllm/entrypoints/openai/serving_models.py`` and ``api_server.py`` at 075e9ba8):
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` ``{"lora_name", "lora_path"}`` exist only
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (else 404 ``{"detail": "Not Found"}``); a load answers
200 with the plain-text ``Success: LoRA adapter '<name>' added successfully.``, a name already loaded
400 ``InvalidUserInput`` (``The lora adapter '<name>' has already been loaded.``), an engine without
``--enable-lora`` or an adapter above ``--max-lora-rank`` (default 16) 400 ``BadRequestError``; an
unload of an unknown name 404 ``NotFoundError``; a loaded adapter is served as a model of its name
(the request's ``model``) and listed by ``/v1/models`` with ``parent`` the base; an unload drops the
name only (requests already running on it finish).

Images (``vllm/entrypoints/serve/disagg/protocol.py`` and ``serving.py``, read at 0001948b; the
routes are in ``tests/peers/vllm_tokens.py``): ``/v1/chat/completions/render`` turns chat messages
with image content parts into ``token_ids`` and ``features`` (``mm_hashes``, ``mm_placeholders``
``{offset, length}``, ``kwargs_data``: one base64 item per image); ``/inference/v1/generate`` takes
``token_ids``, ``features`` and ``sampling_params`` and answers ``choices`` with ``token_ids`` and
chat-style ``logprobs.content``. A text model (``--model-path tiny``) refuses images.

Run: ``python tests/peers/vllm_server.py [--port 0] [--served-model-name NAME] [--logprobs-mode M]
[--weight-transfer-backend nccl|disk] [--rl-router 0100a212|1ace43ed|none] [--model-path tiny|tiny-vl]
[--hold-after-tokens N [--hold-rows R]]`` (``VLLM_SERVER_DEV_MODE=1`` in the environment adds the RL and
``/collective_rpc`` routes). ``--hold-after-tokens`` is a test hook, not vLLM's: once R requests (default 1)
have generated N tokens each, it pauses as ``/pause?mode=keep`` does (``/is_paused`` answers true), so a
test's ``/pause`` lands mid-generation however loaded the machine is (``TinyPeer.hold_once``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path

import torch
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_tokens  # noqa: E402
import vllm_transfer  # noqa: E402
from _core import TinyPeer, listen  # noqa: E402

VERSION = "0.15.0"


def _error(message: str, status: int, param: str | None = None, kind: str | None = None) -> JSONResponse:
    kinds = {400: "BadRequestError", 404: "NotFoundError"}
    return JSONResponse(
        {"error": {"message": message, "type": kind or kinds.get(status, "Error"), "param": param, "code": status}},
        status_code=status,
    )


class VLLMStandIn:
    def __init__(
        self,
        served: str,
        logprobs_mode: str,
        transfer: str | None = None,
        router: str = "0100a212",
        lora: tuple[bool, int] = (False, 16),
        model: str = "tiny",
        hold: tuple[int, int] = (0, 0),
    ) -> None:
        self.served, self.logprobs_mode = served, logprobs_mode
        self.enable_lora, self.max_lora_rank = lora
        self.transfer, self.router = transfer, router
        self.peer = TinyPeer(model=model)
        self.paused = False
        if hold[1] > 0:  # (rows, tokens): the test hook --hold-after-tokens
            self.peer.hold_once(*hold, on_hold=lambda: setattr(self, "paused", True))
        self.version = 0  # weights loaded so far
        self.weight_version: str | None = None  # what /finish_weight_update set (0100a212 layout)
        self.group: object | None = None  # the weight-transfer group, once initialised
        self.session = False  # between /start_weight_update and /finish_weight_update
        self.counts = {"init": 0, "updates": 0, "packed": 0, "broadcasts": 0}

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        model = body.get("model")
        if model not in (None, self.served) and model not in self.peer.adapters:
            return _error(f"The model `{model}` does not exist.", 404, "model")
        adapter = model if model in self.peer.adapters else ""
        prompt = body.get("prompt")
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
        if not all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts):
            return _error("the stand-in takes token-id prompts only", 400, "prompt")
        t, g = vllm_tokens.sampling(body)
        while self.paused:  # new requests wait while paused
            await asyncio.sleep(0.01)
        rid = body.get("request_id") or f"cmpl-{uuid.uuid4().hex}"
        outs = await asyncio.gather(
            *(self.peer.generate(f"{rid}-{i}", p, g, adapter=adapter) for i, p in enumerate(prompts))
        )
        k = body.get("logprobs")
        choices = []
        for i, (p, r) in enumerate(zip(prompts, outs, strict=True)):
            lp = None
            if k is not None:
                token_lps, tops = self.logprobs(p, r.output_tokens, r.output_logprobs, t, int(k), adapter)
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
                "model": model or self.served,
                "choices": choices,
                "usage": {**usage, "total_tokens": sum(usage.values())},
            }
        )

    def logprobs(
        self, ids: list[int], out: list[int], sampled: list[float], t: float, k: int, adapter: str = ""
    ) -> tuple[list[float], list[dict[str, float]]]:
        """Sampled-token logprobs and top-k dicts: raw (before temperature) or processed (after)."""
        if not out:
            return [], []
        logits = self.peer.logits(ids, out, adapter)
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
    vllm_tokens.token_routes(app, s)

    @app.get("/stand_in")
    async def stand_in() -> dict[str, object]:  # test introspection, not a vLLM route: how it was started
        return {
            "argv": sys.argv,
            "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "VLLM_SERVER_DEV_MODE")},
            "counts": s.counts,
            "version": s.version,
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
        base = [{"id": s.served, "object": "model", "owned_by": "vllm", "root": "tiny", "parent": None}]
        loras = [
            {"id": n, "object": "model", "owned_by": "vllm", "root": p, "parent": s.served}
            for n, p in s.peer.adapter_paths.items()
        ]
        return {"object": "list", "data": base + loras}

    if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true"):
        lora_routes(app, s)

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

    @rl.get("/server_info")
    async def server_info() -> JSONResponse:
        """Dev mode's engine config (vLLM 0.32.0 ``serve/dev/server_info``): ``lora_config`` null without --enable-lora."""
        lora = {"max_lora_rank": s.max_lora_rank, "max_loras": 2} if s.enable_lora else None
        return JSONResponse({"vllm_config": {"lora_config": lora, "model_config": {"dtype": "torch.float32"}}})

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

    if s.router != "none":
        transfer_routes(rl, s)
    app.include_router(rl)
    return app


def lora_routes(app: FastAPI, s: VLLMStandIn) -> None:
    """vLLM's runtime LoRA routes (attached with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)."""

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> Response:
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return _error("Both 'lora_name' and 'lora_path' must be provided.", 400, kind="InvalidUserInput")
        if name in s.peer.adapters:
            return _error(f"The lora adapter '{name}' has already been loaded.", 400, kind="InvalidUserInput")
        try:
            if not s.enable_lora:
                raise ValueError("LoRA is not enabled. Use --enable-lora to enable LoRA.")
            cfg = json.loads((Path(path) / "adapter_config.json").read_text())
            if int(cfg["r"]) > s.max_lora_rank:
                raise ValueError(f"LoRA rank {cfg['r']} is greater than max_lora_rank {s.max_lora_rank}.")
            await asyncio.to_thread(s.peer.load_adapter, name, path)
        except (OSError, ValueError, KeyError) as e:
            return _error(str(e), 400)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> Response:
        name = (await request.json()).get("lora_name")
        if not name:
            return _error("either 'lora_name' and 'lora_int_id' needs to be provided.", 400, kind="InvalidUserInput")
        if name not in s.peer.adapters:
            return _error(f"The lora adapter '{name}' cannot be found.", 404)
        s.peer.unload_adapter(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")


def _fail(message: str, status: int = 500) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def transfer_routes(rl: APIRouter, s: VLLMStandIn) -> None:
    """The weight-transfer routes of the RL router (``--rl-router`` picks the layout)."""

    @rl.post("/init_weight_transfer_engine")
    async def init_transfer(request: Request) -> JSONResponse:
        init_info = (await request.json()).get("init_info")
        if init_info is None:
            return _fail("Missing 'init_info' in request body", 400)
        if s.transfer is None:
            return _fail("weight transfer is not configured: start vLLM with --weight-transfer-backend")
        try:
            if s.transfer == "disk":
                vllm_transfer.check_fields(init_info, (), 0, "DiskWeightTransferInitInfo")
            else:
                s.group = await asyncio.to_thread(vllm_transfer.join, init_info, 0)
        except (TypeError, ValueError, RuntimeError) as e:
            return _fail(f"init_weight_transfer_engine failed: {e}")
        s.counts["init"] += 1
        return JSONResponse({"message": "Weight transfer initialized"})

    @rl.post("/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        info = (await request.json()).get("update_info")
        if info is None:
            return _fail("Missing 'update_info' in request body", 400)
        try:
            if s.transfer == "disk":
                vllm_transfer.check_fields(info, ("path",), 1, "DiskWeightTransferUpdateInfo")
                path = Path(info["path"])
                if not path.is_absolute() or not path.is_dir() or not list(path.glob("*.safetensors")):
                    raise ValueError(f"Shared-disk checkpoint path must be a local directory with safetensors: {path}")
                if not s.session:
                    raise RuntimeError("start_weight_update must be called before loading a checkpoint")
                await asyncio.to_thread(s.peer.load_dir, str(path), s.version + 1)
            elif s.group is None:
                raise RuntimeError("NCCL weight transfer not initialized. Call init_transfer_engine() first.")
            else:
                got, n = await asyncio.to_thread(vllm_transfer.receive, s.group[0], info)  # type: ignore[index]
                await asyncio.to_thread(s.peer.load, got, s.version + 1)
                s.counts["packed"] += bool(info.get("packed"))
                s.counts["broadcasts"] += n
        except (TypeError, ValueError, RuntimeError, OSError) as e:
            return _fail(f"update_weights failed: {e}")
        s.version += 1
        s.counts["updates"] += 1
        return JSONResponse({"message": "Weights updated"})

    @rl.get("/get_world_size")
    async def world_size() -> JSONResponse:
        return JSONResponse({"world_size": 1})

    if s.router == "1ace43ed":
        return

    @rl.post("/start_weight_update")
    async def start() -> JSONResponse:
        if s.session:
            return _fail("A weight update is already active")
        s.session = True
        return JSONResponse({"message": "Weight update started"})

    @rl.post("/finish_weight_update")
    async def finish(request: Request) -> JSONResponse:
        body = await request.json() if await request.body() else {}
        if not s.session:
            return _fail("No weight update is active")
        s.session = False
        if body.get("weight_version") is not None:
            s.weight_version = str(body["weight_version"])
        return JSONResponse({"message": "Weight update finished"})

    @rl.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await request.json()
        if "new_version" not in body:
            return _fail("Field required: new_version", 422)
        s.weight_version = str(body["new_version"])
        return JSONResponse({"success": True, "new_version": s.weight_version})

    @rl.get("/weight_info")
    async def weight_info() -> JSONResponse:
        return JSONResponse({"weight_version": s.weight_version})

    @rl.post("/abort_requests")
    async def abort_requests(request: Request) -> JSONResponse:
        n = await asyncio.to_thread(s.peer.abort_running)
        return JSONResponse({"status": "aborted", "aborted": n})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--served-model-name", default="tiny")
    ap.add_argument("--logprobs-mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"])
    ap.add_argument("--weight-transfer-backend", default=None, choices=["nccl", "disk"])
    # vLLM 0.32.0's form of the same choice (its WeightTransferConfig; no disk backend in that release)
    ap.add_argument("--weight-transfer-config", type=json.loads, default=None)
    ap.add_argument("--rl-router", default="0100a212", choices=["0100a212", "1ace43ed", "none"])
    ap.add_argument("--enable-lora", action="store_true")
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=1)
    ap.add_argument("--model-path", default="tiny", help="tiny, or tiny-vl / tiny-vl2.5 (takes images)")
    ap.add_argument(
        "--hold-after-tokens", type=int, default=0, help="test hook: pause (keep) once requests have N tokens"
    )
    ap.add_argument(
        "--hold-rows", type=int, default=1, help="test hook: how many requests --hold-after-tokens waits for"
    )
    args, _ = ap.parse_known_args()
    if args.weight_transfer_config is not None:
        args.weight_transfer_backend = args.weight_transfer_config.get("backend", "nccl")
    if args.weight_transfer_backend == "disk" and args.rl_router != "0100a212":
        ap.error(f"--weight-transfer-backend disk does not exist at {args.rl_router} (nccl only)")
    dev = os.environ.get("VLLM_SERVER_DEV_MODE", "0") == "1"
    listen(
        build_app(
            VLLMStandIn(
                args.served_model_name,
                args.logprobs_mode,
                args.weight_transfer_backend,
                args.rl_router,
                (args.enable_lora, args.max_lora_rank),
                args.model_path,
                (args.hold_rows, args.hold_after_tokens),
            ),
            dev,
        ),
        "vllm stand-in",
        args.host,
        args.port,
    )


if __name__ == "__main__":
    main()
