"""What RemoteEngine has in flight on each server, so that a server it evicts (frozen, dead,
unreachable) takes none of the run's time with it.

- ``InFlight``: generation calls, cancelled at once when their server is evicted (from any thread)
  and re-issued elsewhere by their caller.
- ``fan_out``: an admin call (weight load, pause) on many servers at once, no longer waited for
  once its server is evicted (a frozen server's call ends by its own timeout, in a daemon thread).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from relayrl.inference.remote.protocol import Server
from relayrl.utils.deadline import Stalled

T = TypeVar("T")


class ServerEvicted(ConnectionError):
    """The server a call waited on was evicted while the call ran."""


class RequestDeadline(TimeoutError):
    """A generation call ran past its deadline (``inference.request_timeout`` + ``token_timeout`` x tokens)."""


class InFlight:
    """Generation calls waiting on each server (by URL), on whichever event loops they run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Future[object]]]] = {}
        self.why: dict[str, str] = {}  # why each server was last evicted (for the messages below)

    def check_wait(self, servers: list[Server], what: str, since: float, timeout: float) -> None:
        """``Stalled`` once every server has been out for ``timeout`` seconds (``server_wait_timeout``)."""
        waited = time.monotonic() - since
        if waited > timeout:
            why = ", ".join(f"{s.url} ({self.why.get(s.url, 'out')})" for s in servers)
            raise Stalled(
                f"{what} waited {waited:.0f}s for an inference server and none is in service: {why}; "
                "restart or unfreeze them, or wait longer with inference.server_wait_timeout"
            )

    def describe(self, servers: list[Server]) -> str:
        """Each server's state, for the watchdog's stall report."""
        return "; ".join(
            f"{s.url} {'alive' if s.alive else 'evicted (' + self.why.get(s.url, '?') + ')'}, {s.in_flight} in "
            f"flight, v{s.version}{', updating' if s.updating else ''}"
            for s in list(servers)
        )

    async def run(self, srv: Server, call: Awaitable[T], timeout: float) -> T:
        """``call``'s result; ``ServerEvicted`` when ``srv`` is evicted first, ``RequestDeadline``
        after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = asyncio.ensure_future(call)
        key = (loop, fut)
        with self._lock:  # evict() marks the server out before it takes this lock to cancel
            if not srv.alive:
                fut.cancel()
                raise ServerEvicted(f"{srv.url} was evicted")
            self._calls.setdefault(srv.url, set()).add(key)
        try:
            done, _ = await asyncio.wait({fut}, timeout=timeout)
        finally:
            with self._lock:
                self._calls.get(srv.url, set()).discard(key)
            if not fut.done():  # past the deadline, or this request was cancelled itself
                fut.cancel()
        if not done:
            raise RequestDeadline(f"{srv.url} sent no reply within {timeout:.0f}s")
        if fut.cancelled():
            raise ServerEvicted(f"{srv.url} was evicted while the request ran")
        return fut.result()  # type: ignore[return-value]

    def cancel(self, url: str) -> int:
        """Cancel every call waiting on ``url`` (thread-safe); how many there were."""
        with self._lock:
            calls = list(self._calls.pop(url, ()))
        for loop, fut in calls:
            if not loop.is_closed():
                loop.call_soon_threadsafe(fut.cancel)
        return len(calls)


def fan_out(
    fn: Callable[[Server], object], servers: list[Server], on_error: Callable[[Server, BaseException], None]
) -> None:
    """``fn(server)`` on every server at once (the module docstring), each in a daemon thread;
    ``on_error`` gets each exception."""
    pending: list[tuple[Server, threading.Event]] = []

    def one(s: Server, done: threading.Event) -> None:
        try:
            fn(s)
        except BaseException as e:  # noqa: BLE001 - handed to on_error
            on_error(s, e)
        finally:
            done.set()

    for s in servers:
        pending.append((s, threading.Event()))
        threading.Thread(target=one, args=pending[-1], name="relayrl-admin", daemon=True).start()
    while pending:
        pending = [(s, done) for s, done in pending if not done.is_set() and s.alive]
        if pending:
            pending[0][1].wait(0.05)
