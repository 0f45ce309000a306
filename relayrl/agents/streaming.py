"""``stream=true`` for ``OpenAIClient``: the SDK's chunks, token by token, from ``InferenceEngine.astream``.

Text goes out as it is decoded, minus what may still turn out not to be content: a tail that
could begin a stop string (the stop string itself is never sent, as the final text excludes
it), the stop token, trailing whitespace, a character whose bytes have not all come yet, and,
when tools are on, everything from the tool-call marker on (``<tool_call>`` for Hermes; a
Llama-3.1 reply that opens with ``{`` or ``<|python_tag|>``). When the samples are done the call
is recorded exactly as without streaming (``OpenAIClient.chat_result``) and each choice ends with
one chunk carrying the rest of its content and its parsed tool calls, then one with
``finish_reason`` (and the logprobs, when asked for); with ``stream_options.include_usage`` a
last chunk carries the usage.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal, Protocol

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat.chat_completion_chunk import (
    Choice,
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceLogprobs,
)
from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from relayrl.agents.calls import ChatPlan, CompletionPlan
from relayrl.agents.messages import RequestError
from relayrl.api.io import GenerationConfig, ModelResponse, StreamChunk
from relayrl.rollout.workflows.multi_turn import reply_text

HERMES_OPEN = "<tool_call>"


class Source(Protocol):
    """What streaming uses of ``client.OpenAIClient``: its samples as they come, and the completion
    it records once they are done."""

    tokenizer: PreTrainedTokenizerBase
    model_name: str
    tool_parser: str

    def stream_samples(
        self, ids: list[int], gconfig: GenerationConfig, n: int
    ) -> AsyncIterator[tuple[int, StreamChunk]]: ...

    async def chat_result(
        self, plan: ChatPlan, resps: list[ModelResponse], cid: str | None = None
    ) -> ChatCompletion: ...

    async def completion_result(
        self, plan: CompletionPlan, resps: list[ModelResponse], cid: str | None = None
    ) -> Completion: ...


FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


def _partial(text: str, marks: list[str]) -> int:
    """Length of the longest tail of ``text`` that begins one of ``marks`` (and may complete it)."""
    return max((k for m in marks for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


def safe_prefix(text: str, stops: list[str], parser: str | None) -> str:
    """The part of ``text`` (a reply decoded so far) that is content whatever comes next (see module doc)."""
    marks = list(stops) + ([HERMES_OPEN] if parser == "hermes" else [])
    if parser == "llama3":
        body = text.lstrip()
        if not body or body[0] == "{" or body.startswith("<|python_tag|>") or "<|python_tag|>".startswith(body):
            return ""
    cut = min((j for j in (text.find(m) for m in marks) if j >= 0), default=-1)
    safe = text[:cut] if cut >= 0 else text[: len(text) - _partial(text, marks)]
    # A byte-level BPE splits a character across tokens ("🙂" is two of SmolLM2's): until its last byte
    # comes, the decoded text ends in U+FFFD, which the next token replaces; it is held back, not sent.
    return safe.rstrip("\ufffd").rstrip()


class _Samples:
    """The ``n`` samples of a streamed call: ``deltas`` yields (choice, new content) as it becomes safe to
    send; then ``resps`` holds the responses and ``rest`` gives what a choice's final text adds."""

    def __init__(
        self, client: Source, plan: ChatPlan | CompletionPlan, prefix: str = "", parser: str | None = None
    ) -> None:
        self.client, self.plan, self.prefix, self.parser = client, plan, prefix, parser
        self.sent = [""] * plan.n
        self.resps: list[ModelResponse] = []

    async def deltas(self) -> AsyncIterator[tuple[int, str]]:
        g, n = self.plan.gconfig, self.plan.n
        tokens: list[list[int]] = [[] for _ in range(n)]
        finals: list[ModelResponse | None] = [None] * n
        async for i, chunk in self.client.stream_samples(self.plan.ids, g, n):
            tokens[i] += chunk.tokens
            if chunk.final is not None:
                finals[i] = chunk.final
                continue
            safe = safe_prefix(self.prefix + reply_text(self.client.tokenizer, tokens[i], g), g.stop, self.parser)
            if len(safe) > len(self.sent[i]) and safe.startswith(self.sent[i]):
                yield i, safe[len(self.sent[i]) :]
                self.sent[i] = safe
        self.resps = [f for f in finals if f is not None]

    def rest(self, i: int, text: str) -> str:
        return text[len(self.sent[i]) :] if text.startswith(self.sent[i]) else ""


async def stream_chat(client: Source, plan: ChatPlan, include_usage: bool) -> AsyncIterator[ChatCompletionChunk]:
    cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())

    head = functools.partial(
        ChatCompletionChunk, id=cid, object="chat.completion.chunk", created=created, model=client.model_name
    )

    def chunk(
        i: int, delta: ChoiceDelta, finish: FinishReason | None = None, logprobs: ChoiceLogprobs | None = None
    ) -> ChatCompletionChunk:
        return head(choices=[Choice(index=i, delta=delta, finish_reason=finish, logprobs=logprobs)])

    for i in range(plan.n):
        yield chunk(i, ChoiceDelta(role="assistant", content=""))
    parser = client.tool_parser if plan.tools and plan.tool_choice != "none" else None
    samples = _Samples(client, plan, plan.prefill, parser)
    async for i, text in samples.deltas():
        yield chunk(i, ChoiceDelta(content=text))
    done = await client.chat_result(plan, samples.resps, cid)
    for c in done.choices:
        rest = samples.rest(c.index, c.message.content or "")
        calls = [  # each call whole in one delta: id, type and function as in the completion
            ChoiceDeltaToolCall.model_validate({"index": j, **t.model_dump()})
            for j, t in enumerate(c.message.tool_calls or [])
        ]
        if rest or calls:
            yield chunk(c.index, ChoiceDelta(content=rest or None, tool_calls=calls or None))
        logprobs = ChoiceLogprobs(content=c.logprobs.content) if c.logprobs is not None else None
        yield chunk(c.index, ChoiceDelta(), c.finish_reason, logprobs)
    if include_usage:
        yield head(choices=[], usage=done.usage)


async def stream_completion(client: Source, plan: CompletionPlan, include_usage: bool) -> AsyncIterator[Completion]:
    cid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())

    def chunk(choices: list[CompletionChoice], usage: CompletionUsage | None = None) -> Completion:
        return Completion.model_construct(  # finish_reason None mid-stream, as the SDK's streamed chunks have
            id=cid, object="text_completion", created=created, model=client.model_name, choices=choices, usage=usage
        )

    samples = _Samples(client, plan)
    async for i, text in samples.deltas():
        piece = CompletionChoice.model_construct(index=i, text=text, finish_reason=None, logprobs=None)  # type: ignore[arg-type]
        yield chunk([piece])
    done = await client.completion_result(plan, samples.resps, cid)
    for c in done.choices:
        rest = samples.rest(c.index, c.text)
        yield chunk([CompletionChoice(index=c.index, text=rest, finish_reason=c.finish_reason, logprobs=c.logprobs)])
    if include_usage:
        yield chunk([], done.usage)


async def sse_events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[bytes]:
    """Chunks as server-sent events, as they come, then ``[DONE]``; an error mid-stream is sent as
    OpenAI's error event (the SDK raises it)."""
    try:
        async for chunk in chunks:
            yield b"data: " + json.dumps(chunk.model_dump(exclude_none=True)).encode() + b"\n\n"
    except RequestError as e:
        yield b"data: " + json.dumps({"error": e.body}).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
