"""User code that sends its own trainer process a real signal at a known point of a step.

``RELAYRL_SIGNAL`` (SIGINT, SIGTERM, or SIGKILL for a crash) is sent the ``RELAYRL_SIGNAL_AT``-th time
a hook runs (``RELAYRL_SIGNAL_IN`` = reward, loss, episode, push, save, commit or close says which
hook counts; ``import`` sends it when set-up imports this module, before training starts), to this
process, or with ``RELAYRL_SIGNAL_TO=group`` to its whole process group (a terminal's Ctrl-C):
``reward`` runs during rollout (``reward_fn=signal_hooks:reward``), ``ppo_loss`` /
``decoupled_ppo_loss`` inside the update, between two optimizer steps
(``actor.loss=signal_hooks:ppo_loss``). Both otherwise do exactly what the built-in arithmetic
verifier and losses do, so a run using them is comparable bitwise with one that does not signal.

The other hooks wrap the trainer's own code when this module is imported (by one of the above, or
by ``imports=[signal_hooks]`` for a run that keeps its own reward and loss), so a test's moment is
a point of the run, not of the test's clock. ``episode`` counts finished episodes (the executor's,
whatever the workflow: an agent's too). ``push`` counts weight loads: ``LocalEngine._load_state``
(the signal arrives while the generator's loop thread loads the pushed weights and the trainer's
main thread waits for it), or one server's confirmed load over HTTP or disk (``UploadSync`` /
``DiskSync.push``; n servers count n a push). The first push is the set-up's (the generators take
the start weights), so with one generator push N + 1 is step N's. ``save`` counts the trainer's
checkpoint writes as they begin, ``commit`` as their files are written, their state and rename
still to come (with ``checkpoint.every_n_steps=0`` the first is the final one); ``close`` its
teardown after the last step: these run after the step's metrics row.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import torch

from relayrl.rewards.tasks import task_reward_fn
from relayrl.train.algorithms import decoupled_ppo_loss as _decoupled
from relayrl.train.algorithms import ppo_loss as _ppo
from relayrl.train.registry import LOSSES, register_loss

_calls = {"reward": 0, "loss": 0, "episode": 0, "push": 0, "save": 0, "commit": 0, "close": 0}
_lock = threading.Lock()  # pushes to several servers count from several threads
_verify = task_reward_fn("arithmetic")


def _send() -> None:
    sig = signal.Signals[os.environ["RELAYRL_SIGNAL"]]
    if os.environ.get("RELAYRL_SIGNAL_TO") == "group":
        os.killpg(0, sig)
    else:
        os.kill(os.getpid(), sig)


def _tick(hook: str) -> None:
    with _lock:
        _calls[hook] += 1
        due = hook == os.environ.get("RELAYRL_SIGNAL_IN") and _calls[hook] == int(os.environ["RELAYRL_SIGNAL_AT"])
    if due:
        _send()


def reward(**kwargs: object) -> float:
    _tick("reward")
    return _verify(**kwargs)


def ppo_loss(**kwargs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    _tick("loss")
    return _ppo(**kwargs)


@register_loss("signal_hooks.decoupled_ppo", needs_prox_logp=True, reads=LOSSES["decoupled_ppo"].reads)
def decoupled_ppo_loss(**kwargs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """decoupled_ppo (registered with its needs: the trainer's logprobs before the update, its fields)."""
    _tick("loss")
    return _decoupled(**kwargs)


def _hook_the_episodes() -> None:
    from relayrl.rollout.executor import WorkflowExecutor

    run = WorkflowExecutor._run_episode

    async def run_counted(self: WorkflowExecutor, p: object) -> object:
        out = await run(self, p)  # type: ignore[arg-type]
        _tick("episode")
        return out

    WorkflowExecutor._run_episode = run_counted  # type: ignore[assignment,method-assign]


def _hook_the_weight_push() -> None:
    from relayrl.inference.local.engine import LocalEngine
    from relayrl.inference.remote.weights import DiskSync, UploadSync

    load = LocalEngine._load_state

    def load_counted(self: LocalEngine, state: dict[str, torch.Tensor]) -> None:
        _tick("push")
        load(self, state)

    LocalEngine._load_state = load_counted  # type: ignore[method-assign]
    for sync in (DiskSync, UploadSync):  # one server's load, over disk or HTTP
        push = sync.push

        def push_counted(self: object, *args: object, push: Callable[..., None] = push) -> None:
            push(self, *args)
            _tick("push")  # this server has the weights; the others may still be loading them

        sync.push = push_counted  # type: ignore[method-assign]


def _hook_the_end() -> None:
    from relayrl.driver import Driver
    from relayrl.trainer import Trainer
    from relayrl.utils.checkpoint import CheckpointManager

    save, commit, close = Trainer.save, CheckpointManager.commit, Driver.close

    def save_counted(self: Trainer, *args: object, **kwargs: object) -> object:
        _tick("save")
        return save(self, *args, **kwargs)  # type: ignore[arg-type]

    def commit_counted(self: CheckpointManager, *args: object) -> object:
        _tick("commit")
        return commit(self, *args)  # type: ignore[arg-type]

    def close_counted(self: Driver) -> None:
        _tick("close")
        close(self)

    Trainer.save = save_counted  # type: ignore[method-assign]
    CheckpointManager.commit = commit_counted  # type: ignore[method-assign]
    Driver.close = close_counted  # type: ignore[method-assign]


if os.environ.get("RELAYRL_SIGNAL_IN") == "import":
    _send()
if os.environ.get("RELAYRL_SIGNAL_IN") == "episode":
    _hook_the_episodes()
if os.environ.get("RELAYRL_SIGNAL_IN") == "push":
    _hook_the_weight_push()
if os.environ.get("RELAYRL_SIGNAL_IN") in ("save", "commit", "close"):
    _hook_the_end()
