"""Client-side micro-batching of generation calls (used by RemoteEngine).

Generate calls headed to the same server within ``window_s`` of the first one (a burst of
episodes starts in one event-loop tick) leave as ONE HTTP call in the backend's documented
batch form; the reply is split and each caller gets its own item's reply, or the call's
error, exactly as if it had sent its request alone. So retries, eviction, re-issue and abort
continuation stay per request, in RemoteEngine.agenerate. Why: an HTTP round trip costs the
trainer ~ms of CPU, a 4-token generation on the server far less.

- Backends that stream batched replies (relayrl) resolve each item as its line arrives, so no
  item waits for the slowest of its call; the others get the whole reply at once.
- A batch the server refuses (4xx) or answers malformed is re-sent item by item (the items
  not yet answered), so one bad request fails alone.
- A connection error or 5xx reaches every item of the call not yet answered; each is then
  retried or re-issued elsewhere by its own caller.
- Callers that gave up (cancelled) before the flush are left out of the call; one that gives up
  while its call runs has its item aborted on the server (``backend.abort_items``), which would
  otherwise generate it to the end for as long as the call lasts.

One batcher per event loop (its futures belong to that loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable

from relayrl.inference.remote.peers import Peer
from relayrl.inference.remote.protocol import Call, ProtocolError

Send = Callable[[str, Call], Awaitable[object]]
Stream = Callable[[str, Call], AsyncGenerator[object, None]]
_Item = tuple[Call, "asyncio.Future[object]"]


class MicroBatcher:
    """Collects generate calls per server URL and sends them as batched calls."""

    def __init__(self, backend: Peer, send: Send, stream: Stream, window_s: float, max_items: int, abort: Send) -> None:
        self.backend, self.send, self.stream, self.abort = backend, send, stream, abort
        self.window_s, self.max_items = window_s, max_items
        self._pending: dict[str, list[_Item]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._by_url: dict[str, set[asyncio.Task[None]]] = {}  # the calls in flight (held until they end)
        self._aborts: set[asyncio.Future[object]] = set()

    def submit(self, url: str, call: Call) -> asyncio.Future[object]:
        """Queue ``call`` for ``url``; the future resolves to its own reply body (or error)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()
        items = self._pending.get(url)
        if items is None:
            items = self._pending[url] = []
            self._timers[url] = loop.call_later(self.window_s, self._flush, url)
        items.append((call, fut))
        if len(items) >= self.max_items:
            self._flush(url)
        return fut

    def _flush(self, url: str) -> None:
        timer = self._timers.pop(url, None)
        if timer is not None:
            timer.cancel()
        items = [it for it in self._pending.pop(url, []) if not it[1].done()]
        if not items:
            return
        task = asyncio.get_running_loop().create_task(self._send(url, items))
        self._by_url.setdefault(url, set()).add(task)
        task.add_done_callback(self._by_url[url].discard)

    def cancel(self, url: str) -> None:
        """Cancel the calls in flight to ``url`` (its server was evicted): their callers see them
        cancelled and re-issue their requests elsewhere."""
        for task in list(self._by_url.get(url, ())):
            task.cancel()

    async def _send(self, url: str, items: list[_Item]) -> None:
        try:
            groups = self.backend.batch([c for c, _ in items])
        except Exception as e:  # noqa: BLE001 - a caller must never wait for a call that was never sent
            for _, fut in items:
                _settle(fut, error=e)
            return
        await asyncio.gather(*(self._send_group(url, call, [items[i] for i in idx]) for call, idx in groups))

    def _abort(self, url: str, call: Call, position: int, fut: asyncio.Future[object]) -> None:
        """Item ``position`` of ``call`` ended: aborted on the server if its caller gave up (cancelled)."""
        if not fut.cancelled():
            return
        for abort in self.backend.abort_items(call, position):
            task = asyncio.ensure_future(self.abort(url, abort))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)

    async def _send_group(self, url: str, call: Call, items: list[_Item]) -> None:
        for j, (_, fut) in enumerate(items):
            fut.add_done_callback(functools.partial(self._abort, url, call, j))
        if len(items) > 1 and self.backend.streams_items:
            return await self._stream_group(url, call, items)
        try:
            body = await self.send(url, call)
            replies = [body] if len(items) == 1 else self.backend.split(body, len(items))
        except BaseException as e:  # noqa: BLE001 - handed to every caller, each handles it
            return await self._failed(url, e, items, batched=len(items) > 1)
        for (_, fut), reply in zip(items, replies, strict=True):
            _settle(fut, value=reply)

    async def _stream_group(self, url: str, call: Call, items: list[_Item]) -> None:
        """Lines ``{"index": i, ...reply}`` (or ``{"index": i, "error": ...}``) in finishing order."""
        pending = dict(enumerate(items))
        try:
            async with contextlib.aclosing(self.stream(url, call)) as lines:  # closes the connection on any exit
                async for line in lines:
                    i = line.get("index") if isinstance(line, dict) else None
                    if not isinstance(i, int) or i not in pending:
                        raise ProtocolError(
                            f"{url}{call.path} streamed an item with no pending index: {str(line)[:200]}"
                        )
                    _, fut = pending.pop(i)
                    assert isinstance(line, dict)  # (it has an index)
                    if "error" in line:
                        _settle(fut, error=ValueError(f"{url}{call.path} refused item {i}: {line['error']}"))
                    else:
                        _settle(fut, value=line)
            if pending:
                raise ProtocolError(
                    f"{url}{call.path} ended its stream with {len(pending)} of {len(items)} items unanswered"
                )
        except BaseException as e:  # noqa: BLE001 - handed to every unanswered caller, each handles it
            await self._failed(url, e, list(pending.values()), batched=True)

    async def _failed(self, url: str, e: BaseException, items: list[_Item], batched: bool) -> None:
        """The call that carried ``items`` (those not answered yet) failed with ``e``: each item cancelled
        with it, sent again alone (a refused or malformed batch) or given ``e`` (the module docstring)."""
        if isinstance(e, asyncio.CancelledError):
            for _, fut in items:
                fut.cancel()
            raise e
        if isinstance(e, ValueError) and batched:
            await asyncio.gather(*(self._send_group(url, c, [(c, f)]) for c, f in items if not f.done()))
            return
        for _, fut in items:
            _settle(fut, error=e)


def _settle(fut: asyncio.Future[object], value: object = None, error: BaseException | None = None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
