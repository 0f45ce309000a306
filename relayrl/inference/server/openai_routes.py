"""OpenAI routes of ``relayrl serve``: ``/v1/completions`` and ``/v1/chat/completions``.

Chat requests go through ``relayrl.agents.OpenAIClient`` over the server's engine (one per
request), so the server reads what the agents' client reads: tools rendered by the chat template
and tool calls parsed from the reply (Hermes / Llama-3.1), ``tool_choice`` ``auto`` | ``none`` |
``required`` | a named function (the call's opening written into the prompt), ``tool`` turns
with ``tool_call_id``, content parts, the ``developer`` role, ``top_logprobs``, frequency and
presence penalties, ``response_format`` ``text`` / ``json_object`` (accepted, not enforced) and
``stream=true`` (server-sent events, token by token, a usage chunk with
``stream_options.include_usage``). vLLM's extras ``top_k``, ``min_tokens``, ``ignore_eos`` and
``stop_token_ids`` are read too. Each choice also carries the generated ``token_ids``. These
routes need the ``openai`` package (``pip install 'relayrl[agents]'``); ``/generate`` does not.

Completions take text or token ids (or lists of either), ``n``, ``logprobs=k`` (the sampled
token's and the ``k`` best), the penalties, and ``stream=true`` for one prompt.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import typing
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from relayrl.api.commands import ServerConfig
from relayrl.api.io import GenerationConfig, ModelResponse
from relayrl.data.vision import IMAGE_PARTS, encode_prompt, image_parts, inline_image
from relayrl.inference.server.common import _bad, _json, error_body, trim_stop
from relayrl.inference.server.schemas import CompletionRequest, SamplingParams

if TYPE_CHECKING:
    from relayrl.agents.messages import RequestError
    from relayrl.inference.local.engine import LocalEngine

# CompletionRequest's fields that SamplingParams names alike
SAMPLING_FIELDS = set("temperature top_p top_k stop_token_ids ignore_eos frequency_penalty presence_penalty".split())
VLLM_EXTRAS = {"top_k": "top_k", "min_tokens": "min_new_tokens", "ignore_eos": "ignore_eos"}


def _agents() -> None:
    """relayrl.agents, imported on first use (it needs the openai package, which /generate does not)."""
    try:
        import relayrl.agents.streaming  # noqa: F401
    except ImportError as e:
        raise _bad(f"this route needs the openai package: pip install 'relayrl[agents]' ({e})", 501) from None


def _refusal(e: RequestError) -> JSONResponse:
    """OpenAI's error body; the message names the field, as the server's other errors do."""
    message = f"{e.param}: {e.message}" if e.param else e.message
    body = dict(typing.cast(dict[str, object], e.body))
    return JSONResponse({"error": {**body, "message": message}, "detail": message}, status_code=400)


class OpenAIRoutes:
    """Mixed into ``Server`` (which provides ``tok``, ``cfg``, ``engine``, ``gconfig``, ``check_ids``, ``run``, ``decode``)."""

    # what Server provides (declared for the type checker)
    tok: PreTrainedTokenizerBase
    cfg: ServerConfig
    engine: LocalEngine
    max_positions: int
    vocab_size: int
    n_calls: int
    n_served: int
    gconfig: Callable[..., GenerationConfig]
    check_ids: Callable[[list[int], str], None]
    run: Callable[..., Awaitable[ModelResponse]]
    decode: Callable[..., str]

    def openai_gconfig(self, req: CompletionRequest, ids: list[int], prompt: str) -> GenerationConfig:
        """The generation config of one prompt (``prompt``: its name in errors), its ids checked."""
        self.check_ids(ids, prompt)
        sp = SamplingParams(
            max_new_tokens=req.max_tokens or max(1, min(1024, self.max_positions - len(ids))),
            min_new_tokens=req.min_tokens,
            stop=req.stop or [],
            **req.model_dump(include=SAMPLING_FIELDS),
        )
        return self.gconfig(sp, len(ids), field="body", prompt=prompt)

    def completion_prompts(self, prompt: str | list[int] | list[list[int]] | list[str]) -> tuple[list[list[int]], bool]:
        """(token ids of each prompt, whether a list of prompts was sent)."""
        if isinstance(prompt, str):
            return [list(self.tok.encode(prompt))], False
        if prompt and isinstance(prompt[0], str):
            return [list(self.tok.encode(p)) for p in prompt], True
        if prompt and isinstance(prompt[0], list):
            return [list(p) for p in prompt], True
        return [list(typing.cast(list[int], prompt))], False

    async def completions(self, req: CompletionRequest) -> Response:
        """Choice ``p * n + j`` is sample ``j`` of prompt ``p`` (vLLM's order)."""
        if req.echo:
            raise _bad("echo is not supported")
        prompts, many = self.completion_prompts(req.prompt)
        if req.stream and many:
            raise _bad("stream: one prompt per streamed request")
        gs = [self.openai_gconfig(req, ids, f"prompt[{p}]" if many else "prompt") for p, ids in enumerate(prompts)]
        if req.stream:
            _agents()
            from relayrl.agents.client import OpenAIClient
            from relayrl.agents.messages import RequestError
            from relayrl.agents.streaming import sse_events

            client = OpenAIClient(self.engine, self.tok, gs[0], model_name=self.cfg.model.path)
            params = {"n": req.n, "logprobs": req.logprobs, "stream": True, "stream_options": req.stream_options}
            try:
                chunks = await client.completions.create(prompt=prompts[0], **params)
            except RequestError as e:
                return _refusal(e)
            self.n_calls += 1
            return StreamingResponse(sse_events(chunks), media_type="text/event-stream")  # type: ignore[arg-type]
        cid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        runs = (self.run(f"{cid}-{i}", prompts[i // req.n], gs[i // req.n]) for i in range(len(prompts) * req.n))
        outs = await asyncio.gather(*runs)
        self.n_calls += 1
        choices = []

        def piece(t: int) -> str:
            return f"token_id:{t}" if req.return_tokens_as_token_ids else self.decode([t], False)

        for i, r in enumerate(outs):
            g, ids = gs[i // req.n], prompts[i // req.n]
            lp = None
            if req.logprobs is not None:
                toks = [piece(t) for t in r.output_tokens]
                offsets = list(itertools.accumulate(map(len, toks[:-1]), initial=0)) if toks else []
                tops = None
                if req.logprobs:
                    alts = await self.engine.atop_logprobs(ids, r.output_tokens, g, req.logprobs)
                    tops = [{piece(j): v for j, v in a} for a in alts]
                lp = {"tokens": toks, "token_logprobs": r.output_logprobs, "top_logprobs": tops, "text_offset": offsets}
            choices.append(
                {
                    "index": i,
                    "text": trim_stop(self.decode(r.output_tokens, req.skip_special_tokens), g.stop, r.stop_reason),
                    "logprobs": lp,
                    "finish_reason": r.stop_reason,
                    "token_ids": r.output_tokens,
                    "token_versions": r.output_versions,
                }
            )
        n_in, n_out = sum(len(ids) for ids in prompts), sum(r.output_len for r in outs)
        return _json(
            {
                "id": cid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.cfg.model.path,
                "choices": choices,
                "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
            }
        )

    def vision_messages(self, messages: object, stream: bool) -> tuple[list[int], list[str | bytes]]:
        """Prompt ids (image pad tokens expanded by the model's processor) and images of chat turns
        with image content parts (``IMAGE_PARTS``; ``[], []`` without any); 400 naming the reason when the model
        takes no images, one is bad, or the request streams."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return [], []  # the client names what is malformed
        if not image_parts(messages):
            return [], []
        if stream:
            raise _bad("stream: image content parts are served without streaming; send stream=false")
        processor = self.engine.image_processor
        if processor is None:
            raise _bad("messages: image content parts need a vision-language model; this server's takes text only")
        try:
            vp = encode_prompt(self.tok, processor, _inline_images(typing.cast(list[dict[str, object]], messages)), [])
        except ValueError as e:
            raise _bad(f"messages: {e}") from None
        return vp.input_ids, list(vp.image_data)

    def chat_base(self, body: dict[str, object]) -> GenerationConfig:
        """The generation config before the OpenAI fields: vLLM's extras popped from ``body``; the
        length bound is set once the prompt is known."""
        from relayrl.agents.messages import RequestError

        extras = {VLLM_EXTRAS[k]: body.pop(k) for k in list(body) if k in VLLM_EXTRAS}
        stop_ids = body.pop("stop_token_ids", None) or []
        if not isinstance(stop_ids, list) or not all(type(t) is int and 0 <= t < self.vocab_size for t in stop_ids):
            raise RequestError(f"stop_token_ids must be token ids in [0, {self.vocab_size})", "stop_token_ids")
        for key, name in VLLM_EXTRAS.items():
            want = bool if key == "ignore_eos" else int
            if name in extras and type(extras[name]) is not want:  # JSON's true is no integer, 1 no boolean
                raise RequestError(f"{key} must be {'a boolean' if want is bool else 'an integer'}", key)
        if "top_k" in extras:
            extras["top_k"] = max(0, extras["top_k"])  # type: ignore[call-overload]  # vLLM: -1 = off
        try:
            base = GenerationConfig(max_new_tokens=self.max_positions, stop_token_ids=stop_ids, **extras)  # type: ignore[arg-type]
            base.validate()
        except (TypeError, ValueError) as e:
            raise RequestError(str(e), next((k for k in VLLM_EXTRAS if VLLM_EXTRAS[k] in str(e)), None)) from None
        return base

    async def chat(self, request: Request) -> Response:
        """OpenAI's chat completion through ``OpenAIClient`` (see module doc)."""
        _agents()
        from relayrl.agents.client import OpenAIClient
        from relayrl.agents.messages import RequestError
        from relayrl.agents.streaming import sse_events, stream_chat
        from relayrl.data.chat import encode

        try:
            body = json.loads(await request.body() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return JSONResponse(error_body(f"malformed JSON body: {e}", 400), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the request body must be a JSON object", 400), status_code=400)
        try:
            base = self.chat_base(body)
        except RequestError as e:
            return _refusal(e)
        client = OpenAIClient(self.engine, self.tok, base, model_name=self.cfg.model.path)
        stream, options = bool(body.pop("stream", False)), body.pop("stream_options", None)
        explicit = body.get("max_tokens") or body.get("max_completion_tokens")
        messages = body.pop("messages", None) or []
        vision_ids, images = self.vision_messages(messages, stream)
        try:
            plan = client.plan_chat(_text_parts_only(messages) if images else messages, body)
            if images:  # the prompt as the processor expands it (image pad tokens), then any tool-call opening
                plan.ids = vision_ids + (encode(self.tok, plan.prefill) if plan.prefill else [])
        except RequestError as e:
            return _refusal(e)
        except (TypeError, ValueError, AttributeError, KeyError) as e:  # a field of a type no check expected
            return _refusal(RequestError(f"malformed request: {e!r}"))
        if not explicit:
            plan.gconfig = plan.gconfig.new(max_new_tokens=max(1, min(1024, self.max_positions - len(plan.ids))))
            plan.gconfig.min_new_tokens = min(plan.gconfig.min_new_tokens, plan.gconfig.max_new_tokens)
        if len(plan.ids) + plan.gconfig.max_new_tokens > self.max_positions:
            msg = (
                f"the prompt's {len(plan.ids)} tokens + max_tokens={plan.gconfig.max_new_tokens} exceed the "
                f"model's {self.max_positions} positions"
            )
            return _refusal(RequestError(msg, "max_tokens"))
        self.n_calls += 1
        self.n_served += plan.n
        if stream:
            usage = bool((options if isinstance(options, dict) else {}).get("include_usage"))
            return StreamingResponse(sse_events(stream_chat(client, plan, usage)), media_type="text/event-stream")
        try:
            done = await client.chat_result(plan, await client.generate(plan.ids, plan.gconfig, plan.n, images))
        except RequestError as e:
            return _refusal(e)
        out = done.model_dump(exclude_none=True)
        for choice, rec in zip(out["choices"], client.records[-plan.n :], strict=True):
            choice["token_ids"] = rec.output_ids
        return _json(out)


def _text_parts_only(messages: list[object]) -> list[object]:
    """Chat turns with their image parts dropped (the prompt ids come from the processor; the
    client validates the rest of the request)."""
    out: list[object] = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            kept = [p for p in m["content"] if not (isinstance(p, dict) and p.get("type") in IMAGE_PARTS)]
            m = {**m, "content": kept}
        out.append(m)
    return out


def _inline_images(messages: list[dict[str, object]]) -> list[dict[str, object]]:
    """``messages`` with each image part's data decoded to bytes (``inline_image``: a data URL or
    base64, never a path on this machine)."""
    out, j = [], 0
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts: list[object] = []
        for p in content:
            if isinstance(p, dict) and p.get("type") in IMAGE_PARTS:
                url = p.get("image") if p.get("type") == "image" else p.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                p = {"type": "image", "image": inline_image(url, f"image {j}")}
                j += 1
            parts.append(p)
        out.append({**m, "content": parts})
    return out
