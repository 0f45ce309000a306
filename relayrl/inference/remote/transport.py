"""RemoteEngine's HTTP transport: its clients (``Clients``) and how a failed call is raised (5xx:
retried elsewhere; 4xx: refused; a timeout: naming the call and the setting that gives it longer)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
import weakref
from collections.abc import AsyncGenerator, Iterator

import httpx

from relayrl.inference.remote.protocol import Call, ProtocolError, Server, ServerError


def check_status(url: str, call: Call, r: httpx.Response) -> None:
    if r.status_code >= 500:
        raise ServerError(f"{url}{call.path} answered {r.status_code}: {r.text[:200]}")
    if r.status_code >= 400:
        raise ValueError(f"{url}{call.path} refused the request ({r.status_code}): {r.text[:500]}")


def base_url(address: str) -> str:
    return address.rstrip("/") if "://" in address else f"http://{address}"


@contextlib.contextmanager
def naming_timeout(call: Call, srv: Server, timeout: float) -> Iterator[None]:
    """An httpx timeout of ``call`` raised again as the same exception type (callers evict on it), its
    message naming the call, the deadline and inference.request_timeout."""
    try:
        yield
    except httpx.TimeoutException as e:
        raise type(e)(
            f"{call.method} {srv.url}{call.path} got no answer within {timeout:g}s ({str(e) or type(e).__name__}); "
            "give it longer with inference.request_timeout"
        ) from e


class Clients:
    """The HTTP clients of one RemoteEngine: a sync one per admin call, an async one per event loop
    (``agenerate`` may be called from any loop/thread), all sending ``token``."""

    def __init__(self, connect_timeout: float, token: str) -> None:
        self.connect_timeout, self.token = connect_timeout, token
        self._lock = threading.Lock()
        self._ssl: ssl.SSLContext | None = None
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _verify(self) -> ssl.SSLContext:
        """One TLS context for every client: httpx would build one per client (~20 ms of CPU,
        twice per weight update and once per health probe)."""
        with self._lock:
            if self._ssl is None:
                self._ssl = httpx.create_ssl_context()
            return self._ssl

    def sync(self, timeout: float) -> httpx.Client:
        t = httpx.Timeout(timeout, connect=min(timeout, self.connect_timeout))
        return httpx.Client(timeout=t, headers=self._headers(), verify=self._verify())

    def request(self, srv: Server, call: Call, timeout: float) -> tuple[int, object]:
        """``call`` to ``srv`` within ``timeout`` (named if it passes): (status, the JSON body, or its
        text when it is not JSON: vLLM's adapter routes answer plain text)."""
        with naming_timeout(call, srv, timeout), self.sync(timeout) as c:
            r = c.request(call.method, srv.url + call.path, json=call.json)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def current(self) -> httpx.AsyncClient:
        """This event loop's client."""
        loop = asyncio.get_running_loop()
        client = self._async.get(loop)
        if client is None:
            limits = httpx.Limits(max_connections=4096, max_keepalive_connections=1024)
            # no read limit of its own: each generation call runs under its deadline (InFlight.run)
            timeout = httpx.Timeout(None, connect=self.connect_timeout)
            client = httpx.AsyncClient(timeout=timeout, limits=limits, headers=self._headers(), verify=self._verify())
            self._async[loop] = client
        return client

    async def send(self, url: str, call: Call) -> object:
        r = await self.current().request(call.method, url + call.path, json=call.json)
        check_status(url, call, r)
        return r.json()

    async def stream(self, url: str, call: Call) -> AsyncGenerator[object, None]:
        """The JSON lines of an NDJSON reply, as they arrive."""
        async with self.current().stream(call.method, url + call.path, json=call.json) as r:
            if r.status_code >= 400:
                await r.aread()
                check_status(url, call, r)
            async for line in r.aiter_lines():
                if line.strip():
                    try:
                        yield json.loads(line)
                    except ValueError as e:
                        raise ProtocolError(f"{url}{call.path} streamed a line that is not JSON: {line[:200]!r}") from e

    def close(self) -> None:
        for loop, client in list(self._async.items()):
            if not loop.is_closed() and loop.is_running():
                asyncio.run_coroutine_threadsafe(client.aclose(), loop)
        self._async.clear()
