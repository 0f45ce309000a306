"""workflow=openenv against a real OpenEnv server: the ``echo_env`` template that ``openenv init`` writes
(openenv-core 0.3.0, in the venv scripts/envs.sh builds), served by its own ``create_app`` on 127.0.0.1
in a process of its own, and the tiny model generating in this process (LocalEngine). The echo
environment answers each action with the message and a reward of 0.1 per character; it never ends an
episode, so ``max_turns`` does. Logprobs are checked against a teacher-forced forward of the same model."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig
from relayrl.api.workflow import validate_trajectory
from relayrl.inference.local import LocalEngine
from relayrl.rollout.workflows import WORKFLOWS
from relayrl.rollout.workflows.openenv import OpenEnvError, OpenEnvSession, OpenEnvWorkflow
from tests.real_peers.envs import ROOT, built_env, env_environ, env_pins
from tests.real_peers.servers import RealServer, free_port
from tests.test_workflows import segments

pytestmark = pytest.mark.real_peers
SESSIONS = 4  # the server's max_concurrent_envs (the template says 1; EchoEnvironment supports more)
SERVE = """
import sys, uvicorn
from openenv.core.env_server.http_server import create_app
from echo_env.models import EchoAction, EchoObservation
from echo_env.server.echo_env_environment import EchoEnvironment
app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo_env", max_concurrent_envs=int(sys.argv[-1]))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[sys.argv.index("--port") + 1]), log_level="warning")
"""


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    env = built_env(f"openenv-core-{env_pins()['OPENENV_CORE_VERSION']}")
    environ = env_environ(env, PYTHONPATH=str(env / "envs"))  # the template package `echo_env`
    cmd = [str(env / "bin" / "python"), "-c", SERVE, "--port", str(free_port()), str(SESSIONS)]
    server = RealServer("openenv echo_env", cmd, environ, tmp_path_factory.mktemp("openenv") / "server.log", 60)
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = LocalEngine(InferenceConfig(seed=3), model=tiny_model, tokenizer=None)
    eng.initialize()
    yield eng
    eng.destroy()


def reply(tokenizer, ids):
    """The action text of generated ``ids``: the reply without a final EOS, special tokens kept."""
    return tokenizer.decode(ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids)


G = GenerationConfig(max_new_tokens=6, temperature=1.0)
ROW = {"id": 0, "messages": [{"role": "system", "content": "Say something."}], "reset": {}}


def test_multi_turn_episodes_with_the_env_rewards_and_relayrl_tokens(echo_server, engine, tokenizer, tiny_model):
    wf = OpenEnvWorkflow(G, tokenizer, echo_server.url, max_turns=3, observation_field="echoed_message")
    assert WORKFLOWS["openenv"] is OpenEnvWorkflow

    async def episodes():
        return await asyncio.gather(*(wf.arun_episode(engine, {**ROW, "id": i}) for i in range(SESSIONS)))

    trajs = asyncio.run(episodes())
    for traj in trajs:
        validate_trajectory(traj)
        ids, mask = traj["input_ids"][0].tolist(), traj["loss_mask"][0].int().tolist()
        runs = segments(mask)
        gen = [(a, b) for a, b, m in runs if m]
        ctx = [(a, b) for a, b, m in runs if not m]
        assert len(gen) == 3 and int(traj["num_turns"]) == 3 and float(traj["env_done"]) == 0.0  # echo never ends
        texts = [reply(tokenizer, ids[a:b]) for a, b in gen]
        # the environment's reward: 0.1 per character of each message it was sent, summed over the steps
        assert float(traj["rewards"]) == pytest.approx(sum(0.1 * len(t) for t in texts), abs=1e-5)
        assert "Echo Env environment ready!" in tokenizer.decode(ids[: gen[0][0]])  # the reset observation
        for (a, b), text in zip(ctx[1:], texts[:-1], strict=True):  # each echo is the next user turn
            assert text.strip() in tokenizer.decode(ids[a:b]), (text, tokenizer.decode(ids[a:b]))
        # relayrl's own tokens: the generator's logprobs are the model's at those positions, version 0
        with torch.inference_mode():
            logits = tiny_model(torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        m = traj["loss_mask"][0, 1:]
        assert (logp[m] - traj["logprobs"][0, 1:][m]).abs().max() < 1e-4
        assert (traj["versions"][0][traj["loss_mask"][0]] == 0).all()
    assert len({tuple(t["input_ids"][0].tolist()) for t in trajs}) > 1  # sampled, not one fixed reply


def test_a_refused_action_names_the_action_and_the_server_reason(echo_server, engine, tokenizer):
    wf = OpenEnvWorkflow(G, tokenizer, echo_server.url, max_turns=2, action_field="msg")
    with pytest.raises(OpenEnvError, match=r"refused the action \{\"msg\".*message"):
        asyncio.run(wf.arun_episode(engine, ROW))
    ended = OpenEnvWorkflow(G, tokenizer, echo_server.url, max_turns=2, action_field="msg", invalid_action="end")
    traj = asyncio.run(ended.arun_episode(engine, ROW))
    validate_trajectory(traj)
    assert float(traj["invalid_action"]) == 1.0 and float(traj["rewards"]) == 0.0 and int(traj["num_turns"]) == 1
    # an action function: the message upper-cased, so the reward still counts its characters
    upper = OpenEnvWorkflow(G, tokenizer, echo_server.url, action_fn=lambda text, obs: {"message": text.upper()})
    traj = asyncio.run(upper.arun_episode(engine, ROW))
    gen = traj["input_ids"][0][traj["loss_mask"][0]].tolist()
    assert float(traj["rewards"]) == pytest.approx(0.1 * len(reply(tokenizer, gen)), abs=1e-5)


def test_capacity_and_an_unreachable_server_are_clear_errors(echo_server, engine, tokenizer):
    wf = OpenEnvWorkflow(G, tokenizer, echo_server.url, observation_field="echoed_message")

    async def over_capacity():
        held = [await OpenEnvSession.open(echo_server.url, 10) for _ in range(SESSIONS)]
        try:
            await wf.arun_episode(engine, ROW)
        finally:
            for s in held:
                await s.close()

    with pytest.raises(OpenEnvError, match="refused reset .*CAPACITY_REACHED"):
        asyncio.run(over_capacity())
    asyncio.run(wf.arun_episode(engine, ROW))  # sessions closed: room again

    async def queued():  # two sessions held elsewhere: four episodes, two at a time, all complete
        held = [await OpenEnvSession.open(echo_server.url, 10) for _ in range(SESSIONS - 2)]
        try:
            two = OpenEnvWorkflow(G, tokenizer, echo_server.url, max_turns=2, max_sessions=2)
            return await asyncio.gather(*(two.arun_episode(engine, ROW) for _ in range(4)))
        finally:
            for s in held:
                await s.close()

    assert [int(t["num_turns"]) for t in asyncio.run(queued())] == [2, 2, 2, 2]
    dead = OpenEnvWorkflow(G, tokenizer, f"http://127.0.0.1:{free_port()}", timeout=5)
    with pytest.raises(OpenEnvError, match="OpenEnv server unreachable at http://127.0.0.1"):
        asyncio.run(dead.arun_episode(engine, ROW))
    with pytest.raises(OpenEnvError, match="observation_field='nope' is not in the observation"):
        asyncio.run(OpenEnvWorkflow(G, tokenizer, echo_server.url, observation_field="nope").arun_episode(engine, ROW))
    assert sys.executable  # this process never imported openenv
    assert "openenv" not in sys.modules


def test_from_the_run_config(echo_server, engine, tokenizer):
    """``workflow=openenv`` with ``workflow_kwargs`` as a YAML or the command line gives them; ``max_turns``
    comes from ``rollout.max_turns``; a row of a relayrl task (system + question) comes before the observation."""
    from relayrl.api.config import RunConfig
    from relayrl.api.fields import load_config
    from relayrl.wiring import make_workflow

    overrides = ["workflow=openenv", f"workflow_kwargs.base_url={echo_server.url}", "rollout.max_turns=2",
                 "workflow_kwargs.observation_field=echoed_message"]  # fmt: skip
    cfg = load_config(RunConfig, None, overrides)
    wf = make_workflow(cfg, tokenizer, reward_fn=None, gconfig=G)
    assert isinstance(wf, OpenEnvWorkflow) and wf.max_turns == 2
    row = {"id": 7, "messages": [{"role": "user", "content": "12+7="}]}
    traj = asyncio.run(wf.arun_episode(engine, row))
    assert int(traj["num_turns"]) == 2
    assert "12+7=" in tokenizer.decode(traj["input_ids"][0]) and float(traj["rewards"]) >= 0


def test_relayrl_train_with_workflow_openenv(echo_server, tmp_path):
    """Two GRPO steps of ``relayrl train`` (the tiny model) whose episodes are the echo environment's."""
    import json

    from relayrl.cli import main

    args = ["train", "workflow=openenv", f"workflow_kwargs.base_url={echo_server.url}", "rollout.max_turns=2",
            f"workflow_kwargs.max_sessions={SESSIONS}", "workflow_kwargs.observation_field=echoed_message",
            "total_steps=2", "rollout.batch_size=2", "rollout.group_size=2", "gconfig.max_new_tokens=4",
            "data.n_train=8", "data.n_eval=2", "eval.before_training=false", "logging.tensorboard=false",
            "logging.progress=off", "checkpoint.save_final=false", f"run_dir={tmp_path / 'run'}"]  # fmt: skip
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["step"] == 2 and last["rollout/failed"] == 0 and last["rollout/completed"] > 0, last
    assert last["rollout/num_turns"] == 2 and last["rollout/env_done"] == 0 and last["rollout/reward"] > 0, last


SHOUT = {  # the schema the shout environment lists (read off a recorded prompt)
    "type": "function",
    "function": {
        "name": "shout",
        "description": "Return the text upper-cased.",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
    },
}


@pytest.fixture(scope="module")
def shout_server(tmp_path_factory):
    """tests/data/openenv_envs/shout_env: an MCPEnvironment whose one tool is ``shout``."""
    env = built_env(f"openenv-core-{env_pins()['OPENENV_CORE_VERSION']}")
    environ = env_environ(env, PYTHONPATH=str(ROOT / "tests" / "data" / "openenv_envs"))
    cmd = [str(env / "bin" / "python"), "-m", "shout_env", "--port", str(free_port())]
    server = RealServer("openenv shout_env", cmd, environ, tmp_path_factory.mktemp("shout") / "server.log", 60)
    yield server.start()
    server.stop()


def test_mcp_tools_listed_called_and_answered(shout_server):
    """``tools: true``: the environment's MCP tools go into the prompt through the chat template; a model
    taught to call them (overfit, Hermes template) makes two calls, the first result comes back as a
    tool turn, the second shouts the word and the environment ends the episode with reward 1."""
    from relayrl.agents.templates import tool_tokenizer
    from tests.agent_models import overfit

    def call(text):
        return f'<tool_call>{{"name": "shout", "arguments": {{"text": "{text}"}}}}</tool_call>'

    tok = tool_tokenizer("hermes")
    conv = [{"role": "user", "content": "Shout hi."}, {"role": "assistant", "content": call("ho")},
            {"role": "tool", "content": "HO"}, {"role": "assistant", "content": call("hi")}]  # fmt: skip
    model, loss = overfit(tok, [conv], tools=(SHOUT,))
    assert loss < 0.05
    eng = LocalEngine(InferenceConfig(seed=1), model=model, tokenizer=tok)
    eng.initialize()
    try:
        wf = OpenEnvWorkflow(GenerationConfig(max_new_tokens=80, greedy=True), tok, shout_server.url, max_turns=4,
                             tools=True, observation_field="prompt", action_fn="relayrl.agents.openenv:hermes_call_tool")  # fmt: skip
        traj = asyncio.run(wf.arun_episode(eng, {"id": 0}))
        validate_trajectory(traj)
        ids, mask = traj["input_ids"][0].tolist(), traj["loss_mask"][0].int().tolist()
        gen = [(a, b) for a, b, m in segments(mask) if m]
        assert float(traj["rewards"]) == 1.0 and float(traj["env_done"]) == 1.0 and int(traj["num_turns"]) == 2
        assert '"name": "shout"' in tok.decode(ids[: gen[0][0]]) and "Shout hi." in tok.decode(ids[: gen[0][0]])
        assert [reply(tok, ids[a:b]) for a, b in gen] == [call("ho"), call("hi")]
        assert "<tool_response>\nHO\n</tool_response>" in tok.decode(ids[gen[0][1] : gen[1][0]])  # masked
        with torch.inference_mode():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        chosen = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        m = traj["loss_mask"][0, 1:]
        assert (chosen[m] - traj["logprobs"][0, 1:][m]).abs().max() < 1e-4
        # a reply without a tool call (6 tokens cannot hold one) is not an action: the error names it
        plain = OpenEnvWorkflow(G, tok, shout_server.url, tools=True, observation_field="prompt",
                                action_fn="relayrl.agents.openenv:hermes_call_tool")  # fmt: skip
        with pytest.raises(OpenEnvError, match="action_fn found no action in the completion"):
            asyncio.run(plain.arun_episode(eng, {"id": 1}))
    finally:
        eng.destroy()
