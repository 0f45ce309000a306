"""Rollout workflows: how one episode is generated and rewarded."""

from relayrl.rollout.workflows.multi_turn import MultiTurnWorkflow
from relayrl.rollout.workflows.remax import ReMaxWorkflow
from relayrl.rollout.workflows.rlvr import RLVRWorkflow, compute_reward
from relayrl.rollout.workflows.tool_agent import ToolAgentWorkflow

__all__ = ["MultiTurnWorkflow", "RLVRWorkflow", "ReMaxWorkflow", "ToolAgentWorkflow", "compute_reward"]
