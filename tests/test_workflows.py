"""Workflows against a real LocalEngine with the tiny model: rewards, masks and tokens."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.api.workflow import validate_trajectory
from relayrl.data.models import chat_ids
from relayrl.inference.local import LocalEngine
from relayrl.rollout.judge import GenerativeJudge
from relayrl.rollout.tools import calculator
from relayrl.rollout.workflows import MultiTurnWorkflow, ReMaxWorkflow, RLVRWorkflow, ToolAgentWorkflow

G = GenerationConfig(max_new_tokens=8, top_k=0, top_p=1.0)
ROW = {"id": 0, "messages": [{"role": "user", "content": "12+7="}], "answer": "19"}


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    eng = LocalEngine(InferenceConfig(max_batch_size=32, seed=3), model=tiny_model, tokenizer=tokenizer)
    eng.initialize()
    yield eng
    eng.destroy()


def digit_reward(prompt, completions, prompt_ids, completion_ids, **data):
    """A deterministic reward of the completion text: share of digit characters."""
    return sum(c.isdigit() for c in completions) / max(1, len(completions))


def segments(mask):
    """(start, end, value) runs of a 0/1 list."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def test_rlvr_reward_and_truncation(engine, tokenizer):
    wf = RLVRWorkflow(digit_reward, G.new(ignore_eos=True, max_new_tokens=5), tokenizer)
    traj = asyncio.run(wf.arun_episode(engine, ROW))
    validate_trajectory(traj)
    prompt = chat_ids(tokenizer, ROW["messages"])
    ids = traj["input_ids"][0].tolist()
    assert ids[: len(prompt)] == prompt and len(ids) == len(prompt) + 5
    assert bool(traj["truncated"][0])
    expected = digit_reward("", tokenizer.decode(ids[len(prompt) :]), prompt, ids[len(prompt) :])
    assert traj["rewards"][0].item() == pytest.approx(expected)


def test_remax_baseline_is_greedy_reward(engine, tokenizer):
    wf = ReMaxWorkflow(digit_reward, G, tokenizer)
    traj = asyncio.run(wf.arun_episode(engine, ROW))
    validate_trajectory(traj)
    prompt = chat_ids(tokenizer, ROW["messages"])
    greedy = asyncio.run(engine.agenerate(ModelRequest(rid="g", input_ids=prompt, gconfig=G.new(greedy=True))))
    assert traj["baseline_rewards"][0].item() == pytest.approx(
        digit_reward("", tokenizer.decode(greedy.output_tokens), prompt, greedy.output_tokens)
    )
    sampled = traj["input_ids"][0, len(prompt) :].tolist()
    assert traj["rewards"][0].item() == pytest.approx(digit_reward("", tokenizer.decode(sampled), prompt, sampled))


def test_multi_turn_feedback_masked_and_discounted(engine, tokenizer):
    calls = []

    def second_time_right(prompt, completions, prompt_ids, completion_ids, **data):
        calls.append(completion_ids)
        return 1.0 if len(calls) == 2 else 0.0

    wf = MultiTurnWorkflow(second_time_right, G, tokenizer, max_turns=3, turn_discount=0.5)
    traj = asyncio.run(wf.arun_episode(engine, ROW))
    validate_trajectory(traj)
    assert traj["num_turns"].item() == 2 and traj["rewards"].item() == pytest.approx(0.5)
    ids, mask = traj["input_ids"][0].tolist(), traj["loss_mask"][0].int().tolist()
    runs = segments(mask)
    assert [v for *_, v in runs] == [0, 1, 0, 1]
    (p0, p1, _), (g0, g1, _), (f0, f1, _), (h0, h1, _) = runs
    assert ids[p0:p1] == chat_ids(tokenizer, ROW["messages"])
    assert ids[g0:g1] == calls[0] and ids[h0:h1] == calls[1]  # generated tokens kept as generated
    assert ids[f0:f1] == wf.feedback_ids(ROW["messages"], calls[0])
    assert (traj["versions"][0, f0:f1] == -1).all() and (traj["logprobs"][0, f0:f1] == 0).all()


def test_tool_outputs_masked_tokens_concatenated(engine, tokenizer):
    # The tiny model is random: pick call markers from its own greedy output so that it
    # really emits a tool call (start token, some text, end token).
    greedy = G.new(greedy=True, max_new_tokens=24)
    prompt = None
    for q in ("12+7=", "3*4=", "hello", "99-1=", "abc", "x"):
        row = {"id": q, "messages": [{"role": "user", "content": q}], "answer": "1"}
        ids = chat_ids(tokenizer, row["messages"])
        out = asyncio.run(engine.agenerate(ModelRequest(rid=q, input_ids=ids, gconfig=greedy))).output_tokens
        texts = [tokenizer.decode([t]) for t in out]
        ends = [j for j in range(2, len(out)) if texts[j] not in texts[:j] and len(texts[j]) == 1]
        if len(texts[0]) == 1 and ends:
            prompt, start_tok, end_tok = row, texts[0], texts[ends[0]]
            break
    assert prompt is not None, "the tiny model's greedy output has no usable markers"
    tool = calculator(timeout=60.0)  # the child starts within it however loaded the machine
    wf = ToolAgentWorkflow(
        digit_reward, greedy, tokenizer, tool=tool, max_tool_calls=2, call_start=start_tok, call_end=end_tok
    )
    traj = asyncio.run(wf.arun_episode(engine, prompt))
    validate_trajectory(traj)
    n_calls = traj["num_tool_calls"].item()
    assert n_calls >= 1
    ids, mask = traj["input_ids"][0].tolist(), traj["loss_mask"][0].int().tolist()
    runs = segments(mask)
    assert [v for *_, v in runs][:3] == [0, 1, 0] and sum(1 for *_, v in runs if v == 0) == 1 + n_calls
    start_id, end_id = wf.call_start_id, wf.call_end_id
    for (g0, g1, _), (t0, t1, _) in zip(runs[1::2], runs[2::2], strict=False):
        gen = ids[g0:g1]
        assert gen[-1] == end_id and start_id in gen
        s = len(gen) - 1 - gen[::-1].index(start_id)
        expected = asyncio.run(tool(tokenizer.decode(gen[s + 1 : -1])))
        assert ids[t0:t1] == wf.result_ids(expected)  # tool tokens = encoded tool result
        assert (traj["logprobs"][0, t0:t1] == 0).all() and (traj["versions"][0, t0:t1] == -1).all()
        assert (traj["versions"][0, g0:g1] >= 0).all() and (traj["logprobs"][0, g0:g1] <= 0).all()


def test_generative_judge_grades_with_engine(engine, tokenizer):
    judge = GenerativeJudge(
        None, tokenizer, template="Q {question} A {answer} R {reference}", parse_fn=lambda text: len(text) / 100
    )
    score = asyncio.run(judge(engine, prompt="p", completions="19", **ROW))
    ids = chat_ids(tokenizer, [{"role": "user", "content": "Q 12+7= A 19 R 19"}])
    resp = asyncio.run(engine.agenerate(ModelRequest(rid="j", input_ids=ids, gconfig=judge.gconfig)))
    assert score == pytest.approx(len(tokenizer.decode(resp.output_tokens, skip_special_tokens=True)) / 100)
    # usable as an RLVR reward fn: the episode's reward is the judge's grade of its completion
    traj = asyncio.run(RLVRWorkflow(judge, G, tokenizer).arun_episode(engine, ROW))
    assert traj["rewards"].item() == pytest.approx(judge.parse_fn(judge.last_reply))
    with pytest.raises(ValueError, match="no engine"):
        asyncio.run(judge.grade(None, "q", "a"))


def test_hung_reward_calls_never_starve_the_reward_threads():
    """More calls hang than there are reward threads; each times out, its thread is replaced,
    and a well-behaved call still answers at once."""
    import threading

    from relayrl.rollout.workflows.rlvr import _in_thread

    release = threading.Event()

    def hang(**_):
        release.wait()
        return 0.0

    async def go():
        hung = await asyncio.gather(*(_in_thread(hang, {}, 0.2) for _ in range(6)), return_exceptions=True)
        return hung, await _in_thread(lambda x: x + 1.0, {"x": 1.0}, 5.0)  # starved threads would time out

    try:
        hung, value = asyncio.run(go())
    finally:
        release.set()
    assert all(isinstance(h, TimeoutError) and "did not return within 0.2s" in str(h) for h in hung)
    assert value == 2.0
