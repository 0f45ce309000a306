"""``data.task=reasoning_gym:NAME``: reasoning-gym's generators as tasks and their own scorers as rewards,
on several generators, the config passed through, and a GRPO run on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

import reasoning_gym  # noqa: E402

from relayrl.api.config import ConfigError, RunConfig, load_config  # noqa: E402
from relayrl.data.tasks import make_task  # noqa: E402
from relayrl.rewards.reasoning_gym_scores import extract  # noqa: E402
from relayrl.rewards.registry import resolve_reward_fn  # noqa: E402

TASKS = ["basic_arithmetic", "countdown", "knights_knaves", "gsm_symbolic", "chain_sum"]


def score(name: str, row: dict, completion: str, **kwargs: object) -> float:
    fn = resolve_reward_fn("", f"reasoning_gym:{name}", kwargs)
    return fn(prompt="", completions=completion, prompt_ids=[], completion_ids=[], **row)


@pytest.mark.parametrize("name", TASKS)
def test_rows_are_the_generators_entries_and_score_with_its_own_scorer(name: str) -> None:
    train, held_out = make_task(f"reasoning_gym:{name}", 6, 4, seed=3)
    assert len(train) == 6 and 1 <= len(held_out) <= 4
    assert train[0]["id"] == f"reasoning_gym:{name}/train/0"
    # the rows are reasoning-gym's own entries at this seed, in order
    ds = reasoning_gym.create_dataset(name, seed=3, size=10)
    for i, row in enumerate(train):
        system, user = row["messages"]
        assert system["role"] == "system" and "<answer>" in system["content"]  # reasoning-gym's default prompt
        assert user == {"role": "user", "content": ds[i]["question"]} and row["answer"] == ds[i]["answer"]
    assert make_task(f"reasoning_gym:{name}", 6, 4, seed=3) == (train, held_out)  # deterministic by seed
    assert [r["answer"] for r in make_task(f"reasoning_gym:{name}", 6, 4, seed=4)[0]] != [r["answer"] for r in train]
    assert not {str(r["messages"]) for r in train} & {str(r["messages"]) for r in held_out}
    for row in train[:3]:
        right = f"Let me think.\n<answer>{row['answer']}</answer><eos>"
        assert score(name, row, right) == 1.0
        assert score(name, row, "<answer>I cannot tell 0</answer>") < 1.0
        # no tags: nothing extracted (answer_format=tags), scored as the generator scores no answer
        assert score(name, row, row["answer"]) == ds.score_answer(None, row["rg_entry"]) < 1.0
        # the scorer is the generator's own
        assert score(name, row, right) == ds.score_answer(row["answer"], row["rg_entry"])


def test_answer_formats() -> None:
    assert extract("a <answer>1</answer> b <answer> 2 </answer>", "tags") == "2"  # the last tags, stripped
    assert extract("no tags", "tags") is None
    assert extract(" 42 \nmore<eos>", "bare") == "42" and extract("<eos>", "bare") is None
    assert extract("work\n\n 7 \n<eos>junk\nx", "last_line") == "7"
    assert extract("3 + 8 = 11, so 11.<|im_end|>4", "last_number") == "11"
    assert extract("no number<|im_end|>", "last_number") is None
    with pytest.raises(ValueError, match="answer_format"):
        extract("x", "json")
    (row,), _ = make_task("reasoning_gym:basic_arithmetic", 1, 1, seed=0, system_prompt="")
    assert [m["role"] for m in row["messages"]] == ["user"]  # no system prompt
    assert score("basic_arithmetic", row, f"{row['answer']}\n", answer_format="bare") == 1.0
    assert score("basic_arithmetic", row, f"steps\n{row['answer']}", answer_format="last_line") == 1.0
    assert score("basic_arithmetic", row, f"It is {row['answer']}.", answer_format="last_number") == 1.0


def test_task_kwargs_reach_the_generator_and_bad_ones_name_the_field() -> None:
    train, _ = make_task("reasoning_gym:basic_arithmetic", 8, 1, seed=0, min_terms=3, max_terms=3, max_digits=1)
    assert all(r["rg_entry"]["metadata"]["num_terms"] == 3 for r in train)
    assert all(r["rg_config"] == {"min_terms": 3, "max_terms": 3, "max_digits": 1} for r in train)
    with pytest.raises(ConfigError, match=r"data.task_kwargs for reasoning_gym:basic_arithmetic.*no_such_field"):
        make_task("reasoning_gym:basic_arithmetic", 2, 1, no_such_field=1)
    with pytest.raises(ConfigError, match=r"no generator 'basic_arithmetc'; did you mean 'basic_arithmetic'"):
        make_task("reasoning_gym:basic_arithmetc", 2, 1)


def test_the_recipe_runs_two_grpo_steps_on_the_tiny_model(tmp_path: Path) -> None:
    """recipes/reasoning_gym.yaml names a real model (SmolLM2); with model.path=tiny its whole pipeline
    (generator rows, chat prompts, score_answer reward, GRPO) runs 2 steps."""
    from relayrl.data.models import build_tokenizer
    from relayrl.trainer import train
    from relayrl.wiring import load_rows, reward_fn_for

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "reasoning_gym.yaml"
    shipped = load_config(RunConfig, recipe, [])
    assert shipped.model.path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (
        shipped.data.task == "reasoning_gym:basic_arithmetic" and shipped.data.task_kwargs["system_prompt"] == "direct"
    )
    overrides = [
        f"run_dir={tmp_path / 'run'}",
        "model.path=tiny",
        "model.dtype=float32",
        "data.n_train=16",
        "data.n_eval=4",
        "rollout.batch_size=2",
        "rollout.group_size=2",
        "gconfig.max_new_tokens=4",
        "eval.gconfig.max_new_tokens=4",
        "eval.before_training=false",
        "total_steps=2",
        "logging.tensorboard=false",
        "logging.progress=off",
        "checkpoint.save_final=false",
    ]
    cfg = load_config(RunConfig, recipe, overrides)
    rows, _ = load_rows(cfg, build_tokenizer())
    assert len(rows) == 16 and rows[0]["messages"][-1] == {"role": "user", "content": rows[0]["rg_entry"]["question"]}
    fn = reward_fn_for(cfg)
    right = f"<answer>{rows[0]['answer']}</answer><eos>"
    assert fn(prompt="", completions=right, prompt_ids=[], completion_ids=[], **rows[0]) == 1.0
    last = train(cfg)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and last["version"] == 2.0


def test_the_reward_runs_in_reward_worker_processes() -> None:
    """The rows carry what the scorer needs, so the reward runs in a RewardPool (rollout.reward_workers)."""
    import asyncio

    from relayrl.rewards.pool import RewardPool

    (row, *_), _ = make_task("reasoning_gym:knights_knaves", 2, 1, seed=5)
    fn = resolve_reward_fn("", "reasoning_gym:knights_knaves", {})
    with RewardPool(fn, n_workers=1, timeout=60.0) as pool:

        async def both() -> list[float]:
            common = {"prompt": "", "prompt_ids": [], "completion_ids": [], **row}
            right = pool.acall(completions=f"<answer>{row['answer']}</answer>", **common)
            return list(await asyncio.gather(right, pool.acall(completions="<answer>no</answer>", **common)))

        assert asyncio.run(both()) == [1.0, 0.0]


def test_eval_questions_are_new_ones_and_none_left_is_an_error() -> None:
    """A generator with 200 distinct questions (one-digit a + b or a - b): eval takes the next questions
    seen neither in train nor before in eval, as many as asked; when train covers them all, start-up
    stops naming the fix. Before: eval kept only those of the stream's next n_eval entries not in
    train, fewer than asked, and with n_train=2000 none: the run had no evaluation and said nothing."""
    small = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]}
    small |= {"allow_parentheses": False, "allow_negation": False}
    train, held_out = make_task("reasoning_gym:basic_arithmetic", 100, 50, seed=1, **small)
    questions = [r["messages"][-1]["content"] for r in held_out]
    assert len(held_out) == 50 and len(set(questions)) == 50
    assert not set(questions) & {r["messages"][-1]["content"] for r in train}
    with pytest.raises(ConfigError, match=r"no eval question .* lower data.n_train or widen data.task_kwargs"):
        make_task("reasoning_gym:basic_arithmetic", 2000, 50, seed=1, **small)
