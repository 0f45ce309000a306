"""An OpenAI-compatible HTTP endpoint for agents in other processes or frameworks.

An agent reaches it through ``base_url`` (``openai.AsyncOpenAI(base_url=proxy.base_url + "/v1",
api_key=session)``); each episode is a *session*, named by the API key (or an
``X-Relayrl-Session`` header), backed by its own ``OpenAIClient``, so every call is recorded
with exact tokens, logprobs and versions and the episode exports trajectories as in-process.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (``stream=true`` answers as
server-sent events in the SDK's chunk format, token by token where the engine streams:
``relayrl.agents.streaming``), ``GET /v1/models``, and ``POST /v1/rewards``
with ``{"reward": r}`` (the episode's final reward: ends the session) or
``{"reward": r, "completion_id": id}`` (one completion's reward; the session goes on).
Errors use OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``, so the SDK shows
the reason. ``ProxyAgentWorkflow`` opens a session per episode, hands it to the user's
``launch(base_url, api_key, data)`` and fails the episode when no reward arrives in ``timeout``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import socket
import threading
import time
import typing
import uuid
from collections.abc import Awaitable, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types import Completion
from openai.types.chat import ChatCompletion
from transformers import PreTrainedTokenizerBase

from relayrl.agents.client import OpenAIClient
from relayrl.agents.messages import RequestError
from relayrl.agents.streaming import sse_events
from relayrl.api.engine import DataItem, InferenceEngine
from relayrl.api.io import GenerationConfig
from relayrl.api.workflow import RolloutWorkflow, Trajectory
from relayrl.utils.logging import get_logger
from relayrl.utils.webguard import GuardMiddleware

_Kwargs = dict[str, typing.Any]  # a request body's remaining fields, passed through to the SDK call

logger = get_logger("agents")
SESSION_HEADER = "x-relayrl-session"
MAX_BODY = 32 << 20  # bytes of one request body (413 beyond)
MAX_CONNECTIONS = 256  # connections and requests at once (503 beyond)


def _error(
    status: int,
    message: str,
    param: str | None = None,
    code: str = "invalid_request",
    kind: str = "invalid_request_error",
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


class _Session:
    def __init__(self, client: OpenAIClient) -> None:
        self.client = client
        self.done: concurrent.futures.Future[float] = concurrent.futures.Future()

    def finish(self, reward: float) -> None:
        """The episode's final reward (on its last call): the session ends."""
        self.client.set_final_reward(reward)
        self.done.set_result(reward)


class AgentProxy:
    """The HTTP endpoint (see module doc), served from a background thread on ``host:port`` (0 = a free port).

    ``engine`` may be None until the first episode: ``ProxyAgentWorkflow`` sets the trainer's engine.
    """

    def __init__(
        self,
        engine: InferenceEngine | None,
        tokenizer: PreTrainedTokenizerBase,
        gconfig: GenerationConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        tool_parser: str = "auto",
        model_name: str = "relayrl-policy",
    ) -> None:
        self.engine, self.tokenizer, self.gconfig = engine, tokenizer, gconfig or GenerationConfig()
        self.tool_parser, self.model_name, self.host = tool_parser, model_name, host
        self.sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = int(self._sock.getsockname()[1])
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> AgentProxy:
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", limit_concurrency=MAX_CONNECTIONS)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="agent-proxy", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"agent proxy did not start on {self.base_url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._sock.close()

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str | None = None) -> str:
        """A new episode; its id is the API key (or ``X-Relayrl-Session`` header) the agent uses."""
        sid = session_id or "rl-" + uuid.uuid4().hex
        if self.engine is None:
            raise RuntimeError("AgentProxy has no engine yet: pass one, or let ProxyAgentWorkflow set the trainer's")
        client = OpenAIClient(
            self.engine, self.tokenizer, self.gconfig, tool_parser=self.tool_parser, model_name=self.model_name
        )
        with self._lock:
            if sid in self.sessions:
                raise ValueError(f"session {sid!r} is already open")
            self.sessions[sid] = _Session(client)
        return sid

    async def wait_reward(self, session_id: str, timeout: float) -> OpenAIClient:
        """The session's client once its final reward is posted; ``TimeoutError`` naming the session
        when none arrives within ``timeout`` seconds."""
        session = self.sessions[session_id]
        try:
            await asyncio.wait_for(asyncio.wrap_future(session.done), timeout)
        except TimeoutError:
            raise TimeoutError(
                f"agent session {session_id!r} posted no reward within {timeout}s "
                f"({len(session.client.records)} model calls made)"
            ) from None
        return session.client

    def close_session(self, session_id: str) -> None:
        with self._lock:
            self.sessions.pop(session_id, None)

    def _session(self, request: Request) -> tuple[str, _Session | None]:
        sid = request.headers.get(SESSION_HEADER) or ""
        if not sid:
            auth = request.headers.get("authorization", "")
            sid = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        return sid, self.sessions.get(sid)

    # ------------------------------------------------------------------ HTTP
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="relayrl agent proxy", docs_url=None, redoc_url=None)
        app.add_middleware(GuardMiddleware, bound_host=self.host, max_body=MAX_BODY)  # Host/Origin, size, timeout

        async def body_of(request: Request) -> dict[str, object] | JSONResponse:
            try:
                body = json.loads(await request.body() or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                return _error(400, f"the request body is not valid JSON ({e})")
            if not isinstance(body, dict):
                return _error(400, "the request body must be a JSON object")
            return body

        async def served(request: Request, chat: bool) -> Response:
            sid, session = self._session(request)
            if session is None:
                return _error(
                    401,
                    f"unknown session {sid!r}: use the API key (or {SESSION_HEADER} header) the trainer "
                    "opened for this episode",
                    code="invalid_session",
                    kind="authentication_error",
                )
            if session.done.done():
                return _error(409, f"session {sid!r} already ended (its reward was posted)", code="session_closed")
            body = await body_of(request)
            if isinstance(body, JSONResponse):
                return body
            key = "messages" if chat else "prompt"
            try:
                if body.get(key) is None:
                    raise RequestError(f"{key} is required", key)
                create = session.client.chat.completions.create if chat else session.client.completions.create
                out = await create(**typing.cast(_Kwargs, body))
            except RequestError as e:
                return JSONResponse({"error": e.body}, status_code=400)
            except ValueError as e:  # the engine refused the request (ids out of vocabulary, too long, ...)
                return _error(400, str(e) or type(e).__name__)
            if isinstance(out, (ChatCompletion, Completion)):
                return JSONResponse(out.model_dump(exclude_none=True))
            return StreamingResponse(sse_events(out), media_type="text/event-stream")

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await served(request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await served(request, chat=False)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse(
                {
                    "object": "list",
                    "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "relayrl"}],
                }
            )

        @app.post("/v1/rewards")
        async def rewards(request: Request) -> Response:
            sid, session = self._session(request)
            if session is None:
                return _error(401, f"unknown session {sid!r}", code="invalid_session", kind="authentication_error")
            body = await body_of(request)
            if isinstance(body, JSONResponse):
                return body
            reward = body.get("reward")
            if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
                return _error(400, f"reward must be a finite number, got {reward!r}", "reward")
            cid = body.get("completion_id")
            if cid is not None:
                try:
                    session.client.set_reward(str(cid), float(reward))
                except KeyError as e:
                    return _error(404, str(e.args[0]), "completion_id", code="unknown_completion")
                return JSONResponse({"session": sid, "completion_id": cid, "reward": float(reward), "final": False})
            if not session.client.records:
                return _error(400, "the session made no model call: there is nothing to reward", "reward")
            if session.done.done():
                return _error(409, f"session {sid!r} already has its final reward", code="session_closed")
            session.finish(float(reward))
            return JSONResponse(
                {"session": sid, "reward": float(reward), "final": True, "calls": len(session.client.records)}
            )

        return app


Launch = Callable[[str, str, DataItem], Awaitable[None] | None]


class ProxyAgentWorkflow(RolloutWorkflow):
    """One episode = one proxy session: ``launch(base_url, api_key, data)`` starts the agent (a
    subprocess, a request to an agent service, a coroutine), which posts its reward to
    ``/v1/rewards``; the episode fails with ``TimeoutError`` when no reward arrives in ``timeout``."""

    def __init__(self, proxy: AgentProxy, launch: Launch, timeout: float = 300.0, discount: float = 1.0) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.proxy, self.launch, self.timeout, self.discount = proxy, launch, timeout, discount

    async def arun_episode(self, engine: InferenceEngine, data: DataItem) -> Trajectory | None:
        if self.proxy.engine is None:
            self.proxy.engine = engine
        sid = self.proxy.open_session()
        try:
            started = self.launch(self.proxy.base_url + "/v1", sid, data)
            if started is not None:
                await started
            client = await self.proxy.wait_reward(sid, self.timeout)
        finally:
            self.proxy.close_session(sid)
        return client.export_trajectories(self.discount)
