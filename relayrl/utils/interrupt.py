"""SIGINT and SIGTERM as ``KeyboardInterrupt``, held back while a training step changes state.

A step first produces a batch (rollout, logprobs: nothing the checkpoint holds changes), then
updates the weights, pushes them to the generators and logs the step. An interrupt in the first
part stops at once; one in the second is held until the step is complete, so the checkpoint the
trainer writes on the way out is always a step boundary (weights, data cursor, RNG of the same
step) and ``--recover`` continues exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the trainer: ``signum`` says which; once the trainer has stopped,
    ``step`` is the last complete step and ``checkpoint`` the directory it was saved to (if any).
    ``final`` says that step was the run's last (the signal came during the final save or teardown).
    ``where``, when given, is what the stop left behind in the words of whoever stopped (``launcher=ray``:
    nothing saved at the interrupt, the latest periodic checkpoint to continue from)."""

    def __init__(
        self,
        signum: int,
        step: int | None = None,
        checkpoint: Path | None = None,
        where: str | None = None,
        final: bool = False,
    ) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step, self.checkpoint, self.where, self.final = signum, step, checkpoint, where, final


def raise_interrupted(signum: int, frame: FrameType | None) -> None:
    """A signal handler: SIGTERM stops a command the way Ctrl-C does (``Interrupted``)."""
    raise Interrupted(signum)


class InterruptGuard:
    """Installs the handlers (main thread only, and only when ``install``) and defers inside ``held()``."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, install: bool = True) -> None:
        self._install = install
        self._held = 0
        self.pending: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> InterruptGuard:
        if self._install and threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)  # type: ignore[arg-type]  # a handler signal.signal returned
        self._old.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._held:
            self.pending = self.pending or signum
            return
        raise_interrupted(signum, frame)

    @contextmanager
    def held(self) -> Iterator[None]:
        """A signal arriving inside is raised when the outermost ``held()`` ends."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if not self._held and self.pending is not None:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)
