"""An agent written against the OpenAI API, trained through ``OpenAIAgentWorkflow``: the workflow
``test_trainer_kill.py`` names on the command line (``workflow=tests.reliability.agent_workflow:make``)."""

from __future__ import annotations

import openai
from transformers import PreTrainedTokenizerBase

from relayrl.agents import OpenAIAgentWorkflow
from relayrl.api.io import GenerationConfig


def make(tokenizer: PreTrainedTokenizerBase, gconfig: GenerationConfig) -> OpenAIAgentWorkflow:
    async def agent(client: openai.AsyncOpenAI, row: dict) -> float:  # one chat call; the reward: the exact answer
        reply = await client.chat.completions.create(model="policy", messages=row["messages"])
        return float((reply.choices[0].message.content or "").strip() == row["answer"])

    return OpenAIAgentWorkflow(agent, tokenizer, gconfig)
