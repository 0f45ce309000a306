"""``relayrl serve``: an HTTP server around LocalEngine.

Speaks SGLang's native protocol (``/generate``, weight updates from disk and by collective broadcast
(NCCL on GPUs, gloo on CPU), pause / continue / abort, health and info routes: ``build_app`` lists
them), relayrl's safetensors weight upload (``/update_weights_from_tensor``) and OpenAI's
``/v1/completions`` and ``/v1/chat/completions`` with logprobs, so the same process serves
RemoteEngine (any of its protocols) and agents written against the OpenAI SDK. The OpenAPI schema is
at ``/openapi.json``. A vision-language model takes images as SGLang's ``image_data`` on
``/generate`` and as OpenAI ``image_url`` content parts on ``/v1/chat/completions`` (docs/vision.md).

``/generate`` also takes SGLang's batch form (``input_ids`` a list of prompts; ``rid``,
``sampling_params`` and ``return_logprob`` one per item or one for all) and answers a list of
per-item replies; ``/v1/completions`` takes a list of prompts (one choice per prompt and sample).
Every body is validated and answered with a 4xx naming the field (and the item index in a batch);
the process stays up. Admin routes (weights, pause) need ``Authorization: Bearer <token>`` when a
token is configured. Disk paths are confined to ``allowed_weight_roots`` (symlinks resolved, ``..``
refused).

Where an SGLang client would notice, it answers as SGLang does: ``/pause_generation {}`` aborts
in-flight requests (``mode`` ``abort``; ``in_place`` / ``retract`` keep them), an interrupted
``/generate`` request ends as ``abort`` with its partial output, ``weight_version`` is a string,
matched stop strings are cut from ``text``. Errors are OpenAI error objects (``common.error_body``).
Weight routes live in ``weights``, OpenAI routes in ``openai_routes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import os
import secrets
import socket
import sys
import typing
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from relayrl.api.commands import ServerConfig
from relayrl.api.config import ConfigError
from relayrl.api.io import GenerationConfig, ModelRequest, ModelResponse
from relayrl.data.vision import inline_image
from relayrl.inference.local.engine import LocalEngine
from relayrl.inference.server import LISTEN_PREFIX
from relayrl.inference.server.common import (
    _bad,
    _dumps,
    _json,
    _per_item,
    _validation_error,
    confine_path,
    error_body,
    trim_stop,
)
from relayrl.inference.server.openai_routes import OpenAIRoutes
from relayrl.inference.server.schemas import (
    AbortRequest,
    GenerateBatchRequest,
    GenerateBody,
    GenerateRequest,
    PauseRequest,
    SamplingParams,
)
from relayrl.inference.server.weights import WeightRoutes
from relayrl.inference.weight_group import WeightBroadcastGroup
from relayrl.utils.moe import encode_routed_experts
from relayrl.utils.webguard import GuardMiddleware

__all__ = ["LISTEN_PREFIX", "Server", "_dumps", "build_app", "confine_path", "make_server", "run_server"]

GREEDY_BELOW = 1e-5  # temperatures below this decode greedily
# SamplingParams' fields that GenerationConfig names alike
GENERATION_FIELDS = set(
    "max_new_tokens min_new_tokens top_p stop_token_ids ignore_eos frequency_penalty presence_penalty".split()
)

Images = str | list[str] | None  # a request's image_data (one image or a list)


@dataclasses.dataclass
class _Job:
    """One /generate item, checked: what ``Server.generate_item`` runs and how it answers."""

    rid: str
    ids: list[int]
    g: GenerationConfig
    logprob: bool
    skip_special: bool
    stops: list[str]  # cut from the text ([] with no_stop_trim)
    routed: bool
    images: list[str | bytes]


class Server(WeightRoutes, OpenAIRoutes):
    """The routes, bound to one engine and tokenizer."""

    def __init__(
        self,
        engine: LocalEngine,
        tokenizer: PreTrainedTokenizerBase,
        cfg: ServerConfig,
        vocab_size: int,
        max_positions: int,
        reference: dict[str, tuple[torch.Size, torch.dtype]] | None = None,
    ) -> None:
        self.engine, self.tok, self.cfg = engine, tokenizer, cfg
        self.vocab_size, self.max_positions = vocab_size, max_positions
        self.reference = reference or {}  # parameter name -> (shape, dtype), to check updates
        self.token = cfg.admin_token or os.environ.get("RELAYRL_ADMIN_TOKEN", "")
        self.weight_lock = asyncio.Lock()
        self.groups: dict[str, WeightBroadcastGroup] = {}  # weight groups this server joined, by name
        self.staged: dict[str, dict[str, torch.Tensor]] = {}  # broadcast buckets received, not loaded yet, by group
        self.paused = False
        self.n_served = 0  # generation requests answered
        self.n_calls = 0  # HTTP calls that carried them (a batch is one)

    # ---------------------------------------------------------------- helpers
    def admin(self, request: Request) -> None:
        if not self.token:
            return
        header = request.headers.get("authorization", "")
        if not header:
            raise HTTPException(
                401, "admin endpoint: missing 'Authorization: Bearer <token>'", headers={"WWW-Authenticate": "Bearer"}
            )
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self.token.encode()):
            raise _bad("admin endpoint: invalid bearer token", 403)

    def check_ids(self, ids: list[int], field: str) -> None:
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise _bad(f"{field}[{i}]={t} is out of vocabulary [0, {self.vocab_size})")

    def gconfig(
        self, sp: SamplingParams, prompt_len: int, field: str = "sampling_params", prompt: str = "input_ids"
    ) -> GenerationConfig:
        if sp.max_new_tokens == 0:  # only a single /generate scores a prompt
            raise _bad(f"{field}.max_new_tokens=0 (score the prompt) is for a single /generate request, not {prompt}")
        greedy = sp.temperature < GREEDY_BELOW  # as SGLang and vLLM do: a tinier one only overflows the logits
        g = GenerationConfig(
            greedy=greedy,
            temperature=1.0 if greedy else sp.temperature,
            top_k=max(sp.top_k, 0),  # -1 = off
            stop=[sp.stop] if isinstance(sp.stop, str) else list(sp.stop),
            **sp.model_dump(include=GENERATION_FIELDS),
        )
        try:
            g.validate()
        except ValueError as e:
            raise _bad(f"{field}.{e}") from None
        self.check_ids(g.stop_token_ids, f"{field}.stop_token_ids")
        if prompt_len == 0:
            raise _bad(f"{prompt}: the prompt is empty")
        if prompt_len + g.max_new_tokens > self.max_positions:
            raise _bad(
                f"{prompt}: input length {prompt_len} + {field}.max_new_tokens={g.max_new_tokens} exceeds the "
                f"model's {self.max_positions} positions"
            )
        return g

    async def run(
        self, rid: str, ids: list[int], g: GenerationConfig, once: bool = False, images: list[str | bytes] | None = None
    ) -> ModelResponse:
        """``once``: SGLang's /generate, where an interrupted request ends as ``abort`` (the client
        continues it); the OpenAI routes continue it here, transparently. ``images``: the prompt's
        (``ModelRequest.image_data``)."""
        try:  # a client's images are inline data, never a path on this machine
            inline = [inline_image(img, f"image_data[{j}]") for j, img in enumerate(images or [])]
        except ValueError as e:
            raise _bad(str(e)) from None
        req = ModelRequest(rid=rid, input_ids=ids, gconfig=g, image_data=list(inline))
        try:
            resp = await (self.engine.agenerate_once(req) if once else self.engine.agenerate(req))
        except ValueError as e:
            raise _bad(f"request {rid}: {e}") from None
        self.n_served += 1
        return resp

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=skip_special))

    def finish(self, r: ModelResponse) -> dict[str, object]:
        if r.stop_reason == "length":
            return {"type": "length", "length": r.output_len}
        if r.stop_reason == "abort":
            return {"type": "abort", "message": "aborted"}
        return {"type": "stop", "matched": r.output_tokens[-1] if r.output_tokens else None}

    # ---------------------------------------------------------------- SGLang native
    async def generate(self, req: GenerateBody) -> Response:
        """One prompt -> one reply object; SGLang's batch form -> a list of them, in order (or,
        with ``stream_items``, NDJSON lines in the order the items finish)."""
        self.n_calls += 1
        if isinstance(req, GenerateBatchRequest):
            jobs = self.batch_jobs(req)
            if req.stream_items:
                return StreamingResponse(self.stream_items(jobs), media_type="application/x-ndjson")
            return _json(list(await asyncio.gather(*(self.generate_item(job) for job in jobs))))
        return _json(await self.generate_one(req))

    async def generate_one(self, req: GenerateRequest) -> dict[str, object]:
        self.check_form(req)
        ids = req.input_ids if req.input_ids is not None else list(self.tok.encode(req.text))
        self.check_ids(ids, "input_ids")
        if req.logprob_start_len >= len(ids) or (req.top_logprobs_num and req.logprob_start_len < 0):
            raise _bad(
                f"logprob_start_len={req.logprob_start_len} must be a prompt position (0 <= it < {len(ids)}) "
                f"{'for top_logprobs_num' if req.top_logprobs_num else ''}".rstrip()
            )
        rid, sp = req.rid or uuid.uuid4().hex, req.sampling_params
        if sp.max_new_tokens == 0:  # score the prompt only: a distillation teacher's call
            out = self.score_prompt(req, rid, ids)
        else:
            job = self.job("", rid, ids, sp, req.return_logprob, req.return_routed_experts, req.image_data)
            out = await self.generate_item(job)
        if req.return_logprob and req.logprob_start_len >= 0:
            meta = typing.cast(dict[str, object], out["meta_info"])
            meta.update(await self.input_logprobs(ids, req.logprob_start_len, req.top_logprobs_num))
        return out

    async def input_logprobs(self, ids: list[int], start: int, k: int) -> dict[str, object]:
        """SGLang's ``input_token_logprobs`` (and ``input_top_logprobs`` for k > 0) from prompt position ``start``."""
        picked, tops = await self.engine.aprompt_logprobs(ids, start, k)
        meta: dict[str, object] = {
            "input_token_logprobs": [[lp, t, None] for lp, t in zip(picked, ids[start:], strict=True)]
        }
        if k:
            meta["input_top_logprobs"] = [[[lp, j, None] for j, lp in top] or None for top in tops]
        return meta

    def score_prompt(self, req: GenerateRequest, rid: str, ids: list[int]) -> dict[str, object]:
        """``max_new_tokens: 0``: nothing generated, the reply of an empty output (with ``return_logprob``
        and ``logprob_start_len``, ``generate_one`` adds the prompt's logprobs: what ``actor.teacher.url``
        with ``protocol: sglang`` asks a teacher for)."""
        if req.image_data or req.return_routed_experts:
            raise _bad(
                "sampling_params.max_new_tokens=0 scores a text prompt: image_data and routed experts do not apply"
            )
        self.n_served += 1
        return self.reply(rid, ModelResponse(ids, [], [], [], stop_reason="length"), req.return_logprob, True, [])

    def check_form(self, req: GenerateRequest | GenerateBatchRequest) -> None:
        if req.stream:
            raise _bad("stream: streaming is not supported; send stream=false")
        if (req.input_ids is None) == (req.text is None):
            raise _bad("give exactly one of input_ids or text")

    def job(
        self, at: str, rid: str, ids: list[int], sp: SamplingParams, logprob: bool, routed: bool, image: Images
    ) -> _Job:
        """One prompt's generation checked, for ``generate_item`` (``at``: ``[i]``, its index in a batch, or "")."""
        g = self.gconfig(sp, len(ids), field=f"sampling_params{at}", prompt=f"input_ids{at}")
        if routed and self.engine.routing_shape is None:
            raise _bad(
                f"return_routed_experts{at}: the served model has no mixture-of-experts layers (no experts are routed)"
            )
        images: list[str | bytes] = [image] if isinstance(image, str) else list(image or [])
        return _Job(rid, ids, g, logprob, sp.skip_special_tokens, [] if sp.no_stop_trim else g.stop, routed, images)

    def batch_jobs(self, req: GenerateBatchRequest) -> list[_Job]:
        """Every item validated before any is generated (errors name the item index)."""
        self.check_form(req)
        prompts = req.input_ids if req.input_ids is not None else [list(self.tok.encode(t)) for t in req.text or []]
        n = len(prompts)
        sps: list[SamplingParams] = _per_item(req.sampling_params, n, "sampling_params")
        logprob: list[bool] = _per_item(req.return_logprob, n, "return_logprob")
        routed: list[bool] = _per_item(req.return_routed_experts, n, "return_routed_experts")
        if isinstance(req.rid, list):
            rids = _per_item(req.rid, n, "rid")
        else:
            prefix = req.rid or uuid.uuid4().hex
            rids = [f"{prefix}-{i}" for i in range(n)]
        images = _per_item(req.image_data, n, "image_data")
        jobs: list[_Job] = []
        for i, ids in enumerate(prompts):
            self.check_ids(ids, f"input_ids[{i}]")
            jobs.append(self.job(f"[{i}]", rids[i], ids, sps[i], logprob[i], routed[i], images[i]))
        return jobs

    async def generate_item(self, job: _Job) -> dict[str, object]:
        r = await self.run(job.rid, job.ids, job.g, once=True, images=job.images)
        return self.reply(job.rid, r, job.logprob, job.skip_special, job.stops, job.routed)

    async def stream_items(self, jobs: list[_Job]) -> AsyncIterator[bytes]:
        """One NDJSON line per item as soon as it finishes: a batch costs one HTTP call, yet no
        item waits for the slowest one."""

        async def indexed(i: int, job: _Job) -> tuple[int, dict[str, object]]:
            try:
                return i, await self.generate_item(job)
            except HTTPException as e:
                return i, {"error": e.detail, "status": e.status_code}

        tasks = [asyncio.ensure_future(indexed(i, job)) for i, job in enumerate(jobs)]
        try:
            for done in asyncio.as_completed(tasks):
                i, reply = await done
                yield _dumps({"index": i, **reply}) + b"\n"
        finally:
            for t in tasks:  # the client went away: nobody reads the rest
                t.cancel()

    def reply(
        self,
        rid: str,
        r: ModelResponse,
        logprob: bool,
        skip_special: bool,
        stops: list[str],
        routed: bool = False,
    ) -> dict[str, object]:
        """One item's SGLang reply (+ relayrl's per-token ``output_token_versions``)."""
        meta: dict[str, object] = {
            "id": rid,
            "prompt_tokens": r.input_len,
            "completion_tokens": r.output_len,
            "finish_reason": self.finish(r),
            "weight_version": str(r.output_versions[-1] if r.output_versions else self.engine.get_version()),
            "output_token_versions": r.output_versions,
            "e2e_latency": r.latency,
            "ttft": r.ttft,
        }
        if logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(r.output_logprobs, r.output_tokens, strict=True)
            ]
        if routed and r.routed_experts is not None:
            meta["routed_experts"] = encode_routed_experts(r.routed_experts)
            meta["routed_experts_shape"] = list(r.routed_experts.shape)
        text = trim_stop(self.decode(r.output_tokens, skip_special), stops, r.stop_reason)
        return {"text": text, "output_ids": r.output_tokens, "meta_info": meta}


def build_app(srv: Server) -> FastAPI:
    """The FastAPI app of one Server (routes are thin wrappers over its methods)."""
    app = FastAPI(title="relayrl inference server", version="1")
    app.add_middleware(
        GuardMiddleware,
        bound_host=srv.cfg.host,
        max_body=srv.cfg.max_request_mb << 20,
        body_timeout=srv.cfg.body_timeout,
        raw_paths=("/update_weights_from_tensor",),  # a safetensors body, capped by max_upload_mb
    )
    app.add_exception_handler(RequestValidationError, _validation_error)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:  # the engine's refusals of a request
        return JSONResponse(status_code=400, content=error_body(str(exc) or type(exc).__name__, 400))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(
            status_code=exc.status_code, content=error_body(str(exc.detail), exc.status_code), headers=exc.headers
        )

    admin = [Depends(srv.admin)]
    app.post("/generate")(srv.generate)
    app.post("/v1/completions")(srv.completions)
    app.post("/v1/chat/completions")(srv.chat)
    app.post("/update_weights_from_disk", dependencies=admin)(srv.update_from_disk)
    app.post("/update_weights_from_tensor", dependencies=admin)(srv.upload)
    app.post("/init_weights_update_group", dependencies=admin)(srv.init_group)
    app.post("/update_weights_from_distributed", dependencies=admin)(srv.update_distributed)
    app.post("/destroy_weights_update_group", dependencies=admin)(srv.destroy_group)

    @app.post("/pause_generation", dependencies=admin)
    async def pause(req: PauseRequest | None = None) -> dict[str, object]:
        """SGLang's modes: ``abort`` (the default) ends in-flight requests with finish_reason abort
        (and their partial output); ``in_place`` / ``retract`` keep them to continue on resume."""
        mode = req.mode if req is not None else "abort"
        await asyncio.to_thread(srv.engine.pause)
        if mode == "abort":
            await asyncio.to_thread(srv.engine.abort_running)
        srv.paused = True
        return {"success": True, "message": f"paused ({mode})"}

    @app.post("/abort_request", dependencies=admin)
    async def abort_request(req: AbortRequest) -> JSONResponse:
        """SGLang's abort: the request ``rid`` (or, with ``abort_all``, every one) ends now with
        finish_reason abort and the tokens generated so far; an unknown rid is a no-op, as in SGLang."""
        if req.abort_all:
            before = srv.engine.counters["aborts"]
            await asyncio.to_thread(srv.engine.abort_running)
            n = srv.engine.counters["aborts"] - before
        else:
            n = await asyncio.to_thread(srv.engine.abort_rid, req.rid) if req.rid else 0
        return JSONResponse({"success": True, "message": f"aborted {n} request(s)", "aborted": n})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return Response("Cache flushed.\n", media_type="text/plain")  # relayrl keeps no prefix cache between requests

    @app.post("/continue_generation", dependencies=admin)
    async def resume() -> dict[str, object]:
        await asyncio.to_thread(srv.engine.resume)
        srv.paused = False
        return {"success": True, "message": "resumed"}

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "weight_version": str(srv.engine.get_version())}

    @app.get("/get_weight_version")
    async def weight_version() -> dict[str, object]:
        return {"weight_version": str(srv.engine.get_version())}

    @app.get("/version")
    async def version() -> dict[str, object]:
        from relayrl import __version__

        return {"version": __version__, "server": "relayrl"}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, object]:
        return {
            **(await version()),
            "tp_size": 1,
            "dp_size": 1,
            "model_path": srv.cfg.model.path,
            "served_model_name": srv.cfg.model.path,
            "weight_version": str(srv.engine.get_version()),
        }

    @app.get("/model_info")
    async def sglang_model_info() -> dict[str, object]:
        return {
            "model_path": srv.cfg.model.path,
            "tokenizer_path": srv.cfg.model.tokenizer_path or srv.cfg.model.path,
            "is_generation": True,
            "weight_version": str(srv.engine.get_version()),
        }

    @app.get("/get_model_info")
    async def model_info() -> dict[str, object]:
        return {
            **(await sglang_model_info()),
            "vocab_size": srv.vocab_size,
            "max_position_embeddings": srv.max_positions,
            "paused": srv.paused,
            "requests_served": srv.n_served,
            "generate_calls": srv.n_calls,
            "tokens_generated": srv.engine.counters["tokens"],
            "aborts": srv.engine.counters["aborts"],
        }

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": srv.cfg.model.path, "object": "model", "owned_by": "relayrl"}]}

    return app


def make_server(cfg: ServerConfig) -> Server:
    """Load the model and tokenizer of ``cfg``, start a LocalEngine, wrap it."""
    from relayrl.data.models import load_model, load_tokenizer

    torch.set_num_threads(cfg.torch_threads)
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model).eval()
    reference = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    engine = LocalEngine(cfg.inference, model=model, tokenizer=tok, model_config=cfg.model)
    engine.initialize()
    max_positions = int(getattr(model.config.get_text_config(), "max_position_embeddings", 2048))
    return Server(engine, tok, cfg, engine.vocab_size, max_positions, reference)


def _write_token(token: str, port: int) -> Path:
    """``$RELAYRL_CACHE/serve/admin-token-PORT`` (default cache ``~/.cache/relayrl``), mode 0600."""
    folder = Path(os.environ.get("RELAYRL_CACHE") or Path.home() / ".cache" / "relayrl").expanduser() / "serve"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"admin-token-{port}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return path


def run_server(cfg: ServerConfig) -> None:
    """Serve until SIGINT/SIGTERM. With ``port=0`` a free port is picked; either way the
    line ``relayrl server listening on http://HOST:PORT`` is printed once ready."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:  # before the model loads: a busy port fails at once
        sock.bind((cfg.host, cfg.port))
    except OSError as e:
        sock.close()
        raise ConfigError(
            f"port={cfg.port} on {cfg.host} cannot be bound ({e.strerror}): another process listens there; "
            "pick another with --port (0 picks a free one)"
        ) from None
    sock.listen(2048)
    srv = make_server(cfg)
    port = sock.getsockname()[1]
    token_file = None
    if not srv.token:  # admin routes are never open: a random token, in a file only this user reads
        srv.token = secrets.token_urlsafe(32)
        token_file = _write_token(srv.token, port)
        print(
            f"relayrl serve: no admin token given; admin routes need 'Authorization: Bearer <token>' with the "
            f"token in {token_file} (or start with RELAYRL_ADMIN_TOKEN / --admin-token-file)",
            file=sys.stderr,
            flush=True,
        )
    app = build_app(srv)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        print(f"{LISTEN_PREFIX}http://{cfg.host}:{port}", flush=True)
        yield
        srv.engine.destroy()
        if token_file is not None:
            token_file.unlink(missing_ok=True)

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=60,
        backlog=2048,
        limit_concurrency=cfg.max_connections,  # beyond: 503 at once
    )
    uvicorn.Server(config).run(sockets=[sock])
