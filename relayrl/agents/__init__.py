"""Agents written against the OpenAI API, trained by relayrl.

- ``OpenAIClient``: an ``openai.AsyncOpenAI``-shaped client over any ``InferenceEngine`` that
  records exact tokens, logprobs and versions per call and exports trajectories;
- ``OpenAIAgentWorkflow``: runs an ``async agent(client, data) -> reward`` as an episode;
- ``tool_parsers``: Hermes / Qwen2.5 and Llama-3.1 tool calls; ``templates``: chat templates in those formats.
"""

from relayrl.agents.calls import CallRecord
from relayrl.agents.client import OpenAIClient
from relayrl.agents.messages import RequestError
from relayrl.agents.tool_parsers import ParsedOutput, ToolCall, detect_parser, parse_tool_calls
from relayrl.agents.workflow import OpenAIAgentWorkflow

__all__ = [
    "CallRecord",
    "OpenAIAgentWorkflow",
    "OpenAIClient",
    "ParsedOutput",
    "RequestError",
    "ToolCall",
    "detect_parser",
    "parse_tool_calls",
]
