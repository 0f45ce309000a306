"""Tool calls in model output, in the two formats open models are trained on.

- ``hermes`` (Hermes, Qwen2.5, Qwen3): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
  text outside the blocks is the message content.
- ``llama3`` (Llama-3.1 / 3.2 JSON tool calling): the whole reply is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``; several calls separated by ``;``).

A call that does not parse (bad JSON, no ``name``, arguments that are not an object) makes the
whole reply a normal completion with no tool call, and ``ParsedOutput.malformed`` says so: the
agent sees the text, the episode goes on, and the count reaches the metrics. It never raises.

Not transformers' ``parse_response`` (5.23): that needs a response template per model (few checkpoints
ship one, and the llama3 form, JSON calls split by ``;``, has none), raises on a block that is not
JSON, and keeps only the text after the last block as content, where this keeps all of it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


@dataclass
class ToolCall:
    """One call: ``arguments`` is a JSON object as text (the OpenAI wire format)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]
    malformed: int = 0  # tool-call blocks that did not parse (the reply is then plain content)


def _call(obj: object, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> ParsedOutput:
    blocks = list(_HERMES.finditer(text))
    if not blocks:
        return ParsedOutput(text, [])
    calls = []
    for m in blocks:
        try:
            call = _call(json.loads(m.group(1).strip()), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            return ParsedOutput(text, [], malformed=1)
        calls.append(call)
    content = _HERMES.sub("", text).strip()
    return ParsedOutput(content or None, calls)


def parse_llama3(text: str) -> ParsedOutput:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedOutput(text, [])
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return ParsedOutput(text, [], malformed=1)
        call = _call(obj, "parameters")
        if call is None:
            return ParsedOutput(text, [], malformed=1)
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return ParsedOutput(None, calls)


TOOL_PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3}


def parse_tool_calls(text: str, parser: str) -> ParsedOutput:
    """Split a reply into content and tool calls with the named format (see module doc)."""
    if parser not in TOOL_PARSERS:
        raise ValueError(f"tool parser must be one of {list(TOOL_PARSERS)}, got {parser!r}")
    return TOOL_PARSERS[parser](text)


def detect_parser(chat_template: str | None) -> str:
    """The format a chat template teaches: ``llama3`` when it renders ``parameters`` JSON or
    ``<|python_tag|>``, else ``hermes`` (the common one)."""
    text = chat_template or ""
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or '"parameters"' in text:
        return "llama3"
    return "hermes"
