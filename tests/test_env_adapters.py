"""The OpenEnv and verifiers adapters' pieces that need neither package (their runs against real servers
are tests/real_peers/test_openenv.py and test_verifiers.py): URLs, arguments, the tool-call action and
the tool observation's turn, each error naming what was wrong."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.api.io import GenerationConfig
from relayrl.rollout.workflows import WORKFLOWS, workflow_factory
from relayrl.rollout.workflows.openenv import OpenEnvError, OpenEnvWorkflow, ws_url

G = GenerationConfig(max_new_tokens=4)


def test_ws_url_from_the_servers_base_url():
    assert ws_url("http://127.0.0.1:8000") == "ws://127.0.0.1:8000/ws"
    assert ws_url("https://x.hf.space/") == "wss://x.hf.space/ws"
    assert ws_url("http://h:1/prefix") == "ws://h:1/prefix/ws"
    assert ws_url("ws://h:1/ws") == "ws://h:1/ws"
    with pytest.raises(ValueError, match="base_url='ftp://h': expected the environment server's http://HOST:PORT"):
        ws_url("ftp://h")


def test_openenv_arguments_are_checked_at_start(tokenizer):
    assert WORKFLOWS["openenv"] is OpenEnvWorkflow and workflow_factory("openenv") is OpenEnvWorkflow
    cases = [
        ({"base_url": "localhost:8000"}, "base_url='localhost:8000'"),
        ({"max_turns": 0}, "max_turns must be >= 1, got 0"),
        ({"reward": "mean"}, "reward must be 'sum' or 'last', got 'mean'"),
        ({"invalid_action": "retry"}, "invalid_action must be 'fail' or 'end'"),
        ({"timeout": 0}, "timeout must be > 0 seconds"),
        ({"max_sessions": -1}, "max_sessions must be >= 0"),
        (
            {"action_fn": "relayrl.nope:f"},
            "workflow_kwargs.action_fn='relayrl.nope:f': module 'relayrl.nope' not found",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
            OpenEnvWorkflow(G, tokenizer, **{"base_url": "http://127.0.0.1:1", **kwargs})


def test_observations_become_turns(tokenizer):
    wf = OpenEnvWorkflow(G, tokenizer, "http://127.0.0.1:1", tools=True, observation_field="prompt")
    assert wf.turn({"prompt": "Shout hi."}) == ("user", "Shout hi.")
    result = {"content": [{"type": "text", "text": "HI"}, {"type": "image", "data": "..."}], "data": "HI"}
    assert wf.turn({"tool_name": "shout", "result": result, "error": None}) == ("tool", "HI")
    failed = {"tool_name": "shout", "result": None, "error": {"error_type": "execution_error", "message": "boom"}}
    assert wf.turn(failed) == ("tool", "error: boom")
    with pytest.raises(OpenEnvError, match=r"observation_field='prompt' is not in the observation \(fields: \['x'\]\)"):
        wf.render({"x": 1})
    assert OpenEnvWorkflow(G, tokenizer, "http://127.0.0.1:1").render({"a": 1, "b": "c"}) == '{"a": 1, "b": "c"}'


def test_action_functions():
    from relayrl.agents.openenv import hermes_call_tool, llama3_call_tool

    text = 'I will. <tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>'
    assert hermes_call_tool(text, {}) == {"type": "call_tool", "tool_name": "shout", "arguments": {"text": "hi"}}
    assert llama3_call_tool('{"name": "f", "parameters": {"x": 1}}', {})["arguments"] == {"x": 1}
    with pytest.raises(ValueError, match=r"no hermes tool call in the reply \(1 malformed\)"):
        hermes_call_tool("<tool_call>{bad</tool_call>", {})


def test_verifiers_workflow_arguments_and_an_unreachable_worker(tokenizer, tiny_model):
    from relayrl.agents.verifiers import WORKER, VerifiersError, VerifiersWorkflow
    from relayrl.api.config import InferenceConfig
    from relayrl.inference.local import LocalEngine
    from tests.real_peers.servers import free_port

    assert WORKER.is_file() and "verifiers" in WORKER.read_text()
    with pytest.raises(
        ValueError, match="worker_url='127.0.0.1:8100': expected the verifiers worker's http://HOST:PORT"
    ):
        VerifiersWorkflow(tokenizer, G, "127.0.0.1:8100")
    eng = LocalEngine(InferenceConfig(seed=1), model=tiny_model, tokenizer=tokenizer)
    eng.initialize()
    wf = VerifiersWorkflow(tokenizer, G, f"http://127.0.0.1:{free_port()}", timeout=5)
    try:
        with pytest.raises(VerifiersError, match="verifiers worker unreachable at http://127.0.0.1:"):
            asyncio.run(wf.arun_episode(eng, {"id": 0}))
    finally:
        wf.close()
        eng.destroy()


def test_verifiers_workflow_from_the_run_config(tokenizer):
    """``workflow: relayrl.agents.verifiers:VerifiersWorkflow`` with ``workflow_kwargs.worker_url``."""
    from relayrl.agents.verifiers import VerifiersWorkflow
    from relayrl.api.config import RunConfig
    from relayrl.api.fields import load_config
    from relayrl.wiring import make_workflow

    overrides = [
        "workflow=relayrl.agents.verifiers:VerifiersWorkflow",
        "workflow_kwargs.worker_url=http://127.0.0.1:8100",
    ]
    wf = make_workflow(load_config(RunConfig, None, overrides), tokenizer, reward_fn=None, gconfig=G)
    try:
        assert isinstance(wf, VerifiersWorkflow) and wf.worker_url == "http://127.0.0.1:8100"
        assert wf.proxy.base_url.startswith("http://127.0.0.1:")  # its own AgentProxy, started
    finally:
        wf.close()


async def _raw_ws_echo(reader, writer):
    """A WebSocket server written from RFC 6455 (the reference for relayrl's client): the handshake, then
    each masked client frame unmasked and echoed after a ping, split into a text frame and a continuation."""
    import base64
    import hashlib
    import struct

    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    key = next(
        line.split(":", 1)[1].strip() for line in head.split("\r\n") if line.lower().startswith("sec-websocket-key")
    )
    accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
    writer.write(
        f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n".encode()
    )

    def frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
        n = len(payload)
        size = (
            bytes([n])
            if n < 126
            else bytes([126]) + struct.pack("!H", n)
            if n < 65536
            else bytes([127]) + struct.pack("!Q", n)
        )
        return bytes([(0x80 if fin else 0) | opcode]) + size + payload

    while True:
        b0, b1 = await reader.readexactly(2)
        assert b1 & 0x80, "client frames must be masked"
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack("!H", await reader.readexactly(2))
        elif n == 127:
            (n,) = struct.unpack("!Q", await reader.readexactly(8))
        mask = await reader.readexactly(4)
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(await reader.readexactly(n)))
        if b0 & 0x0F == 0x8:  # close
            writer.write(frame(0x8, data))
            writer.close()
            return
        if b0 & 0x0F == 0xA:  # the client's pong to our ping
            assert data == b"p"
            continue
        half = len(data) // 2
        writer.write(frame(0x9, b"p") + frame(0x1, data[:half], fin=False) + frame(0x0, data[half:]))
        await writer.drain()


def test_websocket_client_frames_against_an_rfc_6455_server():
    from relayrl.utils.websocket import WebSocket, WebSocketError

    async def run():
        server = await asyncio.start_server(_raw_ws_echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        ws = await WebSocket.connect(f"ws://127.0.0.1:{port}/ws", timeout=5)
        for size in (5, 200, 70_000):  # the 7-bit, 16-bit and 64-bit lengths
            text = ("é" + "x" * size)[:size]
            await ws.send_text(text)
            assert await ws.recv_text() == text
        with pytest.raises(TimeoutError, match=f"no message from ws://127.0.0.1:{port}/ws within 0.2s"):
            await ws.recv_text(timeout=0.2)
        await ws.close()
        with pytest.raises(WebSocketError, match="is closed"):
            await ws.send_text("x")
        with pytest.raises(WebSocketError, match="refused the WebSocket upgrade"):  # an HTTP server, not a WebSocket
            http = await asyncio.start_server(_http_404, "127.0.0.1", 0)
            await WebSocket.connect(f"ws://127.0.0.1:{http.sockets[0].getsockname()[1]}/ws", timeout=5)
        server.close()

    asyncio.run(run())


async def _http_404(reader, writer):
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
    await writer.drain()
    writer.close()
