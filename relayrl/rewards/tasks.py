"""Verifiers of the synthetic tasks in ``relayrl.data.tasks`` (reward fns: ``relayrl.api.workflow.RewardFn``).

Completion format, shared by all tasks: the completion *is* the answer, optionally
followed by an end-of-sequence marker. The text is cut at the first newline or special
token (``<eos>``, ``</s>``, ``<pad>``, ``<|...|>``) and stripped of surrounding spaces;
what remains is the answer.

Rewards: 1.0 for a correct answer, ``format_reward`` (default 0.0) for a well-formed but
wrong answer (an integer for arithmetic, an expression over the right numbers for
countdown, space-separated integers for count), 0.0 for anything else.
``task_reward_fn(name, format_reward)`` returns a picklable reward fn, so it can run in a
``RewardPool`` worker.
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relayrl.api.workflow import RewardFn

_END = re.compile(r"<eos>|</s>|<pad>|<\|[^|<>]*\|>|\n")
_INT = re.compile(r"-?\d+")
_EXPR_CHARS = re.compile(r"[\d+\-*() ]+")
_NUMBERS = re.compile(r"\d+( +\d+)*")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def completion_answer(text: str) -> str:
    """The answer part of a completion: text before the first newline/special token, stripped."""
    return _END.split(text, maxsplit=1)[0].strip()


def arithmetic_reward_fn(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    format_reward: float = 0.0,
    **data: object,
) -> float:
    """1.0 if the completion is exactly the integer ``answer`` ("81", "81<eos>", " 81 \\n...")."""
    got = completion_answer(completions)
    if _INT.fullmatch(got) is None:
        return 0.0
    return 1.0 if int(got) == int(answer) else float(format_reward)


def _eval_expr(node: ast.AST, used: list[int]) -> int:
    """Evaluate +, -, * over integer literals, recording the literals; ValueError otherwise."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_expr(node.left, used), _eval_expr(node.right, used))
    raise ValueError(f"unsupported expression element {ast.dump(node)[:40]}")


def evaluate_countdown(expr: str, numbers: list[int]) -> int | None:
    """Value of ``expr`` if it is a +,-,* expression using exactly ``numbers`` (as a multiset), else None."""
    if len(expr) > 200 or _EXPR_CHARS.fullmatch(expr) is None:
        return None
    try:
        tree = ast.parse(expr, mode="eval")
        used: list[int] = []
        value = _eval_expr(tree.body, used)
    except (SyntaxError, ValueError, RecursionError):
        return None
    return value if Counter(used) == Counter(int(n) for n in numbers) else None


def countdown_reward_fn(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    numbers: list[int],
    target: int,
    format_reward: float = 0.0,
    **data: object,
) -> float:
    """1.0 if the completion is an expression using each of ``numbers`` once that equals ``target``."""
    value = evaluate_countdown(completion_answer(completions), numbers)
    if value is None:
        return 0.0
    return 1.0 if value == int(target) else float(format_reward)


def count_reward_fn(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str,
    format_reward: float = 0.0,
    **data: object,
) -> float:
    """1.0 if the completion is exactly the numbers of ``answer`` ("123 124 125"), space-separated
    (runs of spaces count as one); nothing skipped, repeated or added, no early or late stop."""
    got = completion_answer(completions)
    if _NUMBERS.fullmatch(got) is None:
        return 0.0
    return 1.0 if got.split() == str(answer).split() else float(format_reward)


TASK_REWARDS: dict[str, RewardFn] = {
    "arithmetic": arithmetic_reward_fn,
    "countdown": countdown_reward_fn,
    "count": count_reward_fn,
    "count_squares": arithmetic_reward_fn,  # the answer is an integer
}


def task_reward_fn(name: str, format_reward: float = 0.0) -> RewardFn:
    """The verifier of synthetic task ``name``; picklable (a module function or a partial of one)."""
    if name not in TASK_REWARDS:
        raise ValueError(f"unknown synthetic task {name!r}; choose one of {sorted(TASK_REWARDS)}")
    fn = TASK_REWARDS[name]
    return functools.partial(fn, format_reward=format_reward) if format_reward else fn
