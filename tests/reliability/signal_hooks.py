"""User code that sends its own trainer process a real signal at a known point of a step.

``RELAYRL_SIGNAL`` (SIGINT or SIGTERM) is sent the ``RELAYRL_SIGNAL_AT``-th time a hook runs
(``RELAYRL_SIGNAL_IN`` = reward, loss or push says which hook counts):
``reward`` runs during rollout (``reward_fn=signal_hooks:reward``), ``ppo_loss`` inside the
update, between two optimizer steps (``actor.loss=signal_hooks:ppo_loss``). Both otherwise do
exactly what the built-in arithmetic verifier and ``ppo`` loss do, so a run using them is
comparable bitwise with one that does not signal.

The weight push has no user-code hook, so ``push`` wraps ``LocalEngine._load_state`` when this
module is imported (by ``reward_fn=signal_hooks:reward``): the signal arrives while the generator's
loop thread loads the pushed weights and the trainer's main thread waits for it. The first push is
the set-up's (the generators take the start weights), so push N + 1 is step N's.
"""

from __future__ import annotations

import os
import signal

import torch

from relayrl.rewards.tasks import task_reward_fn
from relayrl.train.algorithms import ppo_loss as _ppo

_calls = {"reward": 0, "loss": 0, "push": 0}
_verify = task_reward_fn("arithmetic")


def _tick(hook: str) -> None:
    _calls[hook] += 1
    if hook == os.environ.get("RELAYRL_SIGNAL_IN") and _calls[hook] == int(os.environ["RELAYRL_SIGNAL_AT"]):
        os.kill(os.getpid(), signal.Signals[os.environ["RELAYRL_SIGNAL"]])


def reward(**kwargs: object) -> float:
    _tick("reward")
    return _verify(**kwargs)


def ppo_loss(**kwargs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    _tick("loss")
    return _ppo(**kwargs)


def _hook_the_weight_push() -> None:
    from relayrl.inference.local.engine import LocalEngine

    load = LocalEngine._load_state

    def load_counted(self: LocalEngine, state: dict[str, torch.Tensor]) -> None:
        _tick("push")
        load(self, state)

    LocalEngine._load_state = load_counted  # type: ignore[method-assign]


if os.environ.get("RELAYRL_SIGNAL_IN") == "push":
    _hook_the_weight_push()
