"""One call of an OpenAI-shaped request: what it asks for (its parameters checked into a
``GenerationConfig``, its tool choice; ``ChatPlan`` / ``CompletionPlan`` once tokenised) and what
it produced (``CallRecord``, one per choice: everything training needs)."""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass

from relayrl.agents.messages import Message, RequestError
from relayrl.api.io import GenerationConfig, ModelResponse

# Accepted and ignored: they change nothing about what a local policy generates.
IGNORED = {
    "model",
    "user",
    "metadata",
    "seed",
    "store",
    "parallel_tool_calls",
    "service_tier",
    "extra_headers",
    "extra_query",
    "extra_body",
    "timeout",
    "reasoning_effort",
    "prompt_cache_key",
    "safety_identifier",
}


@dataclass
class CallRecord:
    """One completion (one choice of one call) with everything training needs."""

    id: str
    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str
    messages: list[Message] | None = None  # chat calls: the request's turns, normalized
    tools: list[Message] | None = None
    reply: Message | None = None  # the reply as the agent will send it back
    prompt_text: str | None = None  # completion calls
    text: str = ""
    parent: CallRecord | None = None  # the call whose prompt + output this prompt extends
    tool_calls: int = 0
    malformed_tool_calls: int = 0
    reward: float | None = None

    @classmethod
    def of(cls, cid: str, index: int, prompt_ids: list[int], resp: ModelResponse, **kw: typing.Any) -> CallRecord:
        """The record of choice ``index`` of call ``cid``: its prompt and what ``resp`` generated."""
        generated = list(resp.output_tokens), list(resp.output_logprobs), list(resp.output_versions)
        return cls(cid, index, list(prompt_ids), *generated, resp.stop_reason, **kw)


@dataclass
class ChatPlan:
    """A chat call once validated and tokenised: what to generate and how to answer."""

    messages: list[Message]
    tools: list[Message] | None
    tool_choice: str  # auto | none | required | a function's name
    gconfig: GenerationConfig
    n: int
    logprobs: bool
    top: int
    parent: CallRecord | None
    ids: list[int]
    prefill: str  # the tool-call opening written into the prompt (tool_choice required / named)


@dataclass
class CompletionPlan:
    prompt_text: str | None
    ids: list[int]
    gconfig: GenerationConfig
    n: int
    logprobs: bool
    top: int
    parent: CallRecord | None


def request_settings(base: GenerationConfig, params: dict[str, object]) -> tuple[GenerationConfig, int, bool, int]:
    """The generation config of a request (``base`` where it says nothing), its ``n``, whether logprobs
    were asked for, and how many alternatives (``top_logprobs``); ``RequestError`` names a bad field."""
    p = dict(params)
    for key in IGNORED:
        p.pop(key, None)
    changes: dict[str, object] = {}
    n = p.pop("n", 1) or 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
        raise RequestError(f"n must be an integer in [1, 64], got {n!r}", "n")
    temperature = p.pop("temperature", None)
    if temperature is not None:
        if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise RequestError(f"temperature must be in [0, 2], got {temperature!r}", "temperature")
        changes.update({"greedy": True} if temperature == 0 else {"temperature": float(temperature), "greedy": False})
    top_p = p.pop("top_p", None)
    if top_p is not None:
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {top_p!r}", "top_p")
        changes["top_p"] = float(top_p)
    for key in ("max_tokens", "max_completion_tokens"):
        value = p.pop(key, None)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RequestError(f"{key} must be a positive integer, got {value!r}", key)
            changes["max_new_tokens"] = value
            changes["min_new_tokens"] = min(base.min_new_tokens, value)
    stop = p.pop("stop", None)
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
            raise RequestError("stop must be a string or a list of up to 4 non-empty strings", "stop")
        changes["stop"] = [*base.stop, *stops]
    logprobs = p.pop("logprobs", None)
    top = p.pop("top_logprobs", None) or 0
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20:
        raise RequestError(f"top_logprobs must be an integer in [0, 20], got {top!r}", "top_logprobs")
    if top and not logprobs:
        raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    for key in ("frequency_penalty", "presence_penalty"):
        value = p.pop(key, None)
        if value is not None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -2 <= value <= 2:
                raise RequestError(f"{key} must be a number in [-2, 2], got {value!r}", key)
            changes[key] = float(value)
    fmt = p.pop("response_format", None)
    kind = (dict(fmt) if isinstance(fmt, dict) else {}).get("type") if fmt is not None else "text"
    if kind not in ("text", "json_object"):
        raise RequestError(
            f"response_format {kind!r} is not supported: 'text' and 'json_object' (not enforced: relayrl does "
            "not constrain decoding) are",
            "response_format",
        )
    p.pop("tools", None), p.pop("tool_choice", None)  # read by the chat call itself
    for key in ("echo", "suffix", "logit_bias"):
        if p.pop(key, None):
            raise RequestError(f"{key} is not supported", key, code="unsupported_parameter")
    if p.pop("best_of", None) not in (None, 1):
        raise RequestError("best_of is not supported", "best_of", code="unsupported_parameter")
    if p:
        name = sorted(p)[0]
        raise RequestError(f"unsupported parameter {name!r}", name, code="unsupported_parameter")
    gconfig = base.new(**changes)
    try:
        gconfig.validate()
    except ValueError as e:
        raise RequestError(str(e), "max_tokens") from None
    return gconfig, n, bool(logprobs), top


def check_tool_choice(choice: object, tools: list[Message] | None) -> str:
    """``auto``, ``none``, ``required`` or the name of the one function to call."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise RequestError(
                f"tool_choice must be 'auto', 'none', 'required' or a named function, got {choice!r}",
                "tool_choice",
            )
        name = choice
    else:
        fn = (dict(choice) if isinstance(choice, dict) else {}).get("function")
        named = (dict(fn) if isinstance(fn, dict) else {}).get("name")
        if not isinstance(named, str):
            raise RequestError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}", "tool_choice")
        name = named
        known = [typing.cast(dict[str, str], t["function"])["name"] for t in tools or []]
        if name not in known:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools {known}", "tool_choice")
    if name not in ("auto", "none") and not tools:
        raise RequestError(f"tool_choice={name!r} needs tools", "tool_choice")
    return name


def tool_prefill(parser: str, tool_choice: str) -> str:
    """``required``: the reply starts with the parser's tool-call opening; a named function: the
    opening up to the function's name, as the Hermes / Llama-3.1 templates write a call. Written
    into the prompt (vLLM and SGLang constrain decoding to a call instead)."""
    if tool_choice in ("auto", "none"):
        return ""
    if parser == "llama3":
        return "{" if tool_choice == "required" else f'{{"name": {json.dumps(tool_choice)}'
    return "<tool_call>" if tool_choice == "required" else f'<tool_call>\n{{"name": {json.dumps(tool_choice)}'
