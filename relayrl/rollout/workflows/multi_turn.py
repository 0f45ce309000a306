"""Multi-turn RLVR: when the answer is wrong, append feedback and let the model retry.

Token ids are kept end to end: each turn's prompt is the previous turn's prompt + output +
feedback tokens, never re-tokenised text. The feedback tokens are only the new user turn as the
chat template continues the conversation (``relayrl.data.chat.user_turn_ids``): a real template's
system prompt or BOS is never repeated mid-episode. Feedback tokens (and an EOS closing a turn that
was cut by the length limit) have ``loss_mask`` 0, ``logprobs`` 0, ``versions`` -1. The
reward of the turn that ends the episode is discounted by ``turn_discount ** turn``
(turn 0 = first answer), so a first-try success is worth most.
"""

from __future__ import annotations

import typing
import uuid

import torch
from transformers import PreTrainedTokenizerBase

from relayrl.api.engine import DataItem, InferenceEngine
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.api.workflow import Trajectory, routed_experts_row
from relayrl.rollout.workflows.rlvr import AsyncRewardPool, PromptWorkflow, RewardFn

_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float32}


def stop_ids(tokenizer: PreTrainedTokenizerBase, gconfig: GenerationConfig) -> set[int]:
    """The tokens a generation with ``gconfig`` stops at: its ``stop_token_ids`` and the tokenizer's EOS."""
    eos = tokenizer.eos_token_id
    return set(gconfig.stop_token_ids) | (set() if eos is None else {int(eos)})


def reply_text(
    tokenizer: PreTrainedTokenizerBase, tokens: list[int], gconfig: GenerationConfig, stop_reason: str = "stop"
) -> str:
    """A reply decoded as an OpenAI endpoint answers it: without the stop token it ended with, other
    special tokens kept (a tool-call marker may be one)."""
    if tokens and stop_reason == "stop" and tokens[-1] in stop_ids(tokenizer, gconfig):
        tokens = tokens[:-1]
    return str(tokenizer.decode(tokens, skip_special_tokens=False))


class TokenBuffer:
    """A sequence under construction: tokens with their loss mask, logprobs and versions."""

    def __init__(self, prompt: list[int]) -> None:
        self.ids = list(prompt)
        self.mask = [0] * len(prompt)
        self.logprobs = [0.0] * len(prompt)
        self.versions = [-1] * len(prompt)
        self.routed: torch.Tensor | None = None  # MoE: the latest response's routed experts

    def add_generated(
        self, ids: list[int], logprobs: list[float], versions: list[int], routed: torch.Tensor | None = None
    ) -> None:
        """Append a response to the whole buffer; its ``routed`` experts (MoE) cover every token
        before its last one, earlier turns included, so the latest replaces the ones before."""
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions
        if routed is not None:
            self.routed = routed

    def add_context(self, ids: list[int]) -> None:
        """Tokens the policy did not generate (feedback, tool output): never trained on."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def trajectory(self, reward: float, **extras: torch.Tensor | float) -> Trajectory:
        """The row with ``reward``; ``extras`` are sequence-level keys, a number as a one-element tensor of
        its type (bool, int64, float32)."""
        n = len(self.ids)
        seq = {
            k: torch.tensor([v], dtype=_DTYPES[type(v)]) if not isinstance(v, torch.Tensor) else v
            for k, v in extras.items()
        }
        if self.routed is not None:  # tokens after the latest response (context) were never run: -1
            seq = {"routed_experts": routed_experts_row(self.routed, n), **seq}
        return {
            "input_ids": torch.tensor([self.ids], dtype=torch.int64),
            "attention_mask": torch.ones(1, n, dtype=torch.bool),
            "loss_mask": torch.tensor([self.mask], dtype=torch.bool),
            "logprobs": torch.tensor([self.logprobs], dtype=torch.float32),
            "versions": torch.tensor([self.versions], dtype=torch.int64),
            "rewards": torch.tensor([float(reward)], dtype=torch.float32),
            **seq,
        }


class MultiTurnWorkflow(PromptWorkflow):
    """Up to ``max_turns`` attempts; an attempt is correct when its reward is > 0.

    Extra sequence-level keys: ``num_turns`` (int64) and ``raw_rewards`` (undiscounted).
    """

    def __init__(
        self,
        reward_fn: RewardFn,
        gconfig: GenerationConfig,
        tokenizer: PreTrainedTokenizerBase,
        max_turns: int = 2,
        turn_discount: float = 0.9,
        feedback: str = "Your answer is wrong. Try again.",
        reward_pool: AsyncRewardPool | None = None,
        reward_timeout: float | None = None,
        prompt_format: str = "chat",
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if not 0.0 < turn_discount <= 1.0:
            raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount}")
        super().__init__(reward_fn, gconfig, tokenizer, reward_pool, reward_timeout, prompt_format)
        self.max_turns, self.turn_discount, self.feedback = max_turns, turn_discount, feedback

    def feedback_ids(self, history: list[dict[str, object]], answer_ids: list[int]) -> list[int]:
        """Tokens between a wrong answer and the next attempt: the end-of-turn token if the answer
        lacks one, then the feedback as a user turn and the assistant's generation prompt, exactly as
        the chat template continues ``history`` + the answer (plain prompts: the feedback on its own line)."""
        from relayrl.data.chat import user_turn_ids

        return user_turn_ids(self.tokenizer, history, answer_ids, self.feedback, self.prompt_format)

    async def arun_episode(self, engine: InferenceEngine, data: DataItem) -> Trajectory | None:
        prompt = self.prompt_ids(data)
        buf = TokenBuffer(prompt)
        history = list(typing.cast(list[dict[str, object]], data["messages"]))
        rid = uuid.uuid4().hex
        reward = raw = 0.0
        turn = 0
        for turn in range(self.max_turns):
            resp = await engine.agenerate(ModelRequest(rid=rid, input_ids=list(buf.ids), gconfig=self.gconfig))
            buf.add_generated(resp.output_tokens, resp.output_logprobs, resp.output_versions, resp.routed_experts)
            raw = await self.reward(engine, resp, data, prompt_ids=prompt)
            reward = raw * self.turn_discount**turn
            if raw > 0 or turn == self.max_turns - 1:
                break
            buf.add_context(self.feedback_ids(history, resp.output_tokens))
            answer = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            history += [{"role": "assistant", "content": answer}, {"role": "user", "content": self.feedback}]
        if not any(buf.mask):
            return None
        return buf.trajectory(reward, num_turns=turn + 1, raw_rewards=float(raw))
