"""RewardPool: reward functions in worker processes, every call with a timeout.

Verifiers run user code (math parsers, sandboxes, judges) that can raise, hang or take its
process down (a segfault, ``os._exit``, the OOM killer). In a pool none of that reaches the
trainer: a call that raises fails with ``RewardError``, one that runs past ``timeout`` fails
with ``TimeoutError`` and one whose worker dies fails with ``RewardWorkerDied``; the executor
counts each as a failed episode. A hung or dead worker is killed and replaced at once, so the
pool keeps its size and the run goes on.

Workers start with ``forkserver`` (forked from a clean helper process: no threads, locks or
torch state of the trainer are inherited), so ``reward_fn`` must be picklable: a module-level
function or a ``functools.partial`` of one (``task_reward_fn`` and ``gsm8k_reward_fn`` are);
as with any non-fork multiprocessing, a script that builds a pool at import time needs the
``if __name__ == "__main__":`` guard (``relayrl train`` has it).
Each call occupies one worker; ``acall`` awaits it without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import multiprocessing as mp
import queue
import signal
import threading
import traceback
import typing
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relayrl.api.workflow import RewardFn


class RewardError(RuntimeError):
    """The reward function raised in its worker (the message carries its type, text and where)."""


class RewardWorkerDied(RuntimeError):
    """The worker process running a reward call died (it was replaced)."""


def _serve(conn: Connection, fn: RewardFn) -> None:
    """Worker loop: receive kwargs, send back ("ok", reward) or ("error", text).

    Ctrl-C in a terminal reaches the whole process group: the trainer stops the run and closes the
    pipes, so a worker ignores SIGINT (no traceback of its own) and ends on the closed pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            kwargs = conn.recv()
        except (EOFError, OSError):  # the pool closed the pipe (or its process died)
            return
        try:
            reply: tuple[str, object] = ("ok", float(fn(**kwargs)))
        except BaseException as e:  # noqa: BLE001 - reported to the caller, the worker lives on
            where = traceback.extract_tb(e.__traceback__)[-1]
            reply = ("error", f"{type(e).__name__}: {e} (at {where.filename}:{where.lineno} in {where.name})")
        conn.send(reply)


class _Worker:
    def __init__(self, ctx: mp.context.BaseContext, fn: RewardFn) -> None:
        self.conn, child = ctx.Pipe()
        process = typing.cast(mp.context.SpawnContext, ctx).Process  # (BaseContext's stub has no Process)
        self.proc = process(target=_serve, args=(child, fn), name="relayrl-reward", daemon=True)
        self.proc.start()
        child.close()

    def kill(self) -> int | None:
        """SIGKILL (if still running), reap, close the pipe; returns the exit code."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()
        return self.proc.exitcode


class RewardPool:
    """``n_workers`` processes running ``reward_fn``; ``call(**kw)`` / ``await acall(**kw)``.

    ``stats`` counts calls, ok results, errors, timeouts, worker deaths and replacements.
    """

    def __init__(self, reward_fn: RewardFn, n_workers: int, timeout: float, start_method: str = "forkserver") -> None:
        if n_workers < 1:
            raise ValueError(f"RewardPool needs n_workers >= 1, got {n_workers}")
        if not timeout > 0:
            raise ValueError(f"RewardPool needs timeout > 0, got {timeout}")
        self.fn, self.timeout = reward_fn, timeout
        self._ctx = mp.get_context(start_method)
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.stats: collections.Counter[str] = collections.Counter(
            {"calls": 0, "ok": 0, "errors": 0, "timeouts": 0, "worker_deaths": 0, "replaced": 0}
        )
        for _ in range(n_workers):
            self._add_worker()
        self._threads = ThreadPoolExecutor(n_workers, thread_name_prefix="relayrl-reward")

    def _add_worker(self) -> None:
        w = _Worker(self._ctx, self.fn)
        with self._lock:
            self._workers.add(w)
        self._idle.put(w)

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def _replace(self, w: _Worker) -> int | None:
        with self._lock:
            self._workers.discard(w)
            self.stats["replaced"] += 1
        code = w.kill()
        if not self._closed:
            self._add_worker()
        return code

    @property
    def n_alive(self) -> int:
        """Workers whose process is running (equals ``n_workers`` between calls)."""
        with self._lock:
            return sum(w.proc.is_alive() for w in self._workers)

    def call(self, **kwargs: object) -> float:
        """Run one reward call in a free worker (blocks until one is free, then up to ``timeout``)."""
        w = self._take()
        self._count("calls")
        try:
            w.conn.send(kwargs)
            ready = w.conn.poll(self.timeout)
        except (BrokenPipeError, EOFError, OSError):
            ready = True  # dead before the call started: recv below reports it
        except BaseException:  # kwargs that cannot be pickled: nothing was sent, the worker is fine
            self._idle.put(w)
            raise
        if not ready:
            self._count("timeouts")
            self._replace(w)
            raise TimeoutError(
                f"reward fn {_name(self.fn)!r} did not return within {self.timeout}s "
                f"(its worker was killed and replaced)"
            )
        try:
            status, value = w.conn.recv()
        except (EOFError, OSError):
            self._count("worker_deaths")
            code = self._replace(w)
            raise RewardWorkerDied(
                f"reward worker running {_name(self.fn)!r} died (exit code {code}); it was replaced"
            ) from None
        self._idle.put(w)
        if status == "error":
            self._count("errors")
            raise RewardError(f"reward fn {_name(self.fn)!r} raised {value}")
        self._count("ok")
        return float(value)

    def _take(self) -> _Worker:
        """An idle worker; waits for one (a closed pool raises instead of waiting forever)."""
        while not self._closed:
            try:
                return self._idle.get(timeout=0.5)
            except queue.Empty:
                continue
        raise RuntimeError("RewardPool is closed")

    async def acall(self, **kwargs: object) -> float:
        """``call`` on one of the pool's threads, awaited on the caller's event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(self.call, **kwargs))

    def close(self) -> None:
        """Kill every worker. Safe to call twice; calls in progress fail."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            workers = list(self._workers)
            self._workers.clear()
        for w in workers:
            w.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _name(fn: RewardFn) -> str:
    return str(getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", repr(fn)))
