"""One resolver for every extension point: a registered name or ``package.module:attr``.

``workflow``, ``reward_fn``, ``data.task``, ``actor.loss``, ``actor.adv_estimator`` and the SFT
``data.task`` all go through ``resolve``, so user code is reachable from YAML and the command
line exactly like the built-ins, and a bad value fails the same way: one line naming the field,
the value and what was not found (the module, the attribute, a registered name, or an object of
the wrong kind), with a did-you-mean for registered names. ``import_modules`` runs the config's
``imports`` first, so ``@register_*`` decorators in user modules fill the registries.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from typing import TypeVar

from relayrl.api.fields import ConfigError

T = TypeVar("T")


def import_modules(modules: list[str], field: str = "imports") -> None:
    """Import each module (registering what it defines); ConfigError naming the one that fails."""
    for i, name in enumerate(modules):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"{field}[{i}]={name!r}: module not found ({e})") from None


def load_path(field: str, path: str) -> object:
    """The object at ``package.module:attr`` (``attr`` may be dotted: ``mod:Class.method``)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{field}={path!r}: expected a registered name or 'package.module:attr'")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{field}={path!r}: module {module_name!r} not found ({e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{field}={path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve(
    field: str,
    value: str,
    registry: Mapping[str, T],
    expected: str,
    check: Callable[[object], T | None],
) -> T:
    """``registry[value]``, or the object at ``value`` when it has a ``:``, passed through ``check``
    (which returns the entry, or None for an object of the wrong kind; ``expected`` says the kind)."""
    if ":" not in value:
        if value in registry:
            return registry[value]
        close = difflib.get_close_matches(value, list(registry), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"{field}={value!r} is not registered; {hint}registered: {sorted(registry)} (or give 'package.module:attr')"
        )
    obj = load_path(field, value)
    entry = check(obj)
    if entry is None:
        raise ConfigError(f"{field}={value!r} is of type {type(obj).__name__}, expected {expected}")
    return entry


def registrar(registry: dict[str, T], kind: str) -> Callable[[str], Callable[[T], T]]:
    """``register(name)``: a decorator adding an object to ``registry``; another object under a taken
    name is an error, the same one again (its module re-imported) is not."""

    def register(name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            old = registry.get(name)
            if old is not None and _qualname(old) != _qualname(obj):
                raise ValueError(f"{kind} {name!r} is already registered (by {_qualname(old)})")
            registry[name] = obj
            return obj

        return deco

    return register


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
