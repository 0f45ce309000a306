"""An agent written against the OpenAI API as a rollout workflow.

The agent is ``async def agent(client, data) -> float | None``: it talks to ``client`` exactly
as it would to ``openai.AsyncOpenAI`` and returns the episode's reward (given to its last
completion), or None when it has set rewards itself (``client.set_reward``). Every model call
is recorded by the ``OpenAIClient`` and the episode becomes its exported trajectories.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from transformers import PreTrainedTokenizerBase

from relayrl.agents.client import OpenAIClient
from relayrl.api.engine import DataItem, InferenceEngine
from relayrl.api.io import GenerationConfig
from relayrl.api.workflow import RolloutWorkflow, Trajectory

AgentFn = Callable[[OpenAIClient, DataItem], Awaitable[float | None]]


class OpenAIAgentWorkflow(RolloutWorkflow):
    """One episode = one run of ``agent``; rows as ``OpenAIClient.export_trajectories(discount)``.

    ``timeout`` (seconds, 0 = none) fails an episode whose agent never finishes; an episode
    without a generated token is rejected (None).
    """

    def __init__(
        self,
        agent: AgentFn,
        tokenizer: PreTrainedTokenizerBase,
        gconfig: GenerationConfig,
        discount: float = 1.0,
        tool_parser: str = "auto",
        timeout: float = 0.0,
    ) -> None:
        if not 0.0 <= discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {discount}")
        self.agent, self.tokenizer, self.gconfig = agent, tokenizer, gconfig
        self.discount, self.tool_parser, self.timeout = discount, tool_parser, timeout

    async def arun_episode(self, engine: InferenceEngine, data: DataItem) -> Trajectory | None:
        client = OpenAIClient(engine, self.tokenizer, self.gconfig, tool_parser=self.tool_parser)
        run = self.agent(client, data)
        reward = await (asyncio.wait_for(run, self.timeout) if self.timeout > 0 else run)
        if reward is not None:
            client.set_final_reward(float(reward))
        return client.export_trajectories(self.discount)
