"""OpenAI chat requests turned into what chat templates read, with errors that name the field.

OpenAI messages may carry content parts, the ``developer`` role, tool calls with JSON-string
arguments and SDK objects (``ChatCompletionMessage``); templates want plain strings, ``system``
and argument *objects*. ``normalize_messages`` converts; a bad field raises ``RequestError``
whose ``param`` is the OpenAI path of the field (``messages[2].tool_calls[0].function.arguments``).
"""

from __future__ import annotations

import json
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import httpx2
import openai

Message = dict[str, object]
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")


class RequestError(openai.BadRequestError, ValueError):
    """A request the client cannot serve: ``param`` names the field, ``code`` the kind.

    It *is* the SDK's ``openai.BadRequestError`` (status 400, ``body`` = OpenAI's
    ``{"message", "type", "param", "code"}``), so agent code handles it in-process exactly as it
    would from a server; the proxy sends ``{"error": body}``.
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        request = httpx2.Request("POST", "http://relayrl.invalid/v1")  # in-process: there was no HTTP exchange
        body = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
        super().__init__(message, response=httpx2.Response(400, request=request), body=body)
        self.message, self.param, self.code = message, param, code


def _plain(obj: object) -> object:
    """A dict from an SDK object (pydantic model) or a mapping; anything else as is."""
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        return dump(exclude_none=True)
    return dict(obj) if isinstance(obj, Mapping) else obj


def content_text(content: object, where: str) -> str:
    """Text of a message's content: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            part = _plain(part)
            if (
                not isinstance(part, dict)
                or part.get("type") not in ("text", "input_text")
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(
                    f"content part of type {kind!r} is not supported (text parts only)", f"{where}.content[{j}]"
                )
            out.append(part["text"])
        return "".join(out)
    raise RequestError(
        f"content must be a string or a list of text parts, got {type(content).__name__}", f"{where}.content"
    )


def _tool_calls(calls: object, where: str) -> list[Message]:
    if not isinstance(calls, list):
        raise RequestError("tool_calls must be a list", f"{where}.tool_calls")
    out: list[Message] = []
    for j, call in enumerate(calls):
        call = _plain(call)
        fn = _plain(call.get("function")) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError("a tool call needs function.name", f"{where}.tool_calls[{j}].function")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError as e:
                raise RequestError(
                    f"arguments are not valid JSON ({e.msg})", f"{where}.tool_calls[{j}].function.arguments"
                ) from None
        if not isinstance(args, dict):
            raise RequestError("arguments must be a JSON object", f"{where}.tool_calls[{j}].function.arguments")
        out.append(
            {"id": str(call.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


def normalize_messages(messages: Iterable[object]) -> list[Message]:
    """Template-ready messages (see module doc); ``RequestError`` names the first bad field."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
        raise RequestError("messages must be a list of message objects", "messages")
    out: list[Message] = []
    for i, raw in enumerate(messages):
        where = f"messages[{i}]"
        m = _plain(raw)
        if not isinstance(m, dict):
            raise RequestError(f"a message must be an object, got {type(m).__name__}", where)
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"role {role!r} is not one of {list(ROLES)}", f"{where}.role")
        msg: Message = {
            "role": "system" if role == "developer" else role,
            "content": content_text(m.get("content"), where),
        }
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            if "tool_call_id" in m:
                msg["tool_call_id"] = str(m["tool_call_id"])
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    if not out:
        raise RequestError("messages must not be empty", "messages")
    return out


def normalize_tools(tools: object) -> list[Message] | None:
    """OpenAI function tools as given (templates render ``{"type": "function", "function": {...}}``)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", "tools")
    out: list[Message] = []
    for i, tool in enumerate(tools):
        tool = _plain(tool)
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise RequestError(
                "a tool must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}", f"tools[{i}]"
            )
        out.append({"type": "function", "function": fn})
    return out or None


def _calls(message: Message) -> list[tuple[object, object]]:
    calls = typing.cast(list[dict[str, Any]], message.get("tool_calls", []))
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def same_message(a: Message, b: Message) -> bool:
    """Whether two normalized messages are the same turn (content compared without outer whitespace)."""
    if a.get("role") != b.get("role") or str(a.get("content") or "").strip() != str(b.get("content") or "").strip():
        return False
    return _calls(a) == _calls(b) and a.get("tool_call_id") == b.get("tool_call_id")
