"""relayrl.agents: the OpenAI-shaped client over a real LocalEngine, with the real `openai` types.

A small model is overfit on a few conversations written in our Hermes / Llama-3.1 templates, so
its greedy replies are real tool calls (and one malformed one) produced by a real engine.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.types.chat import ChatCompletion

from relayrl.agents import OpenAIAgentWorkflow, OpenAIClient, RequestError, parse_tool_calls
from relayrl.agents.messages import normalize_messages
from relayrl.agents.templates import tool_tokenizer
from relayrl.agents.tool_parsers import detect_parser
from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig
from relayrl.api.workflow import validate_trajectory
from relayrl.data.chat import encode, render
from relayrl.inference.local import LocalEngine
from relayrl.rollout import tools
from tests.agent_models import CALC, overfit
from tests.test_workflows import segments

GREEDY = GenerationConfig(max_new_tokens=64, greedy=True)
CALL = '<tool_call>{"name":"calc","arguments":{"expr":"12+7"}}</tool_call>'  # compact: the template renders it spaced
HERMES_CONVS = [
    [
        {"role": "user", "content": "12+7="},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "19"},
        {"role": "assistant", "content": "19"},
    ],
    [
        {"role": "user", "content": "oops"},
        {"role": "assistant", "content": '<tool_call>{"name":"calc","arguments":{"expr":}}</tool_call>'},
    ],
]
LLAMA_CONVS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "3*4="},
        {"role": "assistant", "content": '{"name":"calc","parameters":{"expr":"3*4"}}'},
        {"role": "tool", "content": "12"},
        {"role": "assistant", "content": "12"},
    ],
]


def make_engine(tok, convs, seed=0):
    model, loss = overfit(tok, convs, seed=seed)
    assert loss < 0.05
    eng = LocalEngine(InferenceConfig(seed=1), model=model, tokenizer=tok)
    eng.initialize()
    return eng


@pytest.fixture(scope="module")
def hermes():
    tok = tool_tokenizer("hermes", default_system="You are Qwen.")
    eng = make_engine(tok, HERMES_CONVS)
    yield tok, eng
    eng.destroy()


@pytest.fixture(scope="module")
def llama():
    tok = tool_tokenizer("llama3")
    eng = make_engine(tok, LLAMA_CONVS)
    yield tok, eng
    eng.destroy()


# ---------------------------------------------------------------------- parsers


def test_hermes_parser():
    out = parse_tool_calls(
        'let me\n<tool_call>\n{"name": "calc", "arguments": {"expr": "1+2"}}\n</tool_call>\n'
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
        "hermes",
    )
    assert out.content == "let me" and out.malformed == 0
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("calc", {"expr": "1+2"}), ("f", {"x": 1})]
    assert parse_tool_calls("just text", "hermes").tool_calls == []
    for bad in (
        '<tool_call>{"name": "calc", "arguments": {"expr": }</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "calc", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "calc"',
    ):
        out = parse_tool_calls(bad, "hermes")
        assert out.tool_calls == [] and out.content == bad and out.malformed == 1, bad


def test_llama3_parser():
    out = parse_tool_calls(
        '<|python_tag|>{"name": "calc", "parameters": {"expr": "2*3"}}; {"name": "g", "parameters": {}}', "llama3"
    )
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("calc", {"expr": "2*3"}), ("g", {})]
    assert out.content is None and out.malformed == 0
    plain = parse_tool_calls("The answer is 6.", "llama3")
    assert plain.tool_calls == [] and plain.content == "The answer is 6." and plain.malformed == 0
    bad = parse_tool_calls('{"name": "calc", "parameters": {"expr": 2*3}}', "llama3")
    assert bad.tool_calls == [] and bad.malformed == 1
    with pytest.raises(ValueError, match="tool parser must be one of"):
        parse_tool_calls("x", "mistral")
    assert detect_parser(tool_tokenizer("hermes").chat_template) == "hermes"
    assert detect_parser(tool_tokenizer("llama3").chat_template) == "llama3"


# ---------------------------------------------------------------------- the client


def test_hermes_agent_loop_keeps_generated_tokens(hermes):
    tok, eng = hermes
    client = OpenAIClient(eng, tok, GREEDY)

    async def agent():
        messages = [{"role": "user", "content": "12+7="}]
        first = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC], logprobs=True)
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "19"}]
        second = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
        return first, second, messages

    first, second, messages = asyncio.run(agent())
    assert isinstance(first, ChatCompletion) and first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert (
        call.type == "function"
        and call.function.name == "calc"
        and json.loads(call.function.arguments) == {"expr": "12+7"}
    )
    assert first.choices[0].message.content is None
    assert second.choices[0].message.content == "19" and second.choices[0].finish_reason == "stop"
    rec1, rec2 = client.records
    assert [lp.logprob for lp in first.choices[0].logprobs.content] == pytest.approx(rec1.logprobs)
    assert first.usage.prompt_tokens == len(rec1.prompt_ids) and first.usage.completion_tokens == len(rec1.output_ids)
    assert rec1.prompt_ids == encode(tok, render(tok, messages[:1], [CALC]))
    # the second prompt is the first call's tokens + only the new turn's tokens
    assert (
        rec2.parent is rec1
        and rec2.prompt_ids[: len(rec1.prompt_ids) + len(rec1.output_ids)] == rec1.prompt_ids + rec1.output_ids
    )
    added = tok.decode(rec2.prompt_ids[len(rec1.prompt_ids) + len(rec1.output_ids) :])
    assert added == "\n<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(rec1.output_ids) == CALL + "<|im_end|>"
    # re-rendering the conversation would re-encode the call as the template spells it: different tokens
    rerendered = render(tok, normalize_messages(messages), [CALC])
    assert '{"name": "calc", "arguments": {"expr": "12+7"}}' in rerendered
    assert rec2.prompt_ids != encode(tok, rerendered)

    client.set_final_reward(1.0)
    traj = client.export_trajectories(discount=0.9)
    validate_trajectory(traj)
    ids, mask = traj["input_ids"][0].tolist(), traj["loss_mask"][0].int().tolist()
    assert ids == rec2.prompt_ids + rec2.output_ids
    (p0, p1, _), (g0, g1, _), (e0, e1, _), (h0, h1, _) = runs = segments(mask)
    assert [v for *_, v in runs] == [0, 1, 0, 1]
    assert ids[g0:g1] == rec1.output_ids and ids[h0:h1] == rec2.output_ids
    assert traj["logprobs"][0, g0:g1].tolist() == pytest.approx(rec1.logprobs)
    assert traj["versions"][0, h0:h1].tolist() == rec2.versions and (traj["versions"][0, e0:e1] == -1).all()
    assert traj["rewards"].tolist() == pytest.approx([0.9])  # 0 + 0.9 * 1.0: the first call's return
    assert (
        traj["num_turns"].item() == 2
        and traj["num_tool_calls"].item() == 1
        and traj["malformed_tool_calls"].item() == 0
    )
    assert tok.decode(ids).count("You are Qwen.") == 1


def test_malformed_tool_call_is_a_plain_completion(hermes):
    tok, eng = hermes
    client = OpenAIClient(eng, tok, GREEDY)
    out = asyncio.run(
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "oops"}], tools=[CALC])
    )
    msg = out.choices[0].message
    assert msg.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert msg.content == '<tool_call>{"name":"calc","arguments":{"expr":}}</tool_call>'
    client.set_final_reward(0.0)
    traj = client.export_trajectories()
    assert traj["malformed_tool_calls"].tolist() == [1] and traj["num_tool_calls"].tolist() == [0]
    # tool_choice="none": no parsing at all, the same text comes back
    out = asyncio.run(
        client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "12+7="}], tools=[CALC], tool_choice="none"
        )
    )
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content == CALL


def test_llama3_tool_calls_and_bos_once(llama):
    tok, eng = llama
    client = OpenAIClient(eng, tok, GREEDY)
    assert client.tool_parser == "llama3"

    async def agent():
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3*4="}]
        first = await client.chat.completions.create(model="p", messages=messages, tools=[CALC])
        call = first.choices[0].message.tool_calls[0]
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "12"},
        ]
        return first, await client.chat.completions.create(model="p", messages=messages, tools=[CALC])

    first, second = asyncio.run(agent())
    assert json.loads(first.choices[0].message.tool_calls[0].function.arguments) == {"expr": "3*4"}
    assert second.choices[0].message.content == "12"
    rec1, rec2 = client.records
    assert rec2.parent is rec1
    assert (
        tok.decode(rec2.prompt_ids[len(rec1.prompt_ids) + len(rec1.output_ids) :])
        == "<|start_header_id|>ipython<|end_header_id|>\n\n12<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    traj = client.export_trajectories()
    text = tok.decode(traj["input_ids"][0].tolist())
    assert text.count("<|begin_of_text|>") == 1 and text.count("Cutting Knowledge Date") == 1


def test_rows_rewards_and_discount(hermes):
    """Calls that extend another join its row; an unrelated call and a second branch get rows of
    their own; G_i = r_i + discount * G_(i+1) in call order; each row gets its first call's return."""
    tok, eng = hermes
    client = OpenAIClient(eng, tok, GenerationConfig(max_new_tokens=6, top_k=0))

    async def run():
        base = [{"role": "user", "content": "12+7="}]
        a = await client.chat.completions.create(model="p", messages=base)
        follow = [*base, a.choices[0].message, {"role": "user", "content": "again"}]
        b = await client.chat.completions.create(model="p", messages=follow)  # extends a
        c = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "other"}])
        d = await client.chat.completions.create(model="p", messages=follow)  # a second branch off a
        return a, b, c, d

    a, b, c, d = asyncio.run(run())
    for comp, r in zip((a, b, c, d), (1.0, 2.0, 4.0, 8.0), strict=True):
        client.set_reward(comp.id, r)
    recs = client.records
    assert recs[1].parent is recs[0] and recs[2].parent is None and recs[3].parent is recs[0]
    assert client.returns(0.5) == pytest.approx(
        [1 + 0.5 * (2 + 0.5 * (4 + 0.5 * 8)), 2 + 0.5 * (4 + 0.5 * 8), 4 + 0.5 * 8, 8]
    )
    traj = client.export_trajectories(0.5)
    validate_trajectory(traj)
    assert traj["rewards"].tolist() == pytest.approx([1 + 0.5 * (2 + 0.5 * (4 + 0.5 * 8)), 4 + 0.5 * 8, 8])
    assert traj["num_turns"].tolist() == [2, 1, 1]
    lengths = traj["attention_mask"].sum(1).tolist()
    assert lengths == [
        len(recs[1].prompt_ids) + len(recs[1].output_ids),
        len(recs[2].prompt_ids) + len(recs[2].output_ids),
        len(recs[3].prompt_ids) + len(recs[3].output_ids),
    ]
    # the branch row trains only on its own output: the shared prefix (a's output included) is masked
    assert int(traj["loss_mask"][2].sum()) == len(recs[3].output_ids)
    with pytest.raises(KeyError, match="no completion 'nope'"):
        client.set_reward("nope", 1.0)


def test_completions_api_text_and_token_prompts(hermes):
    tok, eng = hermes
    client = OpenAIClient(eng, tok, GenerationConfig(max_new_tokens=5, top_k=0))

    async def run():
        first = await client.completions.create(model="p", prompt="Q: 1+1\nA:", logprobs=1)
        text = "Q: 1+1\nA:" + first.choices[0].text + "\nQ: 2+2\nA:"
        second = await client.completions.create(model="p", prompt=text)
        third = await client.completions.create(
            model="p", prompt=client.records[1].prompt_ids + client.records[1].output_ids + [5]
        )
        return first, second, third

    first, second, third = asyncio.run(run())
    r1, r2, r3 = client.records
    assert first.object == "text_completion" and first.choices[0].logprobs.token_logprobs == pytest.approx(r1.logprobs)
    assert r2.parent is r1 and r2.prompt_ids[: len(r1.prompt_ids) + len(r1.output_ids)] == r1.prompt_ids + r1.output_ids
    assert r3.parent is r2
    client.set_final_reward(1.0)
    traj = client.export_trajectories()
    assert traj["input_ids"].shape[0] == 1 and traj["num_turns"].tolist() == [3]


def test_request_errors_name_the_field(hermes):
    tok, eng = hermes
    client = OpenAIClient(eng, tok, GREEDY)

    def create(**kw):
        return asyncio.run(client.chat.completions.create(model="p", **kw))

    ok = create(
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
            {"role": "user", "content": "12+7="},
        ],
        max_tokens=2,
    )
    assert tok.decode(client.records[-1].prompt_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert ok.usage.completion_tokens == 2 and ok.choices[0].finish_reason == "length"
    cases = [
        (
            dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages[0].content[0]",
        ),
        (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
        (dict(messages=[{"role": "user", "content": "x"}], top_logprobs=2), "top_logprobs"),  # needs logprobs=true
        (dict(messages=[{"role": "user", "content": "x"}], presence_penalty=2.5), "presence_penalty"),
        (dict(messages=[{"role": "user", "content": "x"}], tool_choice="required"), "tool_choice"),  # no tools
        (dict(messages=[{"role": "user", "content": "x"}], response_format={"type": "json_schema"}), "response_format"),
        (dict(messages=[{"role": "user", "content": "x"}], temperature=3), "temperature"),
        (dict(messages=[{"role": "user", "content": "x"}], frobnicate=1), "frobnicate"),
        (
            dict(
                messages=[
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"id": "1", "type": "function", "function": {"name": "calc", "arguments": "{oops"}}
                        ],
                    },
                ]
            ),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (  # a tool call that is not an object (was an AssertionError)
            dict(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": ["calc(1)"]}]),
            "messages[1].tool_calls[0].function",
        ),
        (dict(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}]), "tools[0]"),
    ]
    for kw, param in cases:
        with pytest.raises(RequestError) as info:
            create(**kw)
        assert info.value.param == param, (kw, info.value)
        assert isinstance(info.value, openai.BadRequestError) and info.value.status_code == 400  # the SDK's own error
        assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"


def test_agent_workflow_reward_and_timeout(hermes):
    tok, eng = hermes

    async def agent(client, data):
        out = await client.chat.completions.create(model="p", messages=data["messages"], tools=[CALC])
        return 1.0 if out.choices[0].message.tool_calls else 0.0

    traj = asyncio.run(
        OpenAIAgentWorkflow(agent, tok, GREEDY).arun_episode(eng, {"messages": [{"role": "user", "content": "12+7="}]})
    )
    validate_trajectory(traj)
    assert traj["rewards"].tolist() == [1.0] and traj["num_tool_calls"].tolist() == [1]

    async def stuck(client, data):
        await asyncio.sleep(30)

    with pytest.raises(TimeoutError):
        asyncio.run(OpenAIAgentWorkflow(stuck, tok, GREEDY, timeout=0.2).arun_episode(eng, {"messages": []}))


# ---------------------------------------------------------------------- the HTTP proxy, agents in other processes


def test_proxy_serves_an_agent_in_another_process(hermes):
    import subprocess
    import sys
    from pathlib import Path

    from relayrl.agents.proxy import AgentProxy, ProxyAgentWorkflow

    tok, eng = hermes
    proxy = AgentProxy(None, tok, GREEDY).start()
    script = str(Path(__file__).parent / "agent_proxy_script.py")
    outputs, procs = [], []

    async def launch(base_url, api_key, data):
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                script,
                base_url,
                api_key,
                data["mode"],
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        )

    async def episode(mode, timeout):
        try:
            return await ProxyAgentWorkflow(proxy, launch, timeout=timeout).arun_episode(eng, {"mode": mode})
        finally:
            out, err = await procs[-1].communicate()
            outputs.append(out.decode().strip().splitlines()[-1] if out.strip() else err.decode())

    try:
        traj = asyncio.run(episode("reward", 120))
        validate_trajectory(traj)
        # the agent saw real tool calls, streamed the answer, and its reward ended the episode
        seen = json.loads(outputs[0])
        assert seen["call"] == ["calc", {"expr": "12+7"}, "tool_calls"]
        assert seen["answer"] == "19" and seen["finish"] == "stop"
        assert seen["pieces"] == 2 and seen["usage"] == 3  # token by token ("1", "9"; then the end token), usage last
        assert seen["posted"]["final"] is True and seen["posted"]["calls"] == 2
        assert (
            traj["rewards"].tolist() == [0.75]
            and traj["num_turns"].tolist() == [2]
            and traj["num_tool_calls"].tolist() == [1]
        )
        assert [v for *_, v in segments(traj["loss_mask"][0].int().tolist())] == [0, 1, 0, 1]
        assert proxy.sessions == {}  # closed

        # an agent that never posts a reward fails its episode after the timeout
        t0 = asyncio.run(_timed(episode("noreward", 3)))
        assert isinstance(t0[0], TimeoutError) and "posted no reward within 3" in str(t0[0]) and t0[1] < 30

        # OpenAI-style errors reach the SDK with their reason and field
        sid = proxy.open_session()
        out = subprocess.run(
            [sys.executable, script, proxy.base_url + "/v1", sid, "errors"], capture_output=True, text=True, timeout=120
        )
        errs = json.loads(out.stdout.strip().splitlines()[-1])
        assert errs["top_logprobs"]["status"] == 400 and errs["top_logprobs"]["param"] == "top_logprobs"
        assert "top_logprobs needs logprobs=true" in errs["top_logprobs"]["message"]
        assert errs["image"]["param"] == "messages[0].content[0]"
        assert errs["auth"]["status"] == 401 and "unknown session 'nope'" in errs["auth"]["message"]
    finally:
        proxy.stop()


async def _timed(coro):
    import time

    t = time.monotonic()
    try:
        await coro
        return None, time.monotonic() - t
    except Exception as e:
        return e, time.monotonic() - t


def test_sft_rows_of_agent_conversations_learn_every_assistant_turn():
    from relayrl.api.commands import SFTDataConfig
    from relayrl.sft import encode_row

    tok = tool_tokenizer("hermes", default_system="You are Qwen.")
    ids, mask = encode_row({"messages": HERMES_CONVS[0], "tools": [CALC]}, tok, SFTDataConfig())
    assert tok.decode(ids) + "\n" == render(
        tok, HERMES_CONVS[0], [CALC], add_generation_prompt=False
    )  # ends at the last reply
    learned = [t for t, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(learned) == CALL + "<|im_end|>" + "19<|im_end|>"  # both replies, their end tokens, nothing else
    with pytest.raises(ValueError, match="longer than data.max_seq_len"):
        encode_row({"messages": HERMES_CONVS[0], "tools": [CALC]}, tok, SFTDataConfig(max_seq_len=20))


def test_client_over_a_remote_engine_to_a_real_server(tokenizer):
    """Any InferenceEngine: the same client over RemoteEngine to a `relayrl serve` process."""
    from relayrl.inference.remote import RemoteEngine
    from relayrl.inference.server.launcher import launch_servers

    group = launch_servers(1)
    eng = RemoteEngine(InferenceConfig(backend="remote", request_timeout=60), addresses=group.addresses)
    eng.initialize()
    try:
        client = OpenAIClient(eng, tokenizer, GenerationConfig(max_new_tokens=6, top_k=0))

        async def agent():
            messages = [{"role": "user", "content": "12+7="}]
            first = await client.chat.completions.create(model="p", messages=messages, logprobs=True)
            messages += [first.choices[0].message, {"role": "user", "content": "sure?"}]
            return first, await client.chat.completions.create(model="p", messages=messages, n=2)

        first, second = asyncio.run(agent())
        assert len(second.choices) == 2
        r1, r2a, r2b = client.records
        assert r2a.parent is r1 and r2b.parent is r1
        assert tokenizer.decode(r2a.prompt_ids[len(r1.prompt_ids) + len(r1.output_ids) :]).endswith(
            "<|user|>sure?<|assistant|>"
        )
        assert [lp.logprob for lp in first.choices[0].logprobs.content] == pytest.approx(r1.logprobs)
        assert all(v == 0 for r in client.records for v in r.versions)
        client.set_final_reward(1.0)
        traj = client.export_trajectories()
        validate_trajectory(traj)
        assert traj["num_turns"].tolist() == [2, 1]  # the second choice branches off: its own row
    finally:
        eng.destroy()
        group.shutdown()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_tool_agent_workflow_through_the_chat_template(hermes, kind, monkeypatch):
    """workflow=tool_agent with rollout.tool_format=template: the built-in agent calls the sandboxed
    calculator through the template's tool calls and is rewarded on its final answer, by a plain reward
    fn or an async one (a reward model's ``as_reward_fn()``), which it once called without awaiting."""
    from relayrl import wiring
    from relayrl.api.config import RunConfig, load_config

    tok, eng = hermes
    answers = []

    def score(prompt, completions, prompt_ids, completion_ids, **data):
        answers.append(completions)
        return float(completions.strip() == data["answer"])

    async def ascore(engine, **kw):
        return score(**kw)

    reward = score if kind == "sync" else ascore

    cfg = load_config(
        RunConfig,
        None,
        [
            "workflow=tool_agent",
            "rollout.tool_format=template",
            "rollout.max_tool_calls=2",
            "gconfig.greedy=true",
            "gconfig.max_new_tokens=64",
            "rollout.tool_timeout=60",  # the tool's child starts within it however loaded the machine
        ],
    )
    made: list[float] = []

    class Recorded(tools.SubprocessTool):
        def __init__(self, mode: str = "calc", timeout: float = 2.0) -> None:
            made.append(timeout)
            super().__init__(mode, timeout)

    monkeypatch.setattr(tools, "SubprocessTool", Recorded)
    wf = wiring.make_workflow(cfg, tok, reward)
    assert made == [60.0]  # rollout.tool_timeout reached the template agent's tool
    assert isinstance(wf, OpenAIAgentWorkflow)
    traj = asyncio.run(wf.arun_episode(eng, {"messages": [{"role": "user", "content": "12+7="}], "answer": "19"}))
    validate_trajectory(traj)
    assert answers == ["19"] and traj["rewards"].tolist() == [1.0]
    assert traj["num_tool_calls"].tolist() == [1] and traj["num_turns"].tolist() == [2]
    # the tool really ran: its output (the sandboxed calculator's "19") is in the masked environment tokens
    text = tok.decode(traj["input_ids"][0].tolist())
    assert "<tool_response>\n19\n</tool_response>" in text


def test_the_template_tool_agent_runs_its_reward_fn_under_rollout_reward_timeout(hermes):
    """The built-in tool agent's reward fn runs off the episodes' event loop with ``rollout.reward_timeout``
    (as every built-in workflow's): one that hangs fails its episode with a TimeoutError naming the fn. It
    used to be called on the loop itself, with no deadline: a hung reward stopped every episode."""
    import threading

    from relayrl import wiring
    from relayrl.api.config import RunConfig, load_config

    tok, eng = hermes
    release, loop_threads = threading.Event(), []

    def hangs(prompt, completions, prompt_ids, completion_ids, **data):
        loop_threads.append(threading.current_thread())
        release.wait(60)
        return 1.0

    over = ["workflow=tool_agent", "rollout.tool_format=template", "rollout.max_tool_calls=2", "gconfig.greedy=true",
            "gconfig.max_new_tokens=64", "rollout.reward_timeout=0.5", "rollout.tool_timeout=60"]  # fmt: skip
    wf = wiring.make_workflow(load_config(RunConfig, None, over), tok, hangs)
    try:
        with pytest.raises(TimeoutError, match="'hangs' did not return within 0.5s"):
            asyncio.run(wf.arun_episode(eng, {"messages": [{"role": "user", "content": "12+7="}], "answer": "19"}))
    finally:
        release.set()
    assert len(loop_threads) == 1 and loop_threads[0] is not threading.main_thread()
