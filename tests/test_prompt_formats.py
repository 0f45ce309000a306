"""Prompts on real-style chat templates (ours, in the Qwen2.5 / Llama-3.1 formats) and plain prompts for base models."""

from __future__ import annotations

import asyncio
import logging

import pytest

from relayrl.agents.templates import tool_tokenizer
from relayrl.api.config import InferenceConfig, RunConfig, load_config
from relayrl.api.io import GenerationConfig
from relayrl.api.workflow import validate_trajectory
from relayrl.data.chat import encode
from relayrl.data.models import build_tokenizer
from relayrl.inference.local import LocalEngine
from relayrl.rollout.workflows import MultiTurnWorkflow, RLVRWorkflow, ToolAgentWorkflow
from tests.agent_models import small_model

G = GenerationConfig(max_new_tokens=6, top_k=0)
ROW = {"id": 0, "messages": [{"role": "user", "content": "12+7="}], "answer": "19"}


def never_right(prompt, completions, prompt_ids, completion_ids, **data):
    return 0.0


def run(tok, wf, row=ROW):
    model = small_model(len(tok), int(tok.eos_token_id))
    eng = LocalEngine(InferenceConfig(seed=2), model=model.eval(), tokenizer=tok)
    eng.initialize()
    try:
        return asyncio.run(wf.arun_episode(eng, row))
    finally:
        eng.destroy()


@pytest.mark.parametrize("style", ["hermes", "llama3"])
def test_multi_turn_appends_only_the_new_turn(style):
    """Fails on the old workflow: it rendered the feedback turn with the whole template, putting
    the system prompt (Qwen) and BOS + system header (Llama) in the middle of the episode."""
    tok = tool_tokenizer(style, default_system="You are Qwen.")
    traj = run(tok, MultiTurnWorkflow(never_right, G, tok, max_turns=3, feedback="Wrong."))
    validate_trajectory(traj)
    text = tok.decode(traj["input_ids"][0].tolist())
    assert traj["num_turns"].item() == 3
    feedback_turn = {
        "hermes": "<|im_start|>user\nWrong.<|im_end|>\n<|im_start|>assistant\n",
        "llama3": "<|start_header_id|>user<|end_header_id|>\n\nWrong.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    }[style]
    assert text.count(feedback_turn) == 2
    if style == "hermes":
        assert text.count("You are Qwen.") == 1 and text.count("<|im_start|>system") == 1
    else:
        assert text.count("<|begin_of_text|>") == 1 and text.count("<|start_header_id|>system") == 1
    # every masked run after the prompt decodes to (end-of-turn if missing) + exactly the feedback turn
    mask = traj["loss_mask"][0].int().tolist()
    ids = traj["input_ids"][0].tolist()
    starts = [i for i in range(1, len(mask)) if mask[i] == 0 and mask[i - 1] == 1]
    for s in starts:
        e = next((j for j in range(s, len(mask)) if mask[j] == 1), len(mask))
        assert tok.decode(ids[s:e]).removeprefix(tok.eos_token).lstrip("\n") == feedback_turn


def test_plain_prompts_for_base_models(caplog):
    """Fails on the old code: every episode raised 'tokenizer.chat_template is not set'."""
    tok = build_tokenizer()
    tok.chat_template = None
    with caplog.at_level(logging.WARNING):
        traj = run(tok, RLVRWorkflow(never_right, G, tok))
    validate_trajectory(traj)
    n = len(encode(tok, "12+7=", special=True))
    assert traj["input_ids"][0, :n].tolist() == encode(tok, "12+7=", special=True)
    assert int(traj["loss_mask"][0, :n].sum()) == 0 and bool(traj["loss_mask"][0, n:].all())
    assert "no chat template" in caplog.text
    # asked for explicitly, plain wins over a template; multi-turn feedback is then a plain line
    tok2 = build_tokenizer()
    traj = run(tok2, MultiTurnWorkflow(never_right, G, tok2, max_turns=2, feedback="Wrong.", prompt_format="plain"))
    text = tok2.decode(traj["input_ids"][0].tolist())
    assert text.startswith("12+7=") and "<|user|>" not in text and "\nWrong.\n" in text
    with pytest.raises(ValueError, match="prompt_format must be one of"):
        asyncio.run(RLVRWorkflow(never_right, G, tok2, prompt_format="raw").arun_episode(None, ROW))


def test_tool_agent_markers_of_several_tokens():
    """Fails on the old code: markers had to be single tokens (Qwen / Llama tokenizers have no <|call|>)."""
    tok = tool_tokenizer("hermes")
    wf = ToolAgentWorkflow(never_right, G, tok, call_start="CALL:", call_end=";;")
    assert wf.call_start_id is None and wf.call_end_id is None
    assert wf._call_text(encode(tok, "let me CALL:12+7;;")) == (True, "12+7")
    assert wf._call_text(encode(tok, "no call here;;")) == (True, None)
    assert wf._call_text(encode(tok, "CALL:1+1;; and more")) == (False, None)
    traj = run(tok, wf)  # a random model: whatever it writes, the episode is well formed
    validate_trajectory(traj)


def test_workflow_settings_are_config_fields():
    from relayrl import wiring

    cfg = load_config(
        RunConfig,
        None,
        ["workflow=multi_turn", "rollout.max_turns=4", "rollout.turn_discount=0.5", "data.prompt_format=plain"],
    )
    wf = wiring.make_workflow(cfg, build_tokenizer(), never_right)
    assert (wf.max_turns, wf.turn_discount, wf.prompt_format) == (4, 0.5, "plain")
    over = ["workflow=tool_agent", "rollout.max_tool_calls=1", "rollout.tool=python", "rollout.tool_timeout=7.5"]
    wf = wiring.make_workflow(load_config(RunConfig, None, over), build_tokenizer(), never_right)
    assert wf.max_tool_calls == 1 and (wf.tool.mode, wf.tool.timeout) == ("python", 7.5)
    with pytest.raises(Exception, match="data.prompt_format"):
        load_config(RunConfig, None, ["data.prompt_format=raw"])


def test_templates_that_rewrite_history_start_a_new_sequence():
    """A template that drops earlier turns' reasoning (as Qwen3's does) is not prefix-stable: the
    continuation is refused (the client then starts a new row) rather than silently misaligned."""
    from relayrl.data.chat import continuation_ids, user_turn_ids

    tok = build_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>"
        "{% if loop.last %}{{ m['content'] }}{% else %}{{ m['content'].split('</think>')[-1] }}{% endif %}<eos>"
        "{% else %}<|user|>{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    history = [{"role": "user", "content": "1+1="}]
    plain = continuation_ids(
        tok, history, {"role": "assistant", "content": "2"}, [{"role": "user", "content": "ok"}], int(tok.eos_token_id)
    )
    assert tok.decode(plain) == "<|user|>ok<|assistant|>"
    thinking = {"role": "assistant", "content": "<think>so</think>2"}
    assert continuation_ids(tok, history, thinking, [{"role": "user", "content": "ok"}], int(tok.eos_token_id)) is None
    with pytest.raises(ValueError, match="not prefix-stable"):
        user_turn_ids(tok, history, encode(tok, "<think>so</think>2<eos>"), "ok")
