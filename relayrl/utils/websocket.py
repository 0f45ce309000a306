"""A minimal WebSocket client (RFC 6455, text messages) over asyncio streams.

relayrl speaks to environment servers that keep per-episode state on a WebSocket session
(OpenEnv's ``/ws``) and ships no WebSocket package, so this is the few frames it needs: the
opening handshake (checked), masked text frames out, text / continuation / ping / close frames in.
No extensions, no subprotocols; ``ws://`` only (``wss://`` with the default SSL context).
Every read and the handshake wait at most ``timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import ssl
import struct
from urllib.parse import urlsplit

_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
MAX_MESSAGE = 64 << 20  # bytes of one incoming message


class WebSocketError(ConnectionError):
    """The server refused the upgrade, broke the framing, or closed the session."""


class WebSocket:
    """One client connection: ``await WebSocket.connect(url, timeout)``, ``send_text``, ``recv_text``, ``close``."""

    def __init__(self, url: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float) -> None:
        self.url, self.timeout = url, timeout
        self._reader, self._writer = reader, writer
        self.closed = False

    @classmethod
    async def connect(cls, url: str, timeout: float = 30.0, headers: dict[str, str] | None = None) -> WebSocket:
        parts = urlsplit(url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise ValueError(f"not a WebSocket URL (ws://HOST:PORT/PATH): {url!r}")
        port = parts.port or (443 if parts.scheme == "wss" else 80)
        tls = ssl.create_default_context() if parts.scheme == "wss" else None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port, ssl=tls), timeout)
        except (OSError, TimeoutError) as e:
            raise WebSocketError(f"cannot connect to {url}: {e or type(e).__name__}") from e
        key = base64.b64encode(os.urandom(16)).decode()
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rsplit("@", 1)[-1]
        lines = [
            f"GET {path} HTTP/1.1",
            f"Host: {host}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
            *(f"{k}: {v}" for k, v in (headers or {}).items()),
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            writer.close()
            raise WebSocketError(f"no WebSocket handshake from {url} within {timeout}s: {e or type(e).__name__}") from e
        status, *fields = head.decode("latin-1").split("\r\n")
        got = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields if f)}
        accept = base64.b64encode(hashlib.sha1((key + _GUID).encode()).digest()).decode()
        if not status.startswith("HTTP/1.1 101") or got.get("sec-websocket-accept") != accept:
            writer.close()
            raise WebSocketError(
                f"{url} refused the WebSocket upgrade: {status!r} (is this the server's WebSocket route?)"
            )
        return cls(url, reader, writer, timeout)

    async def send_text(self, text: str) -> None:
        await self._send(0x1, text.encode())

    async def _send(self, opcode: int, payload: bytes) -> None:
        if self.closed:
            raise WebSocketError(f"the WebSocket session with {self.url} is closed")
        n = len(payload)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + struct.pack("!H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack("!Q", n)
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self._writer.write(head + mask + masked)
        await asyncio.wait_for(self._writer.drain(), self.timeout)

    async def _frame(self) -> tuple[bool, int, bytes]:
        b0, b1 = await self._reader.readexactly(2)
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack("!H", await self._reader.readexactly(2))
        elif n == 127:
            (n,) = struct.unpack("!Q", await self._reader.readexactly(8))
        if n > MAX_MESSAGE:
            raise WebSocketError(f"{self.url} sent a {n}-byte frame (limit {MAX_MESSAGE})")
        mask = await self._reader.readexactly(4) if b1 & 0x80 else b""
        data = await self._reader.readexactly(n)
        if mask:
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        return bool(b0 & 0x80), b0 & 0x0F, data

    async def recv_text(self, timeout: float | None = None) -> str:
        """The next text message; ``TimeoutError`` naming the server after ``timeout`` (default: the connection's)."""
        wait = self.timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(self._recv(), wait)
        except TimeoutError:
            raise TimeoutError(f"no message from {self.url} within {wait}s") from None
        except (asyncio.IncompleteReadError, OSError) as e:
            self.closed = True
            raise WebSocketError(f"{self.url} closed the connection: {e or type(e).__name__}") from e

    async def _recv(self) -> str:
        parts: list[bytes] = []
        while True:
            fin, opcode, data = await self._frame()
            if opcode == 0x8:  # close: echo it, report the server's code and reason
                code = struct.unpack("!H", data[:2])[0] if len(data) >= 2 else 1005
                await self.close(data[:2])
                raise WebSocketError(
                    f"{self.url} closed the session (code {code}: {data[2:].decode(errors='replace')!r})"
                )
            if opcode == 0x9:  # ping
                await self._send(0xA, data)
                continue
            if opcode == 0xA:  # pong
                continue
            if opcode not in (0x0, 0x1, 0x2):
                raise WebSocketError(f"{self.url} sent an unknown frame opcode {opcode}")
            parts.append(data)
            if sum(map(len, parts)) > MAX_MESSAGE:
                raise WebSocketError(f"{self.url} sent a message over {MAX_MESSAGE} bytes")
            if fin:
                return b"".join(parts).decode()

    async def close(self, code: bytes = struct.pack("!H", 1000)) -> None:
        """Send a close frame with ``code`` (best effort) and close the connection."""
        if not self.closed:
            with contextlib.suppress(OSError, TimeoutError, WebSocketError):
                await self._send(0x8, code)
        self.closed = True
        self._writer.close()
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
