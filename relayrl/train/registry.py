"""The registries of advantage estimators and policy losses, and what each entry declares.

``relayrl.train.algorithms`` registers the built-ins with these decorators; the actor and the
trainer resolve ``actor.adv_estimator`` / ``actor.loss`` here (a registered name or
``package.module:function``) and act on the entry's declarations, never on its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import torch

from relayrl.utils.resolve import _qualname, resolve

Tensor = torch.Tensor
F = TypeVar("F", bound=Callable[..., object])
AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class Algorithm(Generic[F]):
    """A registry entry: the function and what it needs, which the actor and trainer act on.

    ``needs_critic``: a value model is built and ``values`` filled in (GAE); ``needs_groups``: the
    batch must carry ``group_id``; ``needs_ref``: a reference model is built and ``ref_logp``
    passed (also without ``kl_coef``); ``needs_prox_logp``: the trainer's logprobs before the
    update arrive as ``prox_logp`` and the generator's as ``old_logp`` (decoupled PPO);
    ``needs_teacher``: the teacher's next-token distributions arrive as ``teacher_logp`` (and
    ``teacher_ids`` for top-k), with the policy's ``logits`` (on-policy distillation); ``reads``: the ``actor.*`` fields the function is given, each as a keyword argument of the field's name
    (checked to exist); nothing else of the config is passed.
    """

    fn: F
    needs_critic: bool = False
    needs_groups: bool = False
    needs_ref: bool = False
    needs_prox_logp: bool = False
    needs_teacher: bool = False
    reads: tuple[str, ...] = ()


ADVANTAGES: dict[str, Algorithm[AdvantageFn]] = {}
LOSSES: dict[str, Algorithm[PolicyLossFn]] = {}


def _register(registry: dict[str, Algorithm[F]], kind: str, name: str, needs: dict[str, Any]) -> Callable[[F], F]:
    """A decorator adding ``fn`` to ``registry`` with what it ``needs``; a second function under one name is
    an error, the same function registering again (its module re-imported, a notebook cell re-run) is not."""

    def deco(fn: F) -> F:
        old = registry.get(name)
        if old is not None and _qualname(old.fn) != _qualname(fn):
            raise ValueError(f"{kind} {name!r} is already registered (by {_qualname(old.fn)})")
        registry[name] = Algorithm(fn, **needs)
        return fn

    return deco


def register_advantage(
    name: str,
    *,
    needs_critic: bool = False,
    needs_groups: bool = False,
    needs_ref: bool = False,
    reads: tuple[str, ...] = (),
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an advantage estimator under ``name`` (``actor.adv_estimator``), declaring its needs."""
    needs = {"needs_critic": needs_critic, "needs_groups": needs_groups, "needs_ref": needs_ref, "reads": reads}
    return _register(ADVANTAGES, "advantage estimator", name, needs)


def register_loss(
    name: str,
    *,
    needs_prox_logp: bool = False,
    needs_ref: bool = False,
    needs_teacher: bool = False,
    reads: tuple[str, ...] = (),
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss under ``name`` (``actor.loss``), declaring its needs."""
    needs = {"needs_prox_logp": needs_prox_logp, "needs_ref": needs_ref, "needs_teacher": needs_teacher, "reads": reads}
    return _register(LOSSES, "policy loss", name, needs)


def _entry(registry: dict[str, Algorithm[F]], field: str, value: str) -> Algorithm[F]:
    """A registered name, or ``module:function`` (its registered entry when it has one, else no needs)."""

    def check(obj: object) -> Algorithm[F] | None:
        if not callable(obj):
            return None
        return next((entry for entry in registry.values() if entry.fn is obj), Algorithm(cast(F, obj)))

    return resolve(field, value, registry, "a function", check)


def advantage_entry(value: str) -> Algorithm[AdvantageFn]:
    """``actor.adv_estimator``: a registered name or ``module:function``; ConfigError naming the field otherwise."""
    return _entry(ADVANTAGES, "actor.adv_estimator", value)


def loss_entry(value: str) -> Algorithm[PolicyLossFn]:
    """``actor.loss``: a registered name or ``module:function``; ConfigError naming the field otherwise."""
    return _entry(LOSSES, "actor.loss", value)


def get_advantage(name: str) -> AdvantageFn:
    """The estimator function of ``advantage_entry(name)``."""
    return advantage_entry(name).fn


def get_loss(name: str) -> PolicyLossFn:
    """The policy loss function of ``loss_entry(name)``."""
    return loss_entry(name).fn
