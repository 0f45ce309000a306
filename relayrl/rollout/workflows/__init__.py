"""Rollout workflows: how one episode is generated and rewarded.

``workflow`` in a run config names one of ``WORKFLOWS`` (``@register_workflow`` adds yours) or
is ``package.module:attr``: a ``RolloutWorkflow`` subclass or a function returning a workflow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from relayrl.api.workflow import RolloutWorkflow
from relayrl.rollout.workflows.multi_turn import MultiTurnWorkflow
from relayrl.rollout.workflows.openenv import OpenEnvWorkflow
from relayrl.rollout.workflows.remax import ReMaxWorkflow
from relayrl.rollout.workflows.rlvr import RLVRWorkflow, compute_reward
from relayrl.rollout.workflows.tool_agent import ToolAgentWorkflow
from relayrl.utils.resolve import registrar, resolve

WorkflowFactory = Callable[..., RolloutWorkflow]
WORKFLOWS: dict[str, WorkflowFactory] = {
    "rlvr": RLVRWorkflow,
    "multi_turn": MultiTurnWorkflow,
    "remax": ReMaxWorkflow,
    "tool_agent": ToolAgentWorkflow,
    "openenv": OpenEnvWorkflow,
}
register_workflow = registrar(WORKFLOWS, "workflow")  # @register_workflow("name") on a RolloutWorkflow subclass


def _as_factory(obj: object) -> WorkflowFactory | None:
    ok = hasattr(obj, "arun_episode") if isinstance(obj, type) else callable(obj)  # a class: a workflow's
    return cast(WorkflowFactory, obj) if ok else None


def workflow_factory(value: str, field: str = "workflow") -> WorkflowFactory:
    """``workflow``: a registered name or ``package.module:attr``; ConfigError naming the field otherwise."""
    return resolve(field, value, WORKFLOWS, "a RolloutWorkflow subclass or a function returning one", _as_factory)


__all__ = [
    "WORKFLOWS",
    "MultiTurnWorkflow",
    "OpenEnvWorkflow",
    "RLVRWorkflow",
    "ReMaxWorkflow",
    "ToolAgentWorkflow",
    "compute_reward",
    "register_workflow",
    "workflow_factory",
]
