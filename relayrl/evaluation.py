"""Held-out evaluation: generate for every eval prompt and score with the task's reward.

Requests go straight to the inference engine (bypassing the rollout executor's queue), so
evaluation is not stuck behind training rollouts; in asynchronous mode the trainer pauses
the executor's new submissions while evaluating.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from relayrl.api.engine import DataItem, InferenceEngine
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.data.chat import prompt_ids as format_prompt

RewardFn = Callable[..., float]


async def _score_row(
    engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase, row: DataItem, gconfig: GenerationConfig,
    reward_fn: RewardFn, n_samples: int, prompt_format: str = "chat",
) -> list[float]:
    prompt_ids = format_prompt(tokenizer, row["messages"], prompt_format)  # type: ignore[arg-type]
    reqs = [ModelRequest(rid=uuid.uuid4().hex, input_ids=prompt_ids, gconfig=gconfig) for _ in range(n_samples)]
    resps = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
    prompt = tokenizer.decode(prompt_ids)
    extra = {k: v for k, v in row.items() if k not in ("prompt", "completions", "prompt_ids", "completion_ids")}
    return [
        float(reward_fn(
            prompt=prompt, completions=tokenizer.decode(r.output_tokens, skip_special_tokens=True),
            prompt_ids=r.input_tokens, completion_ids=r.output_tokens, **extra,
        ))
        for r in resps
    ]


def evaluate(
    engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase, rows: list[DataItem], gconfig: GenerationConfig,
    reward_fn: RewardFn, n_samples: int = 1, prompt_format: str = "chat",
) -> dict[str, float]:
    """``eval/accuracy`` (first sample correct), ``eval/reward`` and, for n > 1, ``eval/pass@n``.

    A sample counts as correct when its reward is at least 1.
    """
    if not rows:
        raise ValueError("evaluate: no eval rows")

    async def run() -> list[list[float]]:
        return await asyncio.gather(*(_score_row(engine, tokenizer, r, gconfig, reward_fn, n_samples, prompt_format) for r in rows))

    scores = asyncio.run(run())
    out = {
        "eval/accuracy": sum(s[0] >= 1.0 for s in scores) / len(scores),
        "eval/reward": sum(sum(s) / len(s) for s in scores) / len(scores),
        "eval/n_prompts": float(len(scores)),
    }
    if n_samples > 1:
        out[f"eval/pass@{n_samples}"] = sum(max(s) >= 1.0 for s in scores) / len(scores)
        out["eval/accuracy_mean"] = sum(sum(x >= 1.0 for x in s) / len(s) for s in scores) / len(scores)
    return out
