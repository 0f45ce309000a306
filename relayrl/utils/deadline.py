"""Deadlines: every wait of a run has a named setting, and one that expires stops the run with one line.

``Stalled`` is that line: what waited, for whom, for how long, and the setting to change. The
executor stops the rollout on it at once (it is not one failed episode among many) and
``relayrl train`` prints it without a traceback. ``docs/reliability.md`` lists every deadline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Stalled(RuntimeError):
    """A wait passed its deadline and the run cannot go on; the message says what waited for whom
    and which setting gives it longer."""


def within(seconds: float, fn: Callable[[], T], stalled: Callable[[], str]) -> T:
    """``fn()``, run in a daemon thread; ``Stalled(stalled())`` when it has not returned after
    ``seconds`` (a blocking call nothing else can interrupt: a write to a hung file system, a
    FIFO; the thread is left to end on its own)."""
    box: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            err.append(e)

    thread = threading.Thread(target=run, name="relayrl-deadline", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise Stalled(stalled())
    if err:
        raise err[0]
    return box[0]
