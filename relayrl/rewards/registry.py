"""Reward functions by name: the ``reward_fn`` extension point.

``reward_fn: ""`` (the default) is the task's own verifier (math-verify for ``data.task: file``,
reasoning-gym's ``score_answer`` for ``data.task: reasoning_gym:NAME``);
otherwise a name registered here (``@register_reward``) or ``package.module:function``, called
with ``reward_kwargs`` bound. A reward function running in reward workers (``rollout.reward_workers``)
must be picklable: a module-level function is, and so is the partial binding ``reward_kwargs``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import cast

from relayrl.api.fields import ConfigError
from relayrl.api.workflow import RewardFn
from relayrl.rewards.math import gsm8k_reward_fn
from relayrl.rewards.reasoning_gym_scores import reasoning_gym_reward_fn
from relayrl.rewards.tasks import TASK_REWARDS
from relayrl.utils.resolve import registrar, resolve

REWARDS: dict[str, RewardFn] = {**TASK_REWARDS, "gsm8k": gsm8k_reward_fn, "reasoning_gym": reasoning_gym_reward_fn}
register_reward = registrar(REWARDS, "reward function")  # @register_reward("name") on a RewardFn


def _as_reward(obj: object) -> RewardFn | None:
    return cast(RewardFn, obj) if callable(obj) and not isinstance(obj, type) else None


def resolve_reward_fn(value: str, task: str, kwargs: Mapping[str, object], field: str = "reward_fn") -> RewardFn:
    """The reward function ``value`` names (``""``: the verifier of ``task``), ``kwargs`` bound."""
    if not value:
        if task == "file":
            value = "gsm8k"
        elif task.startswith("reasoning_gym:"):
            value = "reasoning_gym"  # the generator's own score_answer
        elif task in TASK_REWARDS:
            value = task
        else:
            raise ConfigError(
                f"{field} is empty and data.task={task!r} has no built-in verifier: set {field} "
                "(a registered name or 'package.module:function')"
            )
    fn = resolve(
        field, value, REWARDS, "a function (prompt, completions, prompt_ids, completion_ids, **row)", _as_reward
    )
    return functools.partial(fn, **kwargs) if kwargs else fn
