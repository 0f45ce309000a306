"""A built-in tool agent through the model's own chat template (``workflow=tool_agent``, ``rollout.tool_format=template``).

The episode is an ordinary OpenAI-style agent loop over ``OpenAIClient``: the row's messages
with a ``calc`` tool schema (rendered by the template), tool calls parsed in the template's
format (Hermes / Qwen2.5 or Llama-3.1), the sandboxed tool run on ``expr``, results sent back as
``tool`` messages, until the model answers in text or ``max_tool_calls`` were made. The reward
fn scores the final answer. Unlike ``rollout.tool_format=markers`` it needs no private marker
tokens: any model whose template renders tools works.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Awaitable, Callable

from openai.types.chat import ChatCompletion, ChatCompletionMessageFunctionToolCall
from transformers import PreTrainedTokenizerBase

from relayrl.agents.client import OpenAIClient
from relayrl.agents.workflow import OpenAIAgentWorkflow
from relayrl.api.engine import DataItem
from relayrl.api.io import GenerationConfig
from relayrl.api.workflow import RewardFn
from relayrl.data.chat import encode
from relayrl.rollout.workflows.rlvr import AsyncRewardPool, call_reward, reward_kwargs

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
    },
}
Tool = Callable[[str], Awaitable[str]]


def tool_agent_workflow(
    reward_fn: RewardFn,
    gconfig: GenerationConfig,
    tokenizer: PreTrainedTokenizerBase,
    tool: Tool,
    max_tool_calls: int = 3,
    timeout: float = 0.0,
    reward_pool: AsyncRewardPool | None = None,
    reward_timeout: float | None = None,
) -> OpenAIAgentWorkflow:
    """``workflow=tool_agent`` with ``rollout.tool_format=template`` (see module doc). The reward fn runs
    as in every built-in workflow (``call_reward``): awaited when async, else in ``reward_pool``
    (``rollout.reward_workers``) or a thread with ``reward_timeout`` (``rollout.reward_timeout``), never
    on the event loop the episodes share."""

    async def agent(client: OpenAIClient, data: DataItem) -> float:
        messages: list[object] = list(typing.cast(list[object], data["messages"]))
        answer = ""
        for _ in range(max_tool_calls + 1):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC_TOOL])
            assert isinstance(reply, ChatCompletion)  # (not streamed)
            message = reply.choices[0].message
            answer = message.content or ""
            if not message.tool_calls:
                break
            messages.append(message)
            for call in message.tool_calls:  # the client's calls: functions, arguments a JSON object
                args = json.loads(typing.cast(ChatCompletionMessageFunctionToolCall, call).function.arguments)
                result = await tool(str(args.get("expr", "")))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        ids = client.records[-1].prompt_ids
        kwargs = reward_kwargs(
            data, prompt="", completions=answer, prompt_ids=ids, completion_ids=encode(tokenizer, answer)
        )
        return await call_reward(reward_fn, None, kwargs, reward_pool, reward_timeout)

    return OpenAIAgentWorkflow(agent, tokenizer, gconfig, timeout=timeout)
