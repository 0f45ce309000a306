"""A uvloop event loop on a daemon thread: where ``WorkflowExecutor`` runs its episodes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine

import uvloop


class LoopThread:
    """``start`` runs a fresh loop on a daemon thread that calls ``tick`` every ``period`` seconds;
    ``spawn`` starts a task on it (held until done); ``stop`` cancels every task and closes the loop."""

    def __init__(self, name: str, tick: Callable[[], None], period: float = 0.02) -> None:
        self.name, self.tick, self.period = name, tick, period
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.loop.create_task(self._ticker())  # (the loop is not running yet: safe from this thread)
        self._thread = threading.Thread(target=self.loop.run_forever, name=self.name, daemon=True)
        self._thread.start()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            self.tick()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop (from any thread); nothing once the loop is closed."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn)

    def spawn(self, coro: Coroutine[object, object, None]) -> None:
        """Start ``coro`` as a task (call on the loop's thread); a strong reference keeps it until done."""
        assert self.loop is not None
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        """Cancel every task on the loop and close it. Safe to call twice."""
        if self._thread is None or self.loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._cancel_all(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=60)
        self.loop.close()
        self._thread = self.loop = None

    async def _cancel_all(self) -> None:
        # The spawned tasks and those they started (an engine's batched HTTP calls, a user's helpers) are
        # given time to unwind (close their connections) before the loop closes: a task cancelled but
        # never run again is destroyed pending, its clean-up skipped.
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
