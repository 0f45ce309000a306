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
