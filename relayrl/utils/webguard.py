"""Which HTTP requests a local server answers: its own Host only, and nothing a foreign web page sent.

A server on 127.0.0.1 is reachable from every web page the user opens: a page can send "simple"
requests (no CORS preflight) and, by DNS rebinding (its own name resolving to 127.0.0.1), read
the replies. :func:`refusal` therefore refuses

- a ``Host`` that is a name other than ``localhost``, the bound host or this machine's own names
  (IP literals are fine: rebinding needs a name);
- an ``Origin`` whose host:port is not the request's ``Host`` (a cross-site request);
- ``Sec-Fetch-Site: cross-site`` / ``same-site`` (what browsers send with a foreign ``<script>``
  or ``<img>`` that carries no ``Origin``).

Clients that are not browsers (httpx, curl, SGLang's and relayrl's own) send none of these headers
but ``Host``, so they are unaffected.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import socket
import typing
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit


def _split_host(value: str) -> str:
    """``host[:port]`` -> host, lower case, without IPv6 brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback."""
    host = host.strip("[]")
    return host == "localhost" or (_is_ip(host) and ipaddress.ip_address(host).is_loopback)


@functools.cache
def _own_names() -> frozenset[str]:
    return frozenset({"localhost"} | {name.lower() for name in (socket.gethostname(), socket.getfqdn()) if name})


def refusal(headers: Mapping[str, str], bound_host: str) -> str | None:
    """Why a request with these (lower-case keyed) headers is refused, or None to answer it."""
    host_header = headers.get("host", "")
    host = _split_host(host_header)
    if not host:
        return "a request without a Host header"
    if not _is_ip(host) and host not in _own_names() and host != _split_host(bound_host):
        return f"Host {host_header!r} is not this server's (DNS rebinding?)"
    origin = headers.get("origin")
    if origin is not None:
        parts = urlsplit(origin)
        if origin == "null" or parts.netloc.lower() != host_header.strip().lower():
            return f"cross-site request from Origin {origin!r}"
    if headers.get("sec-fetch-site", "").lower() in ("cross-site", "same-site"):
        return "cross-site request (Sec-Fetch-Site)"
    return None


class GuardMiddleware:
    """ASGI middleware in front of a local server's routes: refuses what :func:`refusal` refuses
    (403), POST bodies that are not ``application/json`` (415: a browser sends text/plain or form
    bodies cross-site without asking first), bodies over ``max_body`` bytes (413, before reading
    them when Content-Length says so) and bodies not fully sent within ``body_timeout`` seconds
    (408). Paths in ``raw_paths`` take other bodies and read them themselves (their own caps)."""

    def __init__(
        self,
        app: object,
        bound_host: str,
        max_body: int,
        body_timeout: float = 30.0,
        raw_paths: tuple[str, ...] = (),
    ) -> None:
        self.app, self.bound_host, self.max_body = app, bound_host, max_body
        self.body_timeout, self.raw_paths = body_timeout, raw_paths

    async def _send(self, send: Any, status: int, message: str) -> None:
        """An OpenAI-style JSON error reply, the connection closed after it."""
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": status}
        data = json.dumps({"error": error}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": [*headers, (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": data})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # type: ignore[operator]
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        why = refusal(headers, self.bound_host)
        if why is not None:
            await self._send(send, 403, f"refused: {why}")
            return
        if scope["method"] not in ("POST", "PUT", "PATCH") or scope["path"] in self.raw_paths:
            await self.app(scope, receive, send)  # type: ignore[operator]
            return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await self._send(send, 413, f"request body over {self.max_body} bytes (Content-Length {length})")
            return
        kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        has_body = "transfer-encoding" in headers or (length is not None and int(length) > 0)
        if has_body and kind != "application/json":
            await self._send(send, 415, f"Content-Type must be application/json, got {kind or 'none'!r}")
            return
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except TimeoutError:
                await self._send(send, 408, f"request body not received within {self.body_timeout:g}s")
                return
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body:
                await self._send(send, 413, f"request body over {self.max_body} bytes")
                return
            if not message.get("more_body", False):
                break
        first = iter([{"type": "http.request", "body": bytes(body), "more_body": False}])

        async def replay() -> dict[str, object]:  # the body read above, then what the client sends next
            return next(first, None) or typing.cast(dict[str, object], await receive())

        await self.app(scope, replay, send)  # type: ignore[operator]
