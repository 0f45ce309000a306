"""The reward of ``data.task=reasoning_gym:NAME`` rows: the generator's own ``score_answer``.

``reasoning_gym_reward_fn`` (registered as reward ``reasoning_gym``, the default for such tasks)
extracts the answer from the completion, then calls ``score_answer(answer, entry)`` of the same
generator with the same config that made the row (``rg_dataset``, ``rg_config``, ``rg_entry``),
so a completion scores what reasoning-gym's own evaluation gives it: 1.0 for a right answer,
partial credit where the generator gives it, 0.0 otherwise.

Where the answer is (``reward_kwargs.answer_format``; when to use which: docs/environments.md):
``tags`` (default) the last ``<answer>...</answer>`` (reasoning-gym's ``extract_answer``; no tags
scores 0), ``bare`` the completion up to its first newline or special token, ``last_line`` its last
non-empty line and ``last_number`` its last number (both before any special token).

A module-level function of plain arguments: picklable, so it runs in reward workers too.
"""

from __future__ import annotations

import re

from relayrl.rewards.math import last_number
from relayrl.rewards.tasks import completion_answer

ANSWER_FORMATS = ("tags", "bare", "last_line", "last_number")
_SPECIAL = re.compile(r"<eos>|</s>|<pad>|<\|[^|<>]*\|>")


def extract(completion: str, answer_format: str = "tags") -> str | None:
    """The answer part of ``completion`` (module doc); None when there is none."""
    if answer_format == "tags":
        from reasoning_gym.utils import extract_answer

        return extract_answer(completion)
    if answer_format == "bare":
        return completion_answer(completion) or None
    if answer_format == "last_line":
        lines = [ln.strip() for ln in _SPECIAL.split(completion, maxsplit=1)[0].splitlines() if ln.strip()]
        return lines[-1] if lines else None
    if answer_format == "last_number":
        return last_number(_SPECIAL.split(completion, maxsplit=1)[0])
    raise ValueError(f"reward_kwargs.answer_format must be one of {list(ANSWER_FORMATS)}, got {answer_format!r}")


def reasoning_gym_reward_fn(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    rg_dataset: str,
    rg_entry: dict[str, object],
    rg_config: dict[str, object] | None = None,
    answer_format: str = "tags",
    **data: object,
) -> float:
    """``score_answer(extract(completions), rg_entry)`` of generator ``rg_dataset`` built with ``rg_config``."""
    from relayrl.data.reasoning_gym_tasks import make_dataset

    answer = extract(completions, answer_format)
    dataset = make_dataset(rg_dataset, dict(rg_config or {}))
    return float(dataset.score_answer(answer, rg_entry))
