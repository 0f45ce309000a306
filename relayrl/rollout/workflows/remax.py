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

from relayrl.api.engine import DataItem, InferenceEngine
from relayrl.api.io import ModelRequest
from relayrl.api.workflow import Trajectory, trajectory_from_response
from relayrl.rollout.workflows.rlvr import PromptWorkflow


class ReMaxWorkflow(PromptWorkflow):
    """One sampled row with ``rewards`` (sampled) and ``baseline_rewards`` (greedy)."""

    async def arun_episode(self, engine: InferenceEngine, data: DataItem) -> Trajectory | None:
        ids = self.prompt_ids(data)
        rid = uuid.uuid4().hex
        resp, greedy = await asyncio.gather(
            engine.agenerate(ModelRequest(rid=rid, input_ids=ids, gconfig=self.gconfig)),
            engine.agenerate(ModelRequest(rid=rid, input_ids=ids, gconfig=self.gconfig.new(greedy=True))),
        )
        if resp.output_len == 0:
            return None
        reward, baseline = await asyncio.gather(*(self.reward(engine, r, data) for r in (resp, greedy)))
        return trajectory_from_response(
            resp,
            reward,
            baseline_rewards=torch.tensor([baseline], dtype=torch.float32),
            truncated=torch.tensor([resp.stop_reason == "length"], dtype=torch.bool),
        )
