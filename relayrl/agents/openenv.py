"""Tool calls for OpenEnv MCP environments: ``action_fn`` helpers for ``workflow=openenv`` with ``tools: true``.

The policy writes a tool call in its chat template's format; these turn the first one into OpenEnv's
``call_tool`` action (``{"type": "call_tool", "tool_name", "arguments"}``), which the server routes to the
environment's MCP tools. A reply without a parseable call is not an action: ``OpenEnvError`` names it
(``invalid_action: end`` ends the episode there instead of failing it).

    workflow_kwargs: {tools: true, action_fn: "relayrl.agents.openenv:hermes_call_tool"}
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from relayrl.agents.tool_parsers import parse_tool_calls


def call_tool_action(text: str, parser: str) -> dict[str, object]:
    """The first tool call in ``text`` (format ``parser``: ``hermes`` or ``llama3``) as a ``call_tool`` action."""
    parsed = parse_tool_calls(text, parser)
    if not parsed.tool_calls:
        raise ValueError(f"no {parser} tool call in the reply ({parsed.malformed} malformed)")
    call = parsed.tool_calls[0]
    return {"type": "call_tool", "tool_name": call.name, "arguments": json.loads(call.arguments)}


def hermes_call_tool(text: str, observation: Mapping[str, object]) -> dict[str, object]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, Qwen3) -> ``call_tool``."""
    return call_tool_action(text, "hermes")


def llama3_call_tool(text: str, observation: Mapping[str, object]) -> dict[str, object]:
    """``{"name": ..., "parameters": {...}}`` (Llama-3.1 / 3.2) -> ``call_tool``."""
    return call_tool_action(text, "llama3")
