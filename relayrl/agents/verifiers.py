"""verifiers environments as a relayrl workflow: the environment runs in a venv of its own (verifiers
0.4 pins ``openai<3``, relayrl's ``agents`` extra ``openai>=3.51``), in a *worker* (``WORKER``: see its
docstring) that plays one episode per ``POST /episode``. Its harness calls this workflow's
``AgentProxy``, so every model call is relayrl's own generation, recorded with exact token ids, logprobs
and weight versions (``docs/agents.md``); the reward verifiers computed goes on the episode's last call,
as in ``ProxyAgentWorkflow``. relayrl imports nothing of verifiers.

    workflow: relayrl.agents.verifiers:VerifiersWorkflow
    workflow_kwargs: {worker_url: "http://127.0.0.1:8100"}
"""

from __future__ import annotations

from pathlib import Path

import httpx
from transformers import PreTrainedTokenizerBase

from relayrl.agents.proxy import AgentProxy, ProxyAgentWorkflow
from relayrl.api.engine import DataItem
from relayrl.api.io import GenerationConfig

WORKER = Path(__file__).resolve().with_name("verifiers_worker.py")


class VerifiersError(RuntimeError):
    """The verifiers worker was unreachable, refused the request, or its episode failed."""


class VerifiersWorkflow(ProxyAgentWorkflow):
    """One episode = one task of the worker's taskset, played through a fresh proxy session (the
    session's ``launch`` is ``play``: the worker's reward ends it).

    - ``worker_url``: the worker's ``http://HOST:PORT`` (started with the verifiers venv's python).
    - ``task_key``: the row's key holding the task's index in the worker's taskset; a row without it
      plays task ``row["id"] % number of tasks``.
    - ``timeout``: seconds one episode may take (the worker's answer), ``discount`` as in
      ``ProxyAgentWorkflow``, ``tool_parser`` for the proxy's tool calls (``auto``, ``hermes``, ``llama3``).
    - ``proxy``: an ``AgentProxy`` to use; by default the workflow starts one on 127.0.0.1.

    An episode whose verifiers run reports errors fails with them (counted as failed); one that made no
    model call through the proxy fails too (the harness did not reach relayrl).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        gconfig: GenerationConfig,
        worker_url: str,
        task_key: str = "vf_task",
        timeout: float = 600.0,
        discount: float = 1.0,
        tool_parser: str = "auto",
        proxy: AgentProxy | None = None,
    ) -> None:
        if not worker_url.startswith(("http://", "https://")):
            raise ValueError(f"worker_url={worker_url!r}: expected the verifiers worker's http://HOST:PORT")
        super().__init__(
            proxy or AgentProxy(None, tokenizer, gconfig, tool_parser=tool_parser), self.play, timeout, discount
        )
        if proxy is None:
            self.proxy.start()
        self.worker_url, self.task_key = worker_url.rstrip("/"), task_key
        self._tasks: int | None = None

    async def _post(self, path: str, body: dict[str, object] | None = None) -> dict[str, object]:
        url = self.worker_url + path
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as http:
                resp = await (http.post(url, json=body) if body is not None else http.get(url))
        except httpx.TimeoutException as e:
            raise VerifiersError(
                f"verifiers worker at {self.worker_url}: no answer to {path} within {self.timeout}s"
            ) from e
        except httpx.HTTPError as e:
            raise VerifiersError(f"verifiers worker unreachable at {self.worker_url}: {e!r}") from e
        try:
            out = resp.json()
        except ValueError:
            out = {"error": resp.text[:500]}
        if resp.status_code != 200 or not isinstance(out, dict):
            raise VerifiersError(
                f"verifiers worker at {self.worker_url} answered {path} with {resp.status_code}: {out}"
            )
        return out

    async def num_tasks(self) -> int:
        if self._tasks is None:
            self._tasks = int(str((await self._post("/health"))["tasks"]))
        return self._tasks

    async def play(self, base_url: str, session_id: str, data: DataItem) -> None:
        """The row's task played by the worker, its model calls through proxy session ``session_id``."""
        n = await self.num_tasks()
        index = int(str(data[self.task_key] if self.task_key in data else int(str(data["id"])) % max(n, 1)))
        got = await self._post("/episode", {"task": index, "base_url": base_url, "session": session_id})
        errors = got.get("errors")
        if not got.get("ok") or errors:
            why = "; ".join(str(e) for e in errors) if isinstance(errors, list) else "not ok, no error reported"
            raise VerifiersError(f"verifiers episode of task {index} failed: {why}")
        session = self.proxy.sessions[session_id]
        if not session.client.records:
            raise VerifiersError(
                f"verifiers episode of task {index} made no model call through relayrl's proxy "
                f"({base_url}): nothing to train on"
            )
        session.finish(float(str(got["reward"])))

    def close(self) -> None:
        """Stop the proxy this workflow started (a passed-in one too)."""
        self.proxy.stop()
