"""ReMax: a sampled completion and a greedy one, generated concurrently.

The sampled completion is trained on; the greedy one is the baseline. Rather than storing
``sampled - greedy`` as the reward (as the seed example does), the row keeps the sampled
reward in ``rewards`` and the greedy reward in the sequence-level key ``baseline_rewards``;
the ``remax`` advantage estimator computes ``rewards - baseline_rewards``. Logged rewards
then stay comparable with other workflows, and reward shaping (scale, clip) applies to both.
"""

from __future__ import annotations

import asyncio
import uuid

import torch
from transformers import PreTrainedTokenizerBase

from relayrl.api.engine import DataItem, InferenceEngine
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.api.workflow import RolloutWorkflow, Trajectory, trajectory_from_response
from relayrl.rollout.workflows.rlvr import AsyncRewardPool, RewardFn, compute_reward, prompt_ids_of


class ReMaxWorkflow(RolloutWorkflow):
    """One sampled row with ``rewards`` (sampled) and ``baseline_rewards`` (greedy)."""

    def __init__(
        self,
        reward_fn: RewardFn,
        gconfig: GenerationConfig,
        tokenizer: PreTrainedTokenizerBase,
        reward_pool: AsyncRewardPool | None = None,
        reward_timeout: float | None = None,
        prompt_format: str = "chat",
    ) -> None:
        self.prompt_format = prompt_format
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.reward_pool = reward_pool
        self.reward_timeout = reward_timeout

    async def arun_episode(self, engine: InferenceEngine, data: DataItem) -> Trajectory | None:
        ids = prompt_ids_of(self.tokenizer, data, self.prompt_format)
        rid = uuid.uuid4().hex
        resp, greedy = await asyncio.gather(
            engine.agenerate(ModelRequest(rid=rid, input_ids=ids, gconfig=self.gconfig)),
            engine.agenerate(ModelRequest(rid=rid, input_ids=ids, gconfig=self.gconfig.new(greedy=True))),
        )
        if resp.output_len == 0:
            return None
        reward, baseline = await asyncio.gather(
            *(
                compute_reward(self.reward_fn, engine, self.tokenizer, r, data, self.reward_pool, self.reward_timeout)
                for r in (resp, greedy)
            )
        )
        return trajectory_from_response(
            resp,
            reward,
            baseline_rewards=torch.tensor([baseline], dtype=torch.float32),
            truncated=torch.tensor([resp.stop_reason == "length"], dtype=torch.bool),
        )
