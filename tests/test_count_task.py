"""The ``count`` synthetic task and its verifier: rows checked against an independent reading of
the prompt, the long-tailed length distribution, exact demonstration error rates, no problem in
both splits, and the config / SFT wiring."""

from __future__ import annotations

import re
import statistics

import pytest

from relayrl.data.models import build_tokenizer
from relayrl.data.tasks import demonstrations, make_task
from relayrl.rewards.tasks import task_reward_fn

PROMPT = re.compile(r"Count to (\d+) from (\d+):")


def reward(completion: str, row: dict, format_reward: float = 0.0) -> float:
    fn = task_reward_fn("count", format_reward)
    return fn(prompt="", completions=completion, prompt_ids=[], completion_ids=[], **row)


def reference(prompt: str) -> str:
    """The expected completion, read from the prompt text alone."""
    end, start = (int(x) for x in PROMPT.fullmatch(prompt).groups())  # type: ignore[union-attr]
    out, n = "", start
    while n <= end:
        out += ("" if not out else " ") + str(n)
        n += 1
    return out


def test_rows_follow_the_contract_and_match_an_independent_reference() -> None:
    train, held_out = make_task("count", 500, 100, 2, seed=3)
    assert (len(train), len(held_out)) == (500, 100)
    assert train[0]["id"] == "count/train/0" and held_out[-1]["id"] == "count/eval/99"
    tok = build_tokenizer()
    for row in train + held_out:
        (turn,) = row["messages"]
        assert turn["role"] == "user" and row["task"] == "count"
        assert row["answer"] == reference(turn["content"])
        assert (
            10000 <= row["start"] <= row["end"] <= 99999 and row["end"] % 100 == 0
        )  # 5 digits, up to the next hundred
        assert row["end"] - row["start"] < 100
        n = row["end"] - row["start"] + 1
        # a completion is 6 tokens per number with EOS (5 digits + space / EOS)
        assert len(tok(row["answer"] + "<eos>")["input_ids"]) == 6 * n
    assert make_task("count", 500, 100, 2, seed=3) == (train, held_out)  # deterministic
    assert make_task("count", 500, 100, 2, seed=4)[0] != train


def test_no_problem_appears_in_both_splits_or_twice() -> None:
    train, held_out = make_task("count", 2000, 200, 2, seed=1)
    keys = [(r["start"], r["end"]) for r in train + held_out]
    assert len(set(keys)) == len(keys) == 2200
    assert not {r["messages"][0]["content"] for r in train} & {r["messages"][0]["content"] for r in held_out}


def test_lengths_are_long_tailed() -> None:
    train, _ = make_task("count", 2000, 200, 2, seed=1)
    n = sorted(r["end"] - r["start"] + 1 for r in train)
    assert min(n) == 1 and max(n) == 30  # clamped to [1, 15 * difficulty]
    median, p90 = statistics.median(n), n[int(0.9 * len(n))]
    assert 5 <= median <= 7  # log-normal, median 3 * difficulty
    assert p90 >= 2.3 * median and statistics.mean(n) > 1.2 * median  # the right tail
    longer = make_task("count", 2000, 0, 4, seed=1)[0]
    assert statistics.median(r["end"] - r["start"] + 1 for r in longer) >= 11


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("10098 10099 10100", 1.0),
        ("10098 10099 10100<eos>", 1.0),
        (" 10098  10099 10100 \n10101", 1.0),  # runs of spaces count as one; the text after a newline is ignored
        ("10098 10099 10100<|user|>anything", 1.0),
        ("10098 10100", 0.5),  # skipped
        ("10098 10099 10099 10100", 0.5),  # repeated
        ("10098 10099", 0.5),  # early stop
        ("10098 10099 10100 10101", 0.5),  # late stop
        ("10098,10099,10100", 0.0),  # not space-separated numbers
        ("10098 10099 10100.", 0.0),
        ("", 0.0),
        ("one two three", 0.0),
    ],
)
def test_verifier(completion: str, expected: float) -> None:
    row = {"answer": "10098 10099 10100", "start": 10098, "end": 10100, "task": "count"}
    assert reward(completion, row, format_reward=0.5) == expected
    assert reward(completion, row) == (1.0 if expected == 1.0 else 0.0)


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0])
def test_demonstrations_are_wrong_at_exactly_the_error_rate(error_rate: float) -> None:
    train, _ = make_task("count", 400, 10, 2, seed=2)
    demos = demonstrations(train, error_rate, seed=2)
    assert sum(not d["correct"] for d in demos) == round(error_rate * 400)
    for row, d in zip(train, demos, strict=True):
        assert d["id"] == row["id"] and d["answer"] == row["answer"]
        # the verifier agrees with the label; a wrong one is still a well-formed count
        assert reward(d["completion"], row, format_reward=0.5) == (1.0 if d["correct"] else 0.5)
        nums = [int(x) for x in d["completion"].split()]
        assert all(10000 <= x <= 99999 for x in nums)
    assert demonstrations(train, error_rate, seed=2) == demos


def test_demonstration_errors_are_the_documented_kinds() -> None:
    train, _ = make_task("count", 600, 10, 2, seed=5)
    kinds = set()
    for row, d in zip(train, demonstrations(train, 1.0, seed=5), strict=True):
        want = list(range(row["start"], row["end"] + 1))
        got = [int(x) for x in d["completion"].split()]
        if len(got) == len(want) - 1 and got[0] == want[0] and got[-1] == want[-1] and set(got) < set(want):
            kinds.add("skip")
        elif len(got) == len(want) + 1 and sorted(set(got)) == want:
            kinds.add("repeat")
        elif got == want[: len(got)] and 1 <= len(want) - len(got) <= 3:
            kinds.add("early")
        elif got[: len(want)] == want and 1 <= len(got) - len(want) <= 3:
            kinds.add("late")
        else:
            raise AssertionError(f"{row['answer']!r} -> {d['completion']!r} is none of the documented errors")
    assert kinds == {"skip", "repeat", "early", "late"}


def test_config_and_sft_wiring() -> None:
    from relayrl.api.commands import SFTConfig
    from relayrl.api.config import RunConfig, load_config
    from relayrl.sft import sft_rows
    from relayrl.wiring import load_rows, reward_fn_for

    cfg = load_config(RunConfig, None, ["data.task=count", "data.n_train=30", "data.n_eval=5"])
    train, held_out = load_rows(cfg, build_tokenizer())
    assert (len(train), len(held_out)) == (30, 5) and train[0]["task"] == "count"
    assert (
        reward_fn_for(cfg)(prompt="", completions=train[0]["answer"], prompt_ids=[], completion_ids=[], **train[0])
        == 1.0
    )
    sft = load_config(SFTConfig, None, ["data.task=count", "data.n_train=20", "data.n_eval=4", "data.error_rate=0.25"])
    demos, held_out = sft_rows(sft.data, sft.seed)
    assert len(demos) == 20 and sum(not d["correct"] for d in demos) == 5 and len(held_out) == 4


def test_a_saved_offline_tokenizer_loads_back_with_its_spaces(tmp_path) -> None:  # noqa: ANN001
    """A checkpoint saved with the offline tokenizer (e.g. by SFT) is loaded by path for RL:
    AutoTokenizer would pick Qwen2Tokenizer from config.json and drop every space."""
    from transformers import AutoConfig

    from relayrl.api.config import ModelConfig
    from relayrl.data.models import chat_ids, load_tokenizer

    AutoConfig.for_model("qwen2", vocab_size=100).save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    loaded, built = load_tokenizer(ModelConfig(path=str(tmp_path))), build_tokenizer()
    messages = [{"role": "user", "content": "Count to 10100 from 10098:"}]
    assert chat_ids(loaded, messages) == chat_ids(built, messages)
    text = "10098 10099 10100<eos>"
    assert loaded(text)["input_ids"] == built(text)["input_ids"] and loaded.decode(built(text)["input_ids"]) == text
    assert (loaded.eos_token_id, loaded.pad_token_id) == (built.eos_token_id, built.pad_token_id)
