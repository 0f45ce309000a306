"""``relayrl serve``: an HTTP server around LocalEngine.

Speaks SGLang's native protocol (``/generate``, ``/update_weights_from_disk``, weights by
collective broadcast (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``: NCCL on GPUs, gloo on CPU), ``/pause_generation``,
``/continue_generation``, ``/health``, ``/get_model_info``, ``/get_weight_version``), a
safetensors weight upload (``/update_weights_from_tensor``), and
OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` with logprobs, so the same process
serves RemoteEngine (any of its protocols) and agents written against the OpenAI SDK.
The OpenAPI schema is at ``/openapi.json``.

``/generate`` also takes SGLang's batch form (``input_ids`` a list of prompts; ``rid``,
``sampling_params`` and ``return_logprob`` one per item or one for all) and answers a list of
per-item replies; ``/v1/completions`` takes a list of prompts (one choice per prompt and sample).
Every body is validated (unknown fields, out-of-range values, out-of-vocabulary ids) and
answered with a 4xx naming the field (and the item index in a batch); the process stays up.
Admin routes (weights, pause) need ``Authorization: Bearer <token>`` when a token is
configured. Disk paths are confined to ``allowed_weight_roots`` (symlinks resolved, ``..`` refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import math
import os
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import safetensors.torch
import torch
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from relayrl.api.config import ServerConfig
from relayrl.api.engine import InferenceEngine
from relayrl.api.io import GenerationConfig, ModelRequest, ModelResponse, WeightUpdate
from relayrl.inference.schemas import (
    ChatRequest,
    CompletionRequest,
    DestroyWeightGroup,
    DiskUpdate,
    DistributedUpdate,
    GenerateBatchRequest,
    GenerateBody,
    GenerateRequest,
    InitWeightGroup,
    PauseRequest,
    SamplingParams,
)
from relayrl.inference.weight_group import WeightBroadcastGroup, parse_dtype

LISTEN_PREFIX = "relayrl server listening on "
GREEDY_BELOW = 1e-5  # temperatures below this decode greedily

_Job = tuple[str, list[int], GenerationConfig, bool, bool]  # rid, prompt ids, gconfig, return_logprob, skip_special_tokens


def _bad(msg: str, status: int = 400) -> HTTPException:
    return HTTPException(status_code=status, detail=msg)


def _path(loc: tuple[object, ...]) -> str:
    """``("body", "<batch>", "sampling_params", "<many>", 3, "top_p")`` -> ``sampling_params[3].top_p``
    (union tags ``<...>`` dropped)."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p != "body" and not str(p).startswith("<"):
            out += f".{p}" if out else str(p)
    return out


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    """One readable line per problem, naming the field: ``sampling_params.top_p: ...``."""
    assert isinstance(exc, RequestValidationError)
    msgs = []
    for err in exc.errors():
        loc = _path(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            msgs.append(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
        elif err.get("type") == "extra_forbidden":
            msgs.append(f"unknown field '{loc}'")
        else:
            msgs.append(f"{loc or 'body'}: {err.get('msg')} (got {str(err.get('input'))[:80]!r})")
    return JSONResponse(status_code=400, content={"error": "; ".join(msgs), "detail": "; ".join(msgs)})


def confine_path(path: str, roots: list[str]) -> Path:
    """``path`` resolved (symlinks followed) if it lies inside one of ``roots``, else 403."""
    if not roots:
        raise _bad("loading weights from disk is disabled: the server has no allowed_weight_roots", 403)
    if "\x00" in path:
        raise _bad(f"model_path {path!r}: NUL characters are refused")
    if ".." in Path(path).parts:
        raise _bad(f"model_path {path!r}: '..' components are refused", 403)
    try:
        real = Path(path).resolve()
    except (OSError, RuntimeError) as e:  # e.g. a name too long for the OS
        raise _bad(f"model_path {path!r} cannot be resolved: {e}") from None
    if not any(real.is_relative_to(Path(r).resolve()) for r in roots):
        raise _bad(f"model_path {path!r} resolves outside the allowed weight roots", 403)
    try:
        is_dir = real.is_dir()
    except OSError as e:  # e.g. a name too long for the OS
        raise _bad(f"model_path {path!r} cannot be read: {e.strerror}") from None
    if not is_dir:
        raise _bad(f"model_path {path!r} is not a directory", 400)
    return real


class Server:
    """The routes, bound to one engine and tokenizer."""

    def __init__(self, engine: InferenceEngine, tokenizer: object, cfg: ServerConfig, vocab_size: int,
                 max_positions: int, reference: dict[str, tuple[torch.Size, torch.dtype]] | None = None) -> None:
        self.engine, self.tok, self.cfg = engine, tokenizer, cfg
        self.vocab_size, self.max_positions = vocab_size, max_positions
        self.reference = reference or {}  # parameter name -> (shape, dtype), to check updates
        self.token = cfg.admin_token or os.environ.get("RELAYRL_ADMIN_TOKEN", "")
        self.weight_lock = asyncio.Lock()
        self.groups: dict[str, WeightBroadcastGroup] = {}  # weight groups this server joined, by name
        self.paused = False
        self.n_served = 0  # generation requests answered
        self.n_calls = 0  # HTTP calls that carried them (a batch is one)

    # ---------------------------------------------------------------- helpers
    def admin(self, request: Request) -> None:
        if not self.token:
            return
        header = request.headers.get("authorization", "")
        if not header:
            raise HTTPException(401, "admin endpoint: missing 'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": "Bearer"})
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self.token.encode()):
            raise _bad("admin endpoint: invalid bearer token", 403)

    def check_ids(self, ids: list[int], field: str) -> None:
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise _bad(f"{field}[{i}]={t} is out of vocabulary [0, {self.vocab_size})")

    def gconfig(self, sp: SamplingParams, prompt_len: int, field: str = "sampling_params",
                prompt: str = "input_ids") -> GenerationConfig:
        greedy = sp.temperature < GREEDY_BELOW  # as SGLang and vLLM do: a tinier one only overflows the logits
        stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop)
        g = GenerationConfig(
            max_new_tokens=sp.max_new_tokens, min_new_tokens=sp.min_new_tokens, greedy=greedy,
            temperature=1.0 if greedy else sp.temperature, top_p=sp.top_p, top_k=max(sp.top_k, 0),
            stop_token_ids=list(sp.stop_token_ids), stop=stop, ignore_eos=sp.ignore_eos,
        )
        try:
            g.validate()
        except ValueError as e:
            raise _bad(f"{field}.{e}") from None
        self.check_ids(g.stop_token_ids, f"{field}.stop_token_ids")
        if prompt_len == 0:
            raise _bad(f"{prompt}: the prompt is empty")
        if prompt_len + g.max_new_tokens > self.max_positions:
            raise _bad(f"{prompt}: input length {prompt_len} + {field}.max_new_tokens={g.max_new_tokens} exceeds the "
                       f"model's {self.max_positions} positions")
        return g

    async def run(self, rid: str, ids: list[int], g: GenerationConfig) -> ModelResponse:
        try:
            resp = await self.engine.agenerate(ModelRequest(rid=rid, input_ids=ids, gconfig=g))
        except ValueError as e:
            raise _bad(f"request {rid}: {e}") from None
        self.n_served += 1
        return resp

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=skip_special))  # type: ignore[attr-defined]

    def finish(self, r: ModelResponse) -> dict[str, object]:
        if r.stop_reason == "length":
            return {"type": "length", "length": r.output_len}
        if r.stop_reason == "abort":
            return {"type": "abort", "message": "aborted"}
        return {"type": "stop", "matched": r.output_tokens[-1] if r.output_tokens else None}

    # ---------------------------------------------------------------- SGLang native
    async def generate(self, req: GenerateBody) -> Response:  # type: ignore[valid-type]
        """One prompt -> one reply object; SGLang's batch form -> a list of them, in order (or,
        with ``stream_items``, NDJSON lines in the order the items finish)."""
        self.n_calls += 1
        if isinstance(req, GenerateBatchRequest):
            jobs = self.batch_jobs(req)
            if req.stream_items:
                return StreamingResponse(self.stream_items(jobs), media_type="application/x-ndjson")
            return _json(list(await asyncio.gather(*(self.generate_item(*job) for job in jobs))))
        return _json(await self.generate_one(req))

    async def generate_one(self, req: GenerateRequest) -> dict[str, object]:
        if req.stream:
            raise _bad("stream: streaming is not supported; send stream=false")
        if (req.input_ids is None) == (req.text is None):
            raise _bad("give exactly one of input_ids or text")
        ids = req.input_ids if req.input_ids is not None else list(self.tok.encode(req.text))  # type: ignore[attr-defined]
        self.check_ids(ids, "input_ids")
        g = self.gconfig(req.sampling_params, len(ids))
        rid = req.rid or uuid.uuid4().hex
        r = await self.run(rid, ids, g)
        return self.reply(rid, r, req.return_logprob, req.sampling_params.skip_special_tokens)

    def batch_jobs(self, req: GenerateBatchRequest) -> list[_Job]:
        """Every item validated before any is generated (errors name the item index)."""
        if req.stream:
            raise _bad("stream: streaming is not supported; send stream=false")
        if (req.input_ids is None) == (req.text is None):
            raise _bad("give exactly one of input_ids or text")
        prompts = req.input_ids if req.input_ids is not None else [list(self.tok.encode(t)) for t in req.text or []]  # type: ignore[attr-defined]
        n = len(prompts)
        sps: list[SamplingParams] = _per_item(req.sampling_params, n, "sampling_params")
        logprob: list[bool] = _per_item(req.return_logprob, n, "return_logprob")
        if isinstance(req.rid, list):
            rids = _per_item(req.rid, n, "rid")
        else:
            prefix = req.rid or uuid.uuid4().hex
            rids = [f"{prefix}-{i}" for i in range(n)]
        jobs = []
        for i, ids in enumerate(prompts):
            self.check_ids(ids, f"input_ids[{i}]")
            g = self.gconfig(sps[i], len(ids), field=f"sampling_params[{i}]", prompt=f"input_ids[{i}]")
            jobs.append((rids[i], ids, g, logprob[i], sps[i].skip_special_tokens))
        return jobs

    async def generate_item(self, rid: str, ids: list[int], g: GenerationConfig, logprob: bool, skip: bool) -> dict[str, object]:
        return self.reply(rid, await self.run(rid, ids, g), logprob, skip)

    async def stream_items(self, jobs: list[_Job]) -> AsyncIterator[bytes]:
        """One NDJSON line per item as soon as it finishes: a batch costs one HTTP call, yet no
        item waits for the slowest one."""

        async def indexed(i: int, job: _Job) -> tuple[int, dict[str, object]]:
            try:
                return i, await self.generate_item(*job)
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

    def reply(self, rid: str, r: ModelResponse, logprob: bool, skip_special: bool) -> dict[str, object]:
        """One item's SGLang reply (+ relayrl's per-token ``output_token_versions``)."""
        meta: dict[str, object] = {
            "id": rid, "prompt_tokens": r.input_len, "completion_tokens": r.output_len,
            "finish_reason": self.finish(r),
            "weight_version": r.output_versions[-1] if r.output_versions else self.engine.get_version(),
            "output_token_versions": r.output_versions, "e2e_latency": r.latency, "ttft": r.ttft,
        }
        if logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.output_logprobs, r.output_tokens, strict=True)]
        return {"text": self.decode(r.output_tokens, skip_special), "output_ids": r.output_tokens, "meta_info": meta}

    def check_weights(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Every served parameter present (a tied lm_head may be left out), none unknown, shapes equal."""
        if not self.reference:
            return
        for name, shape in shapes.items():
            if name not in self.reference:
                raise _bad(f"weights: unknown parameter {name!r}")
            if tuple(shape) != tuple(self.reference[name][0]):
                raise _bad(f"weights: {name} has shape {tuple(shape)}, expected {tuple(self.reference[name][0])}")
        missing = sorted(set(self.reference) - set(shapes) - {"lm_head.weight"})
        if missing:
            raise _bad(f"weights: missing {len(missing)} parameters, e.g. {missing[:3]}")

    async def apply(self, tensors: dict[str, torch.Tensor], version: int | None) -> dict[str, object]:
        self.check_weights({name: tuple(t.shape) for name, t in tensors.items()})
        async with self.weight_lock:
            v = self.engine.get_version() + 1 if version is None else version
            update = WeightUpdate(kind="tensors", version=v, tensors=tensors)
            try:
                await asyncio.to_thread(self.engine.update_weights, update)
            except ValueError as e:  # e.g. missing parameters
                raise _bad(f"weights: {e}") from None
        return {"success": True, "message": f"loaded {len(tensors)} tensors", "weight_version": self.engine.get_version()}

    async def update_from_disk(self, req: DiskUpdate) -> dict[str, object]:
        path = confine_path(req.model_path, self.cfg.allowed_weight_roots)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise _bad(f"model_path {req.model_path!r} holds no *.safetensors file")
        tensors: dict[str, torch.Tensor] = {}
        for fp in files:
            tensors.update(safetensors.torch.load_file(str(fp)))
        return await self.apply(tensors, _version(req.weight_version))

    async def init_group(self, req: InitWeightGroup) -> dict[str, object]:
        """Join the trainer's weight group (blocks until every member joined; replaces a group of that name)."""
        self.groups.pop(req.group_name, None)
        try:
            self.groups[req.group_name] = await asyncio.to_thread(lambda: WeightBroadcastGroup(
                req.master_address, req.master_port, req.world_size, req.rank_offset, req.backend, req.group_name,
                self.cfg.inference.request_timeout).join())
        except (RuntimeError, ValueError, TypeError, OSError) as e:  # bad address, timeout, no CUDA for nccl
            raise _bad(f"could not join weight group {req.group_name!r} at {req.master_address}:{req.master_port}: {e}") from None
        return {"success": True, "message": f"joined {req.group_name!r} as rank {req.rank_offset} of {req.world_size}"}

    async def update_distributed(self, req: DistributedUpdate) -> dict[str, object]:
        """Receive ``names`` by broadcast from rank 0, then load them like any other update."""
        group = self.groups.get(req.group_name)
        if group is None:
            raise _bad(f"no weight group {req.group_name!r}: call /init_weights_update_group first")
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            raise _bad(f"names, dtypes and shapes differ in length ({len(req.names)}, {len(req.dtypes)}, {len(req.shapes)})")
        self.check_weights({n: tuple(shape) for n, shape in zip(req.names, req.shapes, strict=True)})  # before allocating
        try:
            buffers = {n: torch.empty(shape, dtype=parse_dtype(d)) for n, d, shape in zip(req.names, req.dtypes, req.shapes, strict=True)}
        except ValueError as e:
            raise _bad(f"dtypes: {e}") from None
        try:
            await asyncio.to_thread(group.broadcast, buffers)
        except RuntimeError as e:  # a member died or timed out: this group is unusable (a newer one may have replaced it)
            if self.groups.get(req.group_name) is group:
                del self.groups[req.group_name]
            raise _bad(f"weight broadcast in {req.group_name!r} failed: {e}", 500) from None
        return await self.apply(buffers, _version(req.weight_version))

    async def destroy_group(self, req: DestroyWeightGroup) -> dict[str, object]:
        left = self.groups.pop(req.group_name, None) is not None
        return {"success": left, "message": f"{'left' if left else 'no weight group'} {req.group_name!r}"}

    async def upload(self, request: Request) -> dict[str, object]:
        limit = self.cfg.max_upload_mb << 20
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > limit:
            raise _bad(f"upload of {declared} bytes exceeds max_upload_mb={self.cfg.max_upload_mb}", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _bad(f"upload exceeds max_upload_mb={self.cfg.max_upload_mb}", 413)
            chunks.append(chunk)
        try:
            tensors = safetensors.torch.load(b"".join(chunks))
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise _bad(f"body is not a safetensors file: {e}") from None
        if not tensors:
            raise _bad("body holds no tensors")
        return await self.apply(tensors, _version(request.query_params.get("weight_version")))

    # ---------------------------------------------------------------- OpenAI
    def openai_gconfig(self, req: CompletionRequest | ChatRequest, prompt_len: int, prompt: str = "prompt") -> GenerationConfig:
        max_tokens = (req.max_completion_tokens or req.max_tokens) if isinstance(req, ChatRequest) else req.max_tokens
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        sp = SamplingParams(
            max_new_tokens=max_tokens or max(1, min(1024, self.max_positions - prompt_len)),
            min_new_tokens=getattr(req, "min_tokens", 0), temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, stop=stop, stop_token_ids=list(getattr(req, "stop_token_ids", [])),
            ignore_eos=getattr(req, "ignore_eos", False),
        )
        return self.gconfig(sp, prompt_len, field="body", prompt=prompt)

    def completion_prompts(self, prompt: str | list[int] | list[list[int]] | list[str]) -> tuple[list[list[int]], bool]:
        """(token ids of each prompt, whether a list of prompts was sent)."""
        if isinstance(prompt, str):
            return [list(self.tok.encode(prompt))], False  # type: ignore[attr-defined]
        if prompt and isinstance(prompt[0], str):
            return [list(self.tok.encode(p)) for p in prompt], True  # type: ignore[attr-defined]
        if prompt and isinstance(prompt[0], list):
            return [list(p) for p in prompt], True  # type: ignore[arg-type]
        return [list(prompt)], False  # type: ignore[arg-type]

    async def completions(self, req: CompletionRequest) -> Response:
        """Choice ``p * n + j`` is sample ``j`` of prompt ``p`` (vLLM's order)."""
        if req.stream or req.echo:
            raise _bad("stream and echo are not supported")
        prompts, many = self.completion_prompts(req.prompt)
        gs = []
        for p, ids in enumerate(prompts):
            name = f"prompt[{p}]" if many else "prompt"
            self.check_ids(ids, name)
            gs.append(self.openai_gconfig(req, len(ids), prompt=name))
        cid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        jobs = [(f"{cid}-{p * req.n + i}", ids, g) for p, (ids, g) in enumerate(zip(prompts, gs, strict=True)) for i in range(req.n)]
        outs = await asyncio.gather(*(self.run(*job) for job in jobs))
        self.n_calls += 1
        choices = []
        for i, r in enumerate(outs):
            lp = None
            if req.logprobs is not None:
                toks = [f"token_id:{t}" if req.return_tokens_as_token_ids else self.decode([t], False) for t in r.output_tokens]
                offsets, pos = [], 0
                for s in toks:
                    offsets.append(pos)
                    pos += len(s)
                lp = {"tokens": toks, "token_logprobs": r.output_logprobs, "top_logprobs": None, "text_offset": offsets}
            choices.append({"index": i, "text": self.decode(r.output_tokens, req.skip_special_tokens), "logprobs": lp,
                            "finish_reason": r.stop_reason, "token_ids": r.output_tokens,
                            "token_versions": r.output_versions})
        return _json({"id": cid, "object": "text_completion", "created": int(time.time()), "model": self.cfg.model.path,
                      "choices": choices, "usage": _usage(sum(len(ids) for ids in prompts), outs)})

    async def chat(self, req: ChatRequest) -> dict[str, object]:
        if req.stream:
            raise _bad("stream: streaming is not supported")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            ids = [int(i) for i in self.tok.apply_chat_template(  # type: ignore[attr-defined]
                messages, add_generation_prompt=True, tokenize=True, return_dict=False)]
        except Exception as e:  # a template may reject a role order
            raise _bad(f"messages: chat template failed: {e}") from None
        g = self.openai_gconfig(req, len(ids))
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        outs = await asyncio.gather(*(self.run(f"{cid}-{i}", ids, g) for i in range(req.n)))
        choices = []
        for i, r in enumerate(outs):
            lp = None
            if req.logprobs:
                content = []
                for t, x in zip(r.output_tokens, r.output_logprobs, strict=True):
                    s = self.decode([t], False)
                    content.append({"token": s, "logprob": x, "bytes": list(s.encode()), "top_logprobs": []})
                lp = {"content": content}
            choices.append({"index": i, "message": {"role": "assistant", "content": self.decode(r.output_tokens)},
                            "logprobs": lp, "finish_reason": r.stop_reason, "token_ids": r.output_tokens})
        return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": self.cfg.model.path,
                "choices": choices, "usage": _usage(len(ids), outs)}


def _version(v: object) -> int | None:
    if v is None or v == "":
        return None
    try:
        return int(v)  # type: ignore[call-overload, no-any-return]
    except (TypeError, ValueError):
        raise _bad(f"weight_version must be an integer, got {v!r}") from None


def _per_item(value: object, n: int, field: str) -> list:  # type: ignore[type-arg]
    """A batch field: one value per item (checked), or one value for all ``n`` items."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise _bad(f"{field}: {len(value)} values for {n} prompts (give one per prompt, or one for all)")
    return value


def _dumps(content: object) -> bytes:
    """Compact JSON; a non-finite float (a degenerate sampling setting can yield a -inf logprob)
    is written as null, as FastAPI's own encoder does, never as invalid JSON."""
    try:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        return json.dumps(_finite(content), ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _finite(x: object) -> object:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _json(content: object) -> Response:
    """A JSON reply written directly (no FastAPI encoder pass over every token and logprob)."""
    return Response(_dumps(content), media_type="application/json")


def _usage(prompt_len: int, outs: list[ModelResponse]) -> dict[str, int]:
    done = sum(r.output_len for r in outs)
    return {"prompt_tokens": prompt_len, "completion_tokens": done, "total_tokens": prompt_len + done}


class _JsonByDefault:
    """ASGI middleware: POST bodies without a JSON content type (``curl -d``) are read as JSON."""

    def __init__(self, app: object) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] != "/update_weights_from_tensor":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)  # type: ignore[operator]


def build_app(srv: Server) -> FastAPI:
    """The FastAPI app of one Server (routes are thin wrappers over its methods)."""
    app = FastAPI(title="relayrl inference server", version="1")
    app.add_middleware(_JsonByDefault)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"error": exc.detail, "detail": exc.detail},
                            headers=exc.headers)

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
        await asyncio.to_thread(srv.engine.pause)
        srv.paused = True
        return {"success": True, "message": "paused"}

    @app.post("/continue_generation", dependencies=admin)
    async def resume() -> dict[str, object]:
        await asyncio.to_thread(srv.engine.resume)
        srv.paused = False
        return {"success": True, "message": "resumed"}

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "weight_version": srv.engine.get_version()}

    @app.get("/get_weight_version")
    async def weight_version() -> dict[str, object]:
        return {"weight_version": srv.engine.get_version()}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, object]:
        return {"model_path": srv.cfg.model.path, "tokenizer_path": srv.cfg.model.tokenizer_path or srv.cfg.model.path,
                "is_generation": True, "vocab_size": srv.vocab_size, "max_position_embeddings": srv.max_positions,
                "weight_version": srv.engine.get_version(), "paused": srv.paused, "requests_served": srv.n_served,
                "generate_calls": srv.n_calls,
                "tokens_generated": srv.engine.stats["tokens"], "aborts": srv.engine.stats["aborts"]}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": srv.cfg.model.path, "object": "model", "owned_by": "relayrl"}]}

    return app


def make_server(cfg: ServerConfig) -> Server:
    """Load the model and tokenizer of ``cfg``, start a LocalEngine, wrap it."""
    from relayrl.data.models import load_model, load_tokenizer
    from relayrl.inference.local import LocalEngine

    torch.set_num_threads(cfg.torch_threads)
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model).eval()
    reference = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    engine = LocalEngine(cfg.inference, model=model, tokenizer=tok, model_config=cfg.model)
    engine.initialize()
    return Server(engine, tok, cfg, int(model.config.vocab_size), int(getattr(model.config, "max_position_embeddings", 2048)), reference)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return host == "localhost"


def run_server(cfg: ServerConfig) -> None:
    """Serve until SIGINT/SIGTERM. With ``port=0`` a free port is picked; either way the
    line ``relayrl server listening on http://HOST:PORT`` is printed once ready."""
    import uvicorn

    srv = make_server(cfg)
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    sock.listen(2048)
    port = sock.getsockname()[1]
    if not srv.token and not _is_loopback(cfg.host):
        print(f"relayrl serve: WARNING: listening on {cfg.host} with no admin token: anyone who can reach port {port} "
              "can replace the weights or pause generation (set admin_token or RELAYRL_ADMIN_TOKEN)", file=sys.stderr, flush=True)
    app = build_app(srv)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        print(f"{LISTEN_PREFIX}http://{cfg.host}:{port}", flush=True)
        yield
        srv.engine.destroy()

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=60, backlog=2048)
    uvicorn.Server(config).run(sockets=[sock])
