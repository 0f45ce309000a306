"""The math reward (GSM8K recipe): final-answer extraction, the math-verify fallback, errors."""

import json
from pathlib import Path

import pytest

from relayrl.rewards.math import gsm8k_reward_fn, last_number, math_equal

ROWS = [json.loads(line) for line in (Path(__file__).parent / "data" / "gsm8k_sample.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("The answer is 72.", "72", True),
        ("so \\boxed{1,234} in total", "1234", True),  # thousands separator inside \boxed
        ("answer: 18.0", "18", True),
        ("3 + 4 = 7, so it is 7", "7", True),
        ("It is 7, not 8", "7", False),  # the last number is the answer
        ("-3 degrees", "-3", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),  # needs math-verify: LaTeX fraction vs decimal
        ("\\boxed{\\frac{1}{2}}", "\\frac{2}{4}", True),
        ("x = 3/4", "\\frac{3}{4}", True),
        ("x = 3/4", "\\frac{2}{3}", False),
        ("no answer here", "5", False),
        ("", "5", False),
    ],
)
def test_math_equal(completion, gold, expected):
    assert math_equal(completion, gold) is expected


def test_last_number():
    assert last_number("from 1,000 to 2,500.5 apples") == "2500.5"
    assert last_number("none") is None


def test_gsm8k_reward_reads_the_answer_after_the_marker():
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,200"
    assert gsm8k_reward_fn("q", "So the total is $1,200.", [], [], answer=solution) == 1.0
    assert gsm8k_reward_fn("q", "So the total is 1199.", [], [], answer=solution) == 0.0
    with pytest.raises(ValueError, match="row 7 has no 'answer'"):
        gsm8k_reward_fn("q", "12", [], [], answer="", id=7)


def test_gsm8k_rows_shipped_with_the_tests_score_their_own_answers():
    """Every shipped row's own final answer scores 1 and a wrong one 0 (the recipe's data)."""
    assert len(ROWS) >= 8
    for row in ROWS:
        gold = row["answer"].split("####")[-1].strip()
        wrong = str(int(gold.replace(",", "")) + 1)
        assert gsm8k_reward_fn(row["question"], f"The answer is {gold}", [], [], **row) == 1.0, row
        assert gsm8k_reward_fn(row["question"], f"The answer is {wrong}", [], [], **row) == 0.0, row
