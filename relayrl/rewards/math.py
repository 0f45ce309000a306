"""Math answer rewards: plain numbers fast, everything else through ``math-verify``.

``gsm8k_reward_fn`` has the reward-function signature (``relayrl.api.workflow.RewardFn``: prompt, completions, prompt_ids,
completion_ids, **data) and reads the reference from ``data["answer"]`` (a GSM8K solution's
text after ``####``, or a bare answer).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (commas allowed), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def math_equal(completion: str, gold: str) -> bool:
    """Whether the completion's final answer equals ``gold``.

    Fast path: the completion's ``\\boxed{}`` content or last number equals a numeric
    ``gold``. Otherwise ``math_verify.parse`` + ``verify`` decide (fractions,
    LaTeX, sets, ...).
    """
    gold_num = _as_number(gold)
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", completion)
    candidate = boxed[-1] if boxed else last_number(completion)
    if gold_num is not None and candidate is not None:
        value = _as_number(candidate)
        if value is not None and abs(value - gold_num) <= 1e-6 * max(1.0, abs(gold_num)):
            return True
    from math_verify import parse, verify

    try:
        return bool(verify(parse(f"${gold}$"), parse(completion)))
    except Exception:  # noqa: BLE001 - math-verify raises many parser errors on junk text
        return False


def gsm8k_reward_fn(
    prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], answer: str = "", **data: object
) -> float:
    """1.0 when the completion's final answer matches ``answer``, else 0.0."""
    gold = str(answer).split("####")[-1].strip().replace(",", "")
    if not gold:
        raise ValueError(f"gsm8k_reward_fn: row {data.get('id', '?')!r} has no 'answer'")
    return 1.0 if math_equal(completions, gold) else 0.0
