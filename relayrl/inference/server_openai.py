"""OpenAI routes of ``relayrl serve``: ``/v1/completions`` and ``/v1/chat/completions`` with logprobs."""

from __future__ import annotations

import asyncio
import time
import typing
import uuid
from collections.abc import Awaitable, Callable

from fastapi.responses import Response
from transformers import PreTrainedTokenizerBase

from relayrl.api.config import ServerConfig
from relayrl.api.io import GenerationConfig, ModelResponse
from relayrl.inference.schemas import ChatRequest, CompletionRequest, SamplingParams
from relayrl.inference.server_common import _bad, _json, _usage, trim_stop


class OpenAIRoutes:
    """Mixed into ``Server`` (which provides ``tok``, ``cfg``, ``gconfig``, ``check_ids``, ``run``, ``decode``)."""

    # what Server provides (declared for the type checker)
    tok: PreTrainedTokenizerBase
    cfg: ServerConfig
    max_positions: int
    n_calls: int
    gconfig: Callable[..., GenerationConfig]
    check_ids: Callable[[list[int], str], None]
    run: Callable[..., Awaitable[ModelResponse]]
    decode: Callable[..., str]

    def openai_gconfig(
        self, req: CompletionRequest | ChatRequest, prompt_len: int, prompt: str = "prompt"
    ) -> GenerationConfig:
        max_tokens = (req.max_completion_tokens or req.max_tokens) if isinstance(req, ChatRequest) else req.max_tokens
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        sp = SamplingParams(
            max_new_tokens=max_tokens or max(1, min(1024, self.max_positions - prompt_len)),
            min_new_tokens=getattr(req, "min_tokens", 0),
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=stop,
            stop_token_ids=list(getattr(req, "stop_token_ids", [])),
            ignore_eos=getattr(req, "ignore_eos", False),
        )
        return self.gconfig(sp, prompt_len, field="body", prompt=prompt)

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
        if req.stream or req.echo:
            raise _bad("stream and echo are not supported")
        prompts, many = self.completion_prompts(req.prompt)
        gs = []
        for p, ids in enumerate(prompts):
            name = f"prompt[{p}]" if many else "prompt"
            self.check_ids(ids, name)
            gs.append(self.openai_gconfig(req, len(ids), prompt=name))
        cid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        jobs = [
            (f"{cid}-{p * req.n + i}", ids, g)
            for p, (ids, g) in enumerate(zip(prompts, gs, strict=True))
            for i in range(req.n)
        ]
        outs = await asyncio.gather(*(self.run(*job) for job in jobs))
        self.n_calls += 1
        choices = []
        for i, r in enumerate(outs):
            lp = None
            if req.logprobs is not None:
                toks = [
                    f"token_id:{t}" if req.return_tokens_as_token_ids else self.decode([t], False)
                    for t in r.output_tokens
                ]
                offsets, pos = [], 0
                for s in toks:
                    offsets.append(pos)
                    pos += len(s)
                lp = {"tokens": toks, "token_logprobs": r.output_logprobs, "top_logprobs": None, "text_offset": offsets}
            text = self.decode(r.output_tokens, req.skip_special_tokens)
            if (
                r.stop_reason == "stop" and gs[i // req.n].stop
            ):  # the stop string is not part of the text (vLLM, OpenAI)
                text = trim_stop(text, gs[i // req.n].stop)
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": r.stop_reason,
                    "token_ids": r.output_tokens,
                    "token_versions": r.output_versions,
                }
            )
        return _json(
            {
                "id": cid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.cfg.model.path,
                "choices": choices,
                "usage": _usage(sum(len(ids) for ids in prompts), outs),
            }
        )

    def vision_prompt(self, messages: list[dict[str, object]]) -> tuple[list[int], list[str | bytes]]:
        """Prompt ids (image pad tokens expanded by the model's processor) and images of chat turns
        with content parts; 400 naming the reason when the model takes no images or one is bad."""
        from relayrl.data.vision import encode_prompt

        processor = self.engine.image_processor  # type: ignore[attr-defined]
        if processor is None:
            raise _bad("messages: image content parts need a vision-language model; this server's takes text only")
        try:
            vp = encode_prompt(self.tok, processor, messages, [])
        except ValueError as e:
            raise _bad(f"messages: {e}") from None
        return vp.input_ids, list(vp.image_data)

    async def chat(self, req: ChatRequest) -> dict[str, object]:
        if req.stream:
            raise _bad("stream: streaming is not supported")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        images: list[str | bytes] = []
        if any(isinstance(m["content"], list) for m in messages):  # OpenAI content parts: text and image_url
            ids, images = self.vision_prompt(messages)
        else:
            try:
                ids = [
                    int(i)
                    for i in typing.cast(
                        list[int],
                        self.tok.apply_chat_template(
                            messages, add_generation_prompt=True, tokenize=True, return_dict=False
                        ),
                    )
                ]
            except Exception as e:  # a template may reject a role order
                raise _bad(f"messages: chat template failed: {e}") from None
        g = self.openai_gconfig(req, len(ids))
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        outs = await asyncio.gather(*(self.run(f"{cid}-{i}", ids, g, images=images) for i in range(req.n)))
        choices = []
        for i, r in enumerate(outs):
            lp = None
            if req.logprobs:
                per_token = []
                for t, x in zip(r.output_tokens, r.output_logprobs, strict=True):
                    s = self.decode([t], False)
                    per_token.append({"token": s, "logprob": x, "bytes": list(s.encode()), "top_logprobs": []})
                lp = {"content": per_token}
            content = (
                trim_stop(self.decode(r.output_tokens), g.stop)
                if r.stop_reason == "stop"
                else self.decode(r.output_tokens)
            )
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": content},
                    "logprobs": lp,
                    "finish_reason": r.stop_reason,
                    "token_ids": r.output_tokens,
                }
            )
        return {
            "id": cid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.cfg.model.path,
            "choices": choices,
            "usage": _usage(len(ids), outs),
        }
