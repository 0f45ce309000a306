"""Turning prompts into trajectories: the executor, the staleness rule, workflows, judges, tools."""

from relayrl.rollout.executor import WorkflowExecutor
from relayrl.rollout.judge import GenerativeJudge
from relayrl.rollout.staleness import is_expired, rollout_capacity
from relayrl.rollout.workflows import MultiTurnWorkflow, ReMaxWorkflow, RLVRWorkflow, ToolAgentWorkflow

__all__ = [
    "GenerativeJudge",
    "MultiTurnWorkflow",
    "RLVRWorkflow",
    "ReMaxWorkflow",
    "ToolAgentWorkflow",
    "WorkflowExecutor",
    "is_expired",
    "rollout_capacity",
]
