"""OpenAI request features of relayrl.agents' client over a real LocalEngine: tool_choice
``required`` and named (enforced), ``top_logprobs`` against the model's own distribution, and
``stream=true`` token by token with the final usage chunk. The model is overfit on two
conversations through our Hermes template: a tool call for ``12+7=``, a plain reply for ``hi``."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch

from relayrl.agents import OpenAIClient, RequestError
from relayrl.agents.messages import normalize_messages
from relayrl.agents.streaming import safe_prefix
from relayrl.agents.templates import tool_tokenizer
from relayrl.api.io import GenerationConfig
from relayrl.data.chat import encode, render
from tests.agent_models import CALC
from tests.test_agents import make_engine

GREEDY = GenerationConfig(max_new_tokens=96, greedy=True)


def _call_conv(expr: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": {"expr": expr}}}
    return [{"role": "user", "content": f"{expr}="}, {"role": "assistant", "content": "", "tool_calls": [call]}]


CONVS = [_call_conv("12+7"), [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]]


@pytest.fixture(scope="module")
def hermes2():
    tok = tool_tokenizer("hermes", default_system="You are Qwen.")
    eng = make_engine(tok, CONVS)
    yield tok, eng
    eng.destroy()


def _chat(client, content, **kw):
    return asyncio.run(client.chat.completions.create(model="p", messages=[{"role": "user", "content": content}], **kw))


def test_tool_choice_required_and_named_make_the_reply_a_call(hermes2):
    """The reply is made to open a call (the opening goes in the prompt, masked); a model that then
    writes a valid call gives tool_calls; one that cannot (this tiny model, off its two examples)
    gives a plain completion with the malformed call counted, never a crash."""
    tok, eng = hermes2
    client = OpenAIClient(eng, tok, GREEDY)
    auto = _chat(client, "hi", tools=[CALC])
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content == "hello there"
    named = {"type": "function", "function": {"name": "calc"}}
    for choice, opening in (("required", "<tool_call>"), (named, '<tool_call>\n{"name": "calc"')):
        out = _chat(client, "12+7=", tools=[CALC], tool_choice=choice)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["calc"]
        assert tok.decode(client.records[-1].prompt_ids).endswith(opening)  # forced, not generated
        forced = _chat(client, "hi", tools=[CALC], tool_choice=choice)
        rec = client.records[-1]
        assert rec.text.startswith(opening) and tok.decode(rec.prompt_ids).endswith(opening)
        if forced.choices[0].message.tool_calls is None:
            assert rec.malformed_tool_calls == 1 and forced.choices[0].message.content == rec.text
    with pytest.raises(RequestError, match="not among the tools") as e:
        _chat(client, "hi", tools=[CALC], tool_choice={"type": "function", "function": {"name": "search"}})
    assert e.value.param == "tool_choice"


def test_top_logprobs_are_the_sampled_distributions_best_tokens(hermes2):
    tok, eng = hermes2
    client = OpenAIClient(eng, tok, GREEDY)
    g = dict(temperature=0.7, max_tokens=6, logprobs=True, top_logprobs=3, presence_penalty=0.4)
    out = _chat(client, "hi", **g)
    rec = client.records[-1]
    with torch.inference_mode():
        logits = eng.model(torch.tensor([rec.prompt_ids + rec.output_ids])).logits[0, len(rec.prompt_ids) - 1 : -1]
    for i, entry in enumerate(out.choices[0].logprobs.content):
        seen = torch.tensor([float(x in rec.output_ids[:i]) for x in range(logits.shape[-1])])
        want = torch.log_softmax((logits[i].float() - 0.4 * seen) / 0.7, -1)
        vals, idx = want.topk(3)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([int(j)]) for j in idx]
        assert torch.allclose(torch.tensor([t.logprob for t in entry.top_logprobs]), vals, atol=1e-4)
        assert abs(entry.logprob - float(want[rec.output_ids[i]])) < 1e-4


def test_stream_is_token_by_token_and_ends_with_usage(hermes2):
    tok, eng = hermes2
    client = OpenAIClient(eng, tok, GREEDY)

    async def collect(**kw):
        stream = await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "hi"}], tools=[CALC], stream=True, **kw
        )
        return [c async for c in stream]

    chunks = asyncio.run(collect(stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert (
        "".join(deltas) == "hello there" and len(deltas) >= 5
    )  # one piece per token (a held-back space joins the next)
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(client.records[-1].output_ids)
    tool_chunks = asyncio.run(
        client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "12+7="}], tools=[CALC], stream=True
        )
    )
    got = asyncio.run(_all(tool_chunks))
    calls = [tc for c in got for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["calc"] and got[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in got)  # the call's text never leaks as content


async def _all(it):
    return [c async for c in it]


@pytest.mark.parametrize(
    "text, stops, parser, want",
    [
        ("hello wor", ["world"], None, "hello"),  # 'wor' may begin the stop string
        ("hello world and", ["world"], None, "hello"),
        ("sure <tool_", [], "hermes", "sure"),
        ('{"name": "f"', [], "llama3", ""),
        ("It is 19", [], "llama3", "It is 19"),
    ],
)
def test_safe_prefix_holds_back_what_may_not_be_content(text, stops, parser, want):
    assert safe_prefix(text, stops, parser) == want


# ---------------------------------------------------------------------- relayrl serve, through the openai SDK


@pytest.fixture(scope="module")
def served(hermes2, tmp_path_factory):
    """`relayrl serve` (a real process on 127.0.0.1) with the module's model and Hermes-template tokenizer."""
    from relayrl.inference.server.launcher import launch_servers

    tok, eng = hermes2
    d = tmp_path_factory.mktemp("hermes2")
    eng.model.save_pretrained(d)
    tok.save_pretrained(d)
    group = launch_servers(1, model=str(d), overrides=[f"model.vocab_size={len(tok)}"])
    yield openai.OpenAI(base_url=f"http://{group.addresses[0]}/v1", api_key="x", max_retries=0)
    group.shutdown()


def test_serve_chat_tools_tool_choice_and_tool_turns(served, hermes2):
    user = [{"role": "user", "content": "12+7="}]
    first = served.chat.completions.create(model="m", temperature=0, messages=user, tools=[CALC])
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "calc"
    assert json.loads(call.function.arguments) == {"expr": "12+7"} and first.choices[0].token_ids  # type: ignore[attr-defined]
    for choice in ("required", {"type": "function", "function": {"name": "calc"}}):
        out = served.chat.completions.create(model="m", temperature=0, messages=user, tools=[CALC], tool_choice=choice)
        assert [c.function.name for c in out.choices[0].message.tool_calls] == ["calc"]
    turns = [
        {"role": "developer", "content": [{"type": "text", "text": "Use the tool."}]},
        *user,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "19"},
    ]
    later = served.chat.completions.create(model="m", temperature=0, messages=turns, tools=[CALC], max_tokens=4)
    assert later.usage.completion_tokens == len(later.choices[0].token_ids) <= 4  # type: ignore[attr-defined]
    ok = served.chat.completions.create(
        model="m", temperature=0, messages=user, response_format={"type": "json_object"}, max_tokens=2
    )
    assert ok.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        served.chat.completions.create(model="m", temperature=0, messages=user, response_format={"type": "json_schema"})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        served.chat.completions.create(model="m", temperature=0, messages=user, tool_choice="required")
    assert e.value.body["param"] == "tool_choice" and "needs tools" in e.value.body["message"]


def test_serve_streams_token_by_token_with_usage_like_the_plain_reply(served):
    messages = [{"role": "user", "content": "hi"}]
    plain = served.chat.completions.create(model="m", temperature=0, messages=messages, tools=[CALC])
    pieces, finish, usage = [], None, None
    for chunk in served.chat.completions.create(
        model="m", temperature=0, messages=messages, tools=[CALC], stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        for c in chunk.choices:
            pieces += [c.delta.content] if c.delta.content else []
            finish = c.finish_reason or finish
    assert "".join(pieces) == plain.choices[0].message.content == "hello there" and len(pieces) >= 5
    assert finish == "stop" and usage.completion_tokens == plain.usage.completion_tokens
    text = "".join(
        c.choices[0].text
        for c in served.completions.create(model="m", prompt="12", max_tokens=6, temperature=0, stream=True)
        if c.choices
    )
    whole = served.completions.create(model="m", prompt="12", max_tokens=6, temperature=0)
    assert text == whole.choices[0].text and len(text) > 0


def test_serve_top_logprobs_and_penalties_match_the_model(served, hermes2):
    tok, eng = hermes2
    messages = [{"role": "user", "content": "hi"}]
    out = served.chat.completions.create(
        model="m",
        messages=messages,
        tools=[CALC],
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        frequency_penalty=1.5,
    )
    ids = encode(tok, render(tok, normalize_messages(messages), [CALC]))
    gen = out.choices[0].token_ids  # type: ignore[attr-defined]
    with torch.inference_mode():
        logits = eng.model(torch.tensor([ids + gen])).logits[0, len(ids) - 1 : -1].float()
    for i, entry in enumerate(out.choices[0].logprobs.content):
        counts = torch.bincount(torch.tensor(gen[:i], dtype=torch.long), minlength=logits.shape[-1]).float()
        want = torch.log_softmax(logits[i] - 1.5 * counts, -1)
        assert gen[i] == int(want.argmax())  # greedy under the penalty
        vals, idx = want.topk(2)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([int(j)]) for j in idx]
        assert torch.allclose(torch.tensor([t.logprob for t in entry.top_logprobs]), vals, atol=1e-4)
