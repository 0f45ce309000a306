"""The verifiers side of ``workflow=verifiers``: a small HTTP server run by the *verifiers* venv's python.

relayrl never imports this module's dependencies: verifiers (0.4) pins ``openai<3`` and relayrl's
``agents`` extra ``openai>=3.51``, so the environment lives in a venv of its own and this file is run
there as a script (``relayrl.agents.verifiers.WORKER`` is its path)::

    VENV/bin/python WORKER --port 8100 TASKSET_ID [vf-eval's --env.* / --sampling.* options]

It loads the environment once, as ``vf-eval`` would from the same options, serves its resources
(``env.serving()``: tool servers, the model-call interception), and answers on 127.0.0.1:

- ``GET /health`` -> ``{"taskset": ID, "tasks": N}`` (the selected tasks, ``--select.*`` applies);
- ``POST /episode`` ``{"task": I, "base_url": URL, "session": KEY, "model": NAME}`` -> one episode of
  task ``I`` (``Env.run_episode``) whose model calls go to ``URL`` (relayrl's AgentProxy) with the
  ``X-Relayrl-Session: KEY`` header, answered as ``{"reward", "ok", "rewards", "errors", "traces"}``.

The episode's reward is the sum over its traces of verifiers' weighted reward functions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections import Counter
from typing import Any


async def _serve(args: argparse.Namespace, vf_argv: list[str]) -> None:
    from aiohttp import web
    from pydantic_config import cli
    from verifiers.v1.cli.resolve import narrow_config, plugin_errors, with_positional_taskset
    from verifiers.v1.clients import ModelContext
    from verifiers.v1.configs.cli.eval import EvalConfig
    from verifiers.v1.utils.loaders import load_environment

    vf_argv = with_positional_taskset(vf_argv)
    with plugin_errors():
        config_type = narrow_config(EvalConfig, vf_argv)
        sys.argv = [sys.argv[0], *vf_argv, "--no-push"]
        config: Any = cli(config_type)
    env = load_environment(config.env)
    taskset = env.taskset.select(config.select)
    if not taskset.bounded:
        raise SystemExit(f"{type(taskset).__name__} is infinite: bound it with --select.* (e.g. -n)")
    tasks = list(taskset)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"taskset": config.env.taskset.id, "tasks": len(tasks)})

    async def episode(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            index, base_url, session = int(body["task"]), str(body["base_url"]), str(body["session"])
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"bad request: {e!r}; want task, base_url, session"}, status=400)
        if not 0 <= index < len(tasks):
            return web.json_response({"error": f"task {index} out of range: {len(tasks)} tasks"}, status=400)
        client = config.client.model_copy(
            update={"base_url": base_url, "headers": {**config.client.headers, "X-Relayrl-Session": session}}
        )
        ctx = ModelContext(client=client, model=str(body.get("model") or config.model), sampling=config.sampling)
        ep = await env.run_episode(tasks[index], ctx)
        rewards: Counter[str] = Counter()  # each reward function's value, summed over the traces
        errors = [f"{e.type}: {e.message}" for e in ep.errors]
        for trace in ep.traces:
            rewards.update({name: float(r.value) for name, r in trace.rewards.items() if r is not None})
            errors += [f"{e.type}: {e.message}" for e in getattr(trace, "errors", None) or []]
        return web.json_response(
            {
                "reward": sum(t.reward for t in ep.traces),
                "ok": bool(ep.ok),
                "rewards": rewards,
                "errors": errors,
                "traces": len(ep.traces),
            },
            dumps=lambda o: json.dumps(o, default=str),
        )

    app = web.Application()
    app.add_routes([web.get("/health", health), web.post("/episode", episode)])
    async with env.serving():
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, args.host, args.port).start()
        print(
            f"verifiers worker: {config.env.taskset.id}, {len(tasks)} tasks, http://{args.host}:{args.port}", flush=True
        )
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    # Run as a script, this file's folder is sys.path[0], and relayrl's own ``verifiers.py`` sits there:
    # it would shadow the verifiers package.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    ap = argparse.ArgumentParser(
        description="verifiers environment worker for relayrl workflow=verifiers", allow_abbrev=False
    )
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    args, vf_argv = ap.parse_known_args(sys.argv[1:] if argv is None else argv)  # the rest is vf-eval's
    asyncio.run(_serve(args, vf_argv))


if __name__ == "__main__":
    main()
