"""Tool-using agent: the model writes ``<|call|>EXPR`` + ``call_end`` and gets the result.

Generation stops at ``call_end`` (a newline by default): a stop token when the marker is one
token, else a stop string, so the markers work with any tokenizer (Qwen / Llama BPE included).
If the segment just generated holds ``call_start``, the text between the two is run by the tool (a calculator
or restricted Python evaluator in a limited subprocess, ``relayrl.rollout.tools``) and
``result_prefix + result + result_suffix`` is appended as tokens with ``loss_mask`` 0,
``logprobs`` 0 and ``versions`` -1; generation then continues from the extended sequence.
A ``call_end`` outside a call simply continues. Token ids are kept end to end (prompt,
generated segments and tool tokens are concatenated, never re-tokenised).

``gconfig.max_new_tokens`` bounds the generated tokens of the whole episode. The reward fn
sees the final segment (text after the last tool result) as ``completions``.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

from transformers import PreTrainedTokenizerBase

from relayrl.api.engine import DataItem, InferenceEngine
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.api.workflow import Trajectory
from relayrl.data.chat import encode
from relayrl.rollout.tools import calculator
from relayrl.rollout.workflows.multi_turn import TokenBuffer, stop_ids
from relayrl.rollout.workflows.rlvr import AsyncRewardPool, PromptWorkflow, RewardFn

Tool = Callable[[str], Awaitable[str]]


def _one_token(tokenizer: PreTrainedTokenizerBase, text: str, what: str) -> int | None:
    """The id of a marker that is one token, else None (it is then matched as text)."""
    if not text:
        raise ValueError(f"{what} must be a non-empty string")
    ids = encode(tokenizer, text)
    return ids[0] if len(ids) == 1 else None


class ToolAgentWorkflow(PromptWorkflow):
    """Generate, run tool calls, append results (masked), continue; one row per episode.

    Extra sequence-level keys: ``num_tool_calls`` (int64) and ``truncated`` (bool).
    """

    def __init__(
        self,
        reward_fn: RewardFn,
        gconfig: GenerationConfig,
        tokenizer: PreTrainedTokenizerBase,
        tool: Tool | None = None,
        max_tool_calls: int = 3,
        call_start: str = "<|call|>",
        call_end: str = "\n",
        result_prefix: str = "<|result|>",
        result_suffix: str = "\n",
        reward_pool: AsyncRewardPool | None = None,
        reward_timeout: float | None = None,
        prompt_format: str = "chat",
    ) -> None:
        super().__init__(reward_fn, gconfig, tokenizer, reward_pool, reward_timeout, prompt_format)
        self.tool: Tool = tool if tool is not None else calculator()
        self.max_tool_calls = max_tool_calls
        self.call_start, self.call_end = call_start, call_end
        self.call_start_id = _one_token(tokenizer, call_start, "call_start")
        self.call_end_id = _one_token(tokenizer, call_end, "call_end")
        self.result_prefix, self.result_suffix = result_prefix, result_suffix

    def result_ids(self, result: str) -> list[int]:
        return encode(self.tokenizer, self.result_prefix + result + self.result_suffix)

    def _call_text(self, out: list[int]) -> tuple[bool, str | None]:
        """(whether the segment stopped at ``call_end``, the text of the call it ends or None if no call)."""
        if self.call_end_id is not None and self.call_start_id is not None:
            if out[-1] != self.call_end_id:
                return False, None
            if self.call_start_id not in out:
                return True, None
            start = len(out) - 1 - out[::-1].index(self.call_start_id)
            return True, str(self.tokenizer.decode(out[start + 1 : -1], skip_special_tokens=False))
        text = str(self.tokenizer.decode(out, skip_special_tokens=False))
        end = text.rfind(self.call_end)
        tail = len(str(self.tokenizer.decode(out[-1:], skip_special_tokens=False)))
        if end < 0 or end + len(self.call_end) < len(text) - tail:  # stopped by something else
            return False, None
        start = text.rfind(self.call_start, 0, end)
        return True, (text[start + len(self.call_start) : end] if start >= 0 else None)

    async def arun_episode(self, engine: InferenceEngine, data: DataItem) -> Trajectory | None:
        prompt = self.prompt_ids(data)
        buf = TokenBuffer(prompt)
        rid = uuid.uuid4().hex
        user_stops = stop_ids(self.tokenizer, self.gconfig)
        generated = calls = 0
        last: list[int] = []
        truncated = False
        while True:
            budget = self.gconfig.max_new_tokens - generated
            if budget <= 0:
                truncated = True
                break
            stops, stop_texts = list(self.gconfig.stop_token_ids), list(self.gconfig.stop)
            if calls < self.max_tool_calls:
                stops.append(self.call_end_id) if self.call_end_id is not None else stop_texts.append(self.call_end)
            g = self.gconfig.new(
                max_new_tokens=budget,
                min_new_tokens=min(self.gconfig.min_new_tokens, budget),
                stop_token_ids=stops,
                stop=stop_texts,
            )
            resp = await engine.agenerate(ModelRequest(rid=rid, input_ids=list(buf.ids), gconfig=g))
            out = resp.output_tokens
            buf.add_generated(out, resp.output_logprobs, resp.output_versions, resp.routed_experts)
            generated += len(out)
            last += out  # generated since the last tool result
            at_end, expr = (
                self._call_text(out)
                if resp.stop_reason == "stop" and out and out[-1] not in user_stops
                else (False, None)
            )
            if not at_end:
                truncated = resp.stop_reason == "length"
                break
            if expr is not None:
                buf.add_context(self.result_ids(await self.tool(expr)))
                calls += 1
                last = []
        if not any(buf.mask):
            return None
        reward = await self.reward(engine, resp, data, prompt_ids=prompt, completion_ids=last)
        return buf.trajectory(reward, num_tool_calls=calls, truncated=truncated)
