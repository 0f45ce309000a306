"""User code that sends its own trainer process a real signal at a known point of a step.

``RELAYRL_SIGNAL`` (SIGINT or SIGTERM) is sent the ``RELAYRL_SIGNAL_AT``-th time a hook runs
(``RELAYRL_SIGNAL_IN`` = reward, loss, push, save or close says which hook counts; ``import`` sends it
when set-up imports this module, before training starts):
``reward`` runs during rollout (``reward_fn=signal_hooks:reward``), ``ppo_loss`` inside the
update, between two optimizer steps (``actor.loss=signal_hooks:ppo_loss``). Both otherwise do
exactly what the built-in arithmetic verifier and ``ppo`` loss do, so a run using them is
comparable bitwise with one that does not signal.

The weight push has no user-code hook, so ``push`` wraps ``LocalEngine._load_state`` when this
module is imported (by ``reward_fn=signal_hooks:reward``): the signal arrives while the generator's
loop thread loads the pushed weights and the trainer's main thread waits for it. The first push is
the set-up's (the generators take the start weights), so push N + 1 is step N's. ``save`` counts the
trainer's checkpoint writes (with ``checkpoint.every_n_steps=0`` the first is the final one) and ``close``
its teardown after the last step: both run after the last step's metrics row.
"""

from __future__ import annotations

import os
import signal

import torch

from relayrl.rewards.tasks import task_reward_fn
from relayrl.train.algorithms import ppo_loss as _ppo

_calls = {"reward": 0, "loss": 0, "push": 0, "save": 0, "close": 0}
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


def _hook_the_end() -> None:
    from relayrl.driver import Driver
    from relayrl.trainer import Trainer

    save, close = Trainer.save, Driver.close

    def save_counted(self: Trainer, *args: object, **kwargs: object) -> object:
        _tick("save")
        return save(self, *args, **kwargs)  # type: ignore[arg-type]

    def close_counted(self: Driver) -> None:
        _tick("close")
        close(self)

    Trainer.save = save_counted  # type: ignore[method-assign]
    Driver.close = close_counted  # type: ignore[method-assign]


if os.environ.get("RELAYRL_SIGNAL_IN") == "import":
    os.kill(os.getpid(), signal.Signals[os.environ["RELAYRL_SIGNAL"]])
if os.environ.get("RELAYRL_SIGNAL_IN") == "push":
    _hook_the_weight_push()
if os.environ.get("RELAYRL_SIGNAL_IN") in ("save", "close"):
    _hook_the_end()
