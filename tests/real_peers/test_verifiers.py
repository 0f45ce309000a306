"""VerifiersWorkflow against real verifiers 0.4 environments: two workers run by the verifiers venv's
python (scripts/envs.sh) on 127.0.0.1, each loading one of the environments in tests/data/verifiers_envs
(``relayrl_vf_say``: single-turn, a verifiers reward function; ``relayrl_vf_echo``: multi-turn, the
environment echoes each reply as the next user turn and records the reward) with verifiers' ``null``
harness (its chat program, run by uv) in the subprocess runtime. The harness calls relayrl's AgentProxy,
which generates with the tiny model in this process (LocalEngine). Both rewards are 0.1 per character of
the replies, so they are checked against the generated tokens; logprobs against a teacher-forced forward."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest
import torch

from relayrl.agents.verifiers import WORKER, VerifiersError, VerifiersWorkflow
from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig
from relayrl.api.workflow import validate_trajectory
from relayrl.inference.local import LocalEngine
from tests.real_peers.envs import ROOT, built_env, env_environ, env_pins
from tests.real_peers.servers import free_port
from tests.test_workflows import segments

pytestmark = pytest.mark.real_peers
HARNESS = ["--env.agent.harness.id", "null", "--env.agent.runtime.type", "subprocess"]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """``{taskset id: url}``: both workers started at once, each waited for (``/health``) at most 120 s."""
    env = built_env(f"verifiers-{env_pins()['VERIFIERS_VERSION']}")
    environ = env_environ(env, PYTHONPATH=str(ROOT / "tests" / "data" / "verifiers_envs"), RELAYRL_VF_KEY="unused")
    logs = tmp_path_factory.mktemp("verifiers")
    procs, urls = {}, {}
    for taskset in ("relayrl_vf_say", "relayrl_vf_echo", "relayrl_vf_tool"):
        port = free_port()
        cmd = [str(env / "bin" / "python"), str(WORKER), "--port", str(port), taskset, *HARNESS,
               "--client.api-key-var", "RELAYRL_VF_KEY"]  # fmt: skip
        out = open(logs / f"{taskset}.log", "wb")  # noqa: SIM115 - the process writes it until the end
        procs[taskset] = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=environ, start_new_session=True
        )
        urls[taskset] = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        for taskset, url in urls.items():
            while True:
                if procs[taskset].poll() is not None:
                    raise RuntimeError(f"{taskset} worker exited: {(logs / f'{taskset}.log').read_text()[-3000:]}")
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{taskset} worker not up in 120 s: {(logs / f'{taskset}.log').read_text()[-3000:]}"
                    )
                time.sleep(0.3)
        yield urls
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = LocalEngine(InferenceConfig(seed=5), model=tiny_model, tokenizer=None)
    eng.initialize()
    yield eng
    eng.destroy()


G = GenerationConfig(max_new_tokens=6, temperature=1.0)


def check_tokens(traj, tiny_model, greedy: bool = False):
    """relayrl's own tokens: the recorded logprobs are the model's at the generated positions (greedy: each
    generated token is the argmax), version 0."""
    ids = traj["input_ids"][0].tolist()
    with torch.inference_mode():
        logits = tiny_model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1)
    chosen = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    m = traj["loss_mask"][0, 1:]
    if greedy:
        assert (logp.max(-1).values[m] - chosen[m]).abs().max() < 1e-4
    assert (chosen[m] - traj["logprobs"][0, 1:][m]).abs().max() < 1e-4
    assert (traj["versions"][0][traj["loss_mask"][0]] == 0).all()


def replies(traj, tokenizer):
    ids, mask = traj["input_ids"][0].tolist(), traj["loss_mask"][0].int().tolist()
    runs = segments(mask)
    # the reply text the proxy answers: the generated tokens up to an EOS, special tokens kept (a tiny model
    # writes <bos> mid-reply), which verifiers' reward functions and environment then score
    eos = tokenizer.eos_token_id
    gen = [tokenizer.decode(ids[a : b - 1] if ids[b - 1] == eos else ids[a:b]) for a, b, m in runs if m]
    ctx = [tokenizer.decode(ids[a:b]) for a, b, m in runs if not m]
    return gen, ctx


def test_single_turn_reward_is_verifiers_and_tokens_are_relayrls(workers, engine, tokenizer, tiny_model):
    wf = VerifiersWorkflow(tokenizer, G, workers["relayrl_vf_say"])
    try:

        async def episodes():
            return await asyncio.gather(*(wf.arun_episode(engine, {"id": i}) for i in range(4)))

        trajs = asyncio.run(episodes())
        for i, traj in enumerate(trajs):
            validate_trajectory(traj)
            gen, ctx = replies(traj, tokenizer)
            assert len(gen) == 1 and int(traj["num_turns"]) == 1
            assert f"Say something ({i})." in ctx[0] and "Be brief." in ctx[0]  # the task's prompt, templated
            assert float(traj["rewards"]) == pytest.approx(0.1 * len(gen[0]), abs=1e-5)  # verifiers' reward fn
            check_tokens(traj, tiny_model)
        with pytest.raises(VerifiersError, match="task 99 out of range: 4 tasks"):
            asyncio.run(wf.arun_episode(engine, {"id": 0, "vf_task": 99}))
    finally:
        wf.close()


def test_multi_turn_episode_is_one_row_with_the_environment_turns_masked(workers, engine, tokenizer, tiny_model):
    wf = VerifiersWorkflow(tokenizer, G, workers["relayrl_vf_echo"])
    try:

        async def episodes():
            return await asyncio.gather(*(wf.arun_episode(engine, {"id": i}) for i in range(2)))

        trajs = asyncio.run(episodes())
        for i, traj in enumerate(trajs):
            validate_trajectory(traj)
            assert traj["input_ids"].shape[0] == 1  # the three calls extend one another: one row
            gen, ctx = replies(traj, tokenizer)
            assert len(gen) == 3 and int(traj["num_turns"]) == 3
            assert f"Start ({i})." in ctx[0]
            for reply, turn in zip(gen[:-1], ctx[1:], strict=True):  # each reply echoed as the next user turn
                assert reply.strip() in turn, (reply, turn)
            # the reward the environment recorded: 0.1 per character of each reply
            assert float(traj["rewards"]) == pytest.approx(sum(0.1 * len(r) for r in gen), abs=1e-5)
            check_tokens(traj, tiny_model)
    finally:
        wf.close()


SHOUT = {  # the schema verifiers sends for relayrl_vf_tool's `shout` tool (read off a recorded prompt)
    "type": "function",
    "function": {
        "name": "shout_toolset_shout",
        "description": "Return the text upper-cased.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"title": "Text", "type": "string"}},
            "required": ["text"],
            "title": "shoutArguments",
        },
    },
}


def test_tool_calls_run_verifiers_tools(workers):
    """A model taught (by overfitting, Hermes template) to call the tool: verifiers runs its MCP toolset on
    the parsed call, the result comes back through relayrl's template, and verifiers' reward sees it."""
    from relayrl.agents.templates import tool_tokenizer
    from tests.agent_models import overfit

    tok = tool_tokenizer("hermes")
    call = '<tool_call>{"name": "shout_toolset_shout", "arguments": {"text": "hi"}}</tool_call>'
    conv = [{"role": "user", "content": "Shout hi."}, {"role": "assistant", "content": call},
            {"role": "tool", "content": "HI"}, {"role": "assistant", "content": "HI"}]  # fmt: skip
    model, loss = overfit(tok, [conv], tools=(SHOUT,))
    assert loss < 0.05
    eng = LocalEngine(InferenceConfig(seed=1), model=model, tokenizer=tok)
    eng.initialize()
    wf = VerifiersWorkflow(
        tok, GenerationConfig(max_new_tokens=100, greedy=True), workers["relayrl_vf_tool"], tool_parser="hermes"
    )
    try:
        traj = asyncio.run(wf.arun_episode(eng, {"id": 0}))
        validate_trajectory(traj)
        assert float(traj["rewards"]) == 1.0  # verifiers' reward: a tool result is "HI"
        assert int(traj["num_tool_calls"]) == 1 and int(traj["malformed_tool_calls"]) == 0
        assert int(traj["num_turns"]) == 2 and traj["input_ids"].shape[0] == 1
        ids, mask = traj["input_ids"][0].tolist(), traj["loss_mask"][0].int().tolist()
        runs = [(a, b) for a, b, m in segments(mask) if m]
        assert "shout_toolset_shout" in tok.decode(ids[: runs[0][0]])  # verifiers' tool schema, templated
        assert tok.decode(ids[runs[0][0] : runs[0][1]]).startswith(call)
        assert "<tool_response>\nHI\n</tool_response>" in tok.decode(ids[runs[0][1] : runs[1][0]])  # masked
        check_tokens(traj, model, greedy=True)
        assert "verifiers" not in sys.modules  # this process never imported it (relayrl's openai 3 stays)
    finally:
        wf.close()
        eng.destroy()
