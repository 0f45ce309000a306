"""OpenEnv environments as a relayrl workflow, over the environment server's own WebSocket protocol.

An OpenEnv environment ships as a server (``openenv.core.env_server.create_app``: a Docker image,
a Hugging Face Space, or ``uvicorn server.app:app``). Its HTTP ``/reset`` and ``/step`` build a
fresh environment per request, so an episode of several steps needs the ``/ws`` session, where
each connection owns one environment instance until it closes. One episode here is one session:

    {"type": "reset", "data": {...}}  ->  {"type": "observation", "data": {"observation": {...}, "reward", "done"}}
    {"type": "step", "data": ACTION}  ->  the same, or {"type": "error", "data": {"message", "code", ...}}
    {"type": "close"}

The reset observation is rendered as a user turn after the row's ``messages`` (a system prompt,
instructions; may be empty) and goes through the chat template; the policy's completion (relayrl's
exact tokens, logprobs and versions) becomes the action; each later observation is the next user
turn, appended as tokens (``user_turn_ids``: no re-encoding of what was generated). The episode
ends when the environment says ``done`` or after ``max_turns`` actions; its reward is the sum of the
step rewards (``reward="last"``: the last one). ``openenv`` is never imported: relayrl speaks the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import typing
import uuid
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit, urlunsplit

from transformers import PreTrainedTokenizerBase

from relayrl.api.engine import DataItem, InferenceEngine
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.api.workflow import RolloutWorkflow, Trajectory
from relayrl.data.chat import prompt_ids, user_turn_ids
from relayrl.rollout.workflows.multi_turn import TokenBuffer, reply_text
from relayrl.utils.resolve import load_path
from relayrl.utils.websocket import WebSocket, WebSocketError

Observation = dict[str, object]
ActionFn = Callable[[str, Observation], Mapping[str, object]]
RenderFn = Callable[[Observation], str]


class OpenEnvError(RuntimeError):
    """The environment server was unreachable, answered with an error, or refused an action."""


class InvalidAction(OpenEnvError):
    """The completion gave no action (``action_fn`` failed) or the server refused the one it gave."""


def ws_url(base_url: str) -> str:
    """``http://HOST:PORT`` (the server's base URL, as OpenEnv clients take it) -> ``ws://HOST:PORT/ws``."""
    parts = urlsplit(base_url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"base_url={base_url!r}: expected the environment server's http://HOST:PORT")
    path = parts.path.rstrip("/")
    return urlunsplit((scheme, parts.netloc, path if path.endswith("/ws") else path + "/ws", "", ""))


def _callable(field: str, value: str | Callable[..., object] | None) -> Callable[..., object] | None:
    if value is None or callable(value):
        return value
    obj = load_path(field, value)
    if not callable(obj):
        raise ValueError(f"{field}={value!r} is not callable")
    return typing.cast(Callable[..., object], obj)


class OpenEnvSession:
    """One episode's WebSocket session with an OpenEnv server: ``reset``, ``step``, ``close``."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws

    @classmethod
    async def open(cls, base_url: str, timeout: float) -> OpenEnvSession:
        url = ws_url(base_url)
        try:
            return cls(await WebSocket.connect(url, timeout))
        except WebSocketError as e:
            raise OpenEnvError(f"OpenEnv server unreachable at {base_url}: {e}") from e

    async def _ask(self, kind: str, data: Mapping[str, object]) -> dict[str, object]:
        try:
            await self.ws.send_text(json.dumps({"type": kind, "data": dict(data)}))
            answer = json.loads(await self.ws.recv_text())
        except (WebSocketError, TimeoutError) as e:
            raise OpenEnvError(f"OpenEnv {kind} at {self.ws.url}: {e}") from e
        except json.JSONDecodeError as e:
            raise OpenEnvError(f"OpenEnv {kind} at {self.ws.url}: the answer is not JSON ({e})") from e
        body = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(body, dict):
            raise OpenEnvError(f"OpenEnv {kind} at {self.ws.url}: unexpected answer {str(answer)[:300]}")
        if answer.get("type") == "error":
            what = f"the action {json.dumps(dict(data))[:300]}" if kind == "step" else kind
            detail = body.get("errors") or body.get("message")
            error = InvalidAction if kind == "step" else OpenEnvError
            raise error(f"OpenEnv server {self.ws.url} refused {what} ({body.get('code')}): {detail}")
        if answer.get("type") != "observation" or not isinstance(body.get("observation"), dict):
            raise OpenEnvError(f"OpenEnv {kind} at {self.ws.url}: expected an observation, got {str(answer)[:300]}")
        return body

    async def reset(self, **kwargs: object) -> dict[str, object]:
        return await self._ask("reset", kwargs)

    async def step(self, action: Mapping[str, object]) -> dict[str, object]:
        return await self._ask("step", action)

    async def close(self) -> None:
        if not self.ws.closed:
            with contextlib.suppress(WebSocketError, OSError, TimeoutError):  # a lost server is closed anyway
                await self.ws.send_text(json.dumps({"type": "close", "data": {}}))
        await self.ws.close()


class OpenEnvWorkflow(RolloutWorkflow):
    """An episode of the OpenEnv environment served at ``base_url`` (one WebSocket session each).

    - ``action_field``: the action is ``{action_field: completion text}`` (the reply as relayrl's OpenAI
      endpoint answers it: the stop token dropped, other special tokens kept); or ``action_fn``
      (``package.module:fn`` or a callable) ``fn(text, observation) -> dict`` builds it.
    - ``observation_field``: the user turn is that field of the observation; or ``render_fn``
      ``fn(observation) -> str``; neither: the observation as JSON.
    - ``reset_key``: the row's key whose dict is sent as reset arguments (``seed``, ``episode_id``).
    - ``tools``: an MCP environment's tools, listed after reset (``list_tools``) and rendered by the chat
      template; a tool's observation (``tool_name``, ``result``, ``error``) becomes a ``tool`` turn of the
      result's text, the policy's calls ``call_tool`` actions (``relayrl.agents.openenv:hermes_call_tool``).
    - ``max_sessions``: most episodes in a session at once (the server's ``max_concurrent_envs``);
      more wait for one to close. 0: no limit (a full server then fails the episode).
    - ``invalid_action``: ``fail`` (the episode fails naming the action and the server's reason) or
      ``end`` (the episode ends there with the rewards so far and ``invalid_action`` 1). Invalid: no
      action from ``action_fn``, or an error answer to a step (validation, the environment's exception);
      a timeout or a lost connection fails the episode either way.

    Extra sequence-level keys: ``num_turns``, ``env_done`` (1 when the environment ended the
    episode), ``invalid_action``.
    """

    def __init__(
        self,
        gconfig: GenerationConfig,
        tokenizer: PreTrainedTokenizerBase,
        base_url: str,
        max_turns: int = 1,
        action_field: str = "message",
        action_fn: str | ActionFn | None = None,
        observation_field: str | None = None,
        render_fn: str | RenderFn | None = None,
        reward: str = "sum",
        reset_key: str = "reset",
        invalid_action: str = "fail",
        timeout: float = 60.0,
        max_sessions: int = 0,
        tools: bool = False,
        prompt_format: str = "chat",
    ) -> None:
        ws_url(base_url)  # a bad URL stops the run at start-up
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if reward not in ("sum", "last"):
            raise ValueError(f"reward must be 'sum' or 'last', got {reward!r}")
        if invalid_action not in ("fail", "end"):
            raise ValueError(f"invalid_action must be 'fail' or 'end', got {invalid_action!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0 (0 = no limit), got {max_sessions}")
        self.gconfig, self.tokenizer, self.base_url, self.max_turns = gconfig, tokenizer, base_url, max_turns
        self.action_field, self.observation_field, self.reward_mode = action_field, observation_field, reward
        self.action_fn = typing.cast(ActionFn | None, _callable("workflow_kwargs.action_fn", action_fn))
        self.render_fn = typing.cast(RenderFn | None, _callable("workflow_kwargs.render_fn", render_fn))
        self.reset_key, self.invalid_action, self.timeout = reset_key, invalid_action, timeout
        self.prompt_format, self.max_sessions, self.tools = prompt_format, max_sessions, tools
        self._slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def render(self, observation: Observation) -> str:
        if self.render_fn is not None:
            return str(self.render_fn(observation))
        if self.observation_field is not None:
            if self.observation_field not in observation:
                raise OpenEnvError(
                    f"observation_field={self.observation_field!r} is not in the observation "
                    f"(fields: {sorted(observation)})"
                )
            return str(observation[self.observation_field])
        return json.dumps(observation)

    def turn(self, observation: Observation) -> tuple[str, str]:
        """The role and text of the turn an observation becomes: a tool's result (``tools``) or a user turn."""
        if self.tools and "tool_name" in observation:
            error = observation.get("error")
            if error:
                message = error.get("message") if isinstance(error, Mapping) else error
                return "tool", f"error: {message}"
            result = observation.get("result")
            content = result.get("content") if isinstance(result, Mapping) else None
            if isinstance(content, list):
                texts = [str(c.get("text", "")) for c in content if isinstance(c, Mapping) and c.get("type") == "text"]
                return "tool", "\n".join(texts)
            return "tool", json.dumps(result)
        return "user", self.render(observation)

    async def tool_schemas(self, session: OpenEnvSession) -> list[dict[str, object]]:
        """The environment's MCP tools as OpenAI function schemas (``list_tools``)."""
        listed = await session.step({"type": "list_tools"})
        tools = typing.cast(Observation, listed["observation"]).get("tools")
        if not isinstance(tools, list):
            raise OpenEnvError(f"tools=True but {session.ws.url} listed no tools: {str(listed)[:300]}")
        return [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description") or "",
                    "parameters": t.get("input_schema") or t.get("inputSchema") or {"type": "object"},
                },
            }
            for t in tools
            if isinstance(t, Mapping)
        ]

    def action(self, text: str, observation: Observation) -> dict[str, object]:
        if self.action_fn is None:
            return {self.action_field: text}
        try:
            action = self.action_fn(text, observation)
        except Exception as e:
            raise InvalidAction(f"action_fn found no action in the completion {text!r:.200}: {e!r}") from e
        if not isinstance(action, Mapping):
            raise InvalidAction(f"action_fn returned {type(action).__name__}, not a dict: {action!r:.200}")
        return dict(action)

    async def arun_episode(self, engine: InferenceEngine, data: DataItem) -> Trajectory | None:
        reset_args = data.get(self.reset_key) or {}
        if not isinstance(reset_args, Mapping):
            raise OpenEnvError(f"row[{self.reset_key!r}] must be a dict of reset arguments, got {reset_args!r:.200}")
        slots: contextlib.AbstractAsyncContextManager[object] = contextlib.nullcontext()
        if self.max_sessions:  # episodes beyond max_sessions wait for a session to close
            slots = self._slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(self.max_sessions))
        async with slots:
            session = await OpenEnvSession.open(self.base_url, self.timeout)
            try:
                return await self._episode(engine, data, session, reset_args)
            finally:
                await session.close()

    async def _episode(
        self, engine: InferenceEngine, data: DataItem, session: OpenEnvSession, reset_args: Mapping[str, object]
    ) -> Trajectory | None:
        first = await session.reset(**reset_args)
        observation = typing.cast(Observation, first["observation"])
        history = [dict(m) for m in typing.cast(list[Mapping[str, object]], data.get("messages") or [])]
        history.append({"role": "user", "content": self.render(observation)})
        tools = await self.tool_schemas(session) if self.tools else None
        buf = TokenBuffer(prompt_ids(self.tokenizer, history, self.prompt_format, tools))
        rid = uuid.uuid4().hex
        rewards: list[float] = []
        done = invalid = False
        for turn in range(self.max_turns):
            resp = await engine.agenerate(ModelRequest(rid=rid, input_ids=list(buf.ids), gconfig=self.gconfig))
            buf.add_generated(resp.output_tokens, resp.output_logprobs, resp.output_versions, resp.routed_experts)
            text = reply_text(self.tokenizer, resp.output_tokens, self.gconfig, resp.stop_reason)
            try:
                result = await session.step(self.action(text, observation))
            except InvalidAction:  # not a timeout or a lost server: those fail the episode either way
                if self.invalid_action == "fail":
                    raise
                invalid = True
                break
            observation = typing.cast(Observation, result["observation"])
            rewards.append(float(typing.cast(float, result.get("reward") or 0.0)))
            done = bool(result.get("done"))
            if done or turn == self.max_turns - 1:
                break
            role, content = self.turn(observation)
            ids = user_turn_ids(self.tokenizer, history, resp.output_tokens, content, self.prompt_format, role)
            buf.add_context(ids)
            history += [{"role": "assistant", "content": text}, {"role": role, "content": content}]
        reward = (rewards[-1] if self.reward_mode == "last" else sum(rewards)) if rewards else 0.0
        turns = len(rewards) + int(invalid)
        return buf.trajectory(reward, num_turns=turns, env_done=float(done), invalid_action=float(invalid))
