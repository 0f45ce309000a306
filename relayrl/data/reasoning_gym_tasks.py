"""``data.task=reasoning_gym:NAME``: the procedural generators of the ``reasoning-gym`` package as tasks.

Each of reasoning-gym's generators (``basic_arithmetic``, ``countdown``, ``knights_knaves``,
``gsm_symbolic``, ... 106 in 0.1.25) makes ``{"question", "answer", "metadata"}`` entries from a seed
and scores an answer with its own ``score_answer(answer, entry)``. This module turns them into rows
of the task contract (``id``, ``messages``, ``answer``) that carry what the scorer needs
(``rg_dataset``, ``rg_config``, ``rg_entry``), so ``relayrl.rewards.reasoning_gym_scores`` scores
a completion exactly as reasoning-gym does, in any process.

- ``data.task_kwargs`` are the generator's config fields (e.g. ``min_terms``, ``max_digits``),
  passed to ``reasoning_gym.create_dataset`` as they are; a wrong one fails naming the field.
  The one key taken out first is ``system_prompt``: the name of one of reasoning-gym's prompts
  (``default``, ``simple``, ``direct``, ``DeepSeekZero``, ``chain_of_draft``), literal text, or
  ``""`` for none. The default asks for the answer in ``<answer>...</answer>`` tags.
- Train and eval rows are one generator stream at seed ``seed``: its first ``n_train`` entries
  train; eval is the next ``n_eval`` entries whose question occurs neither in train nor earlier
  in eval (small generators repeat themselves), looked for among the following
  ``EVAL_DRAWS x n_eval`` entries; fewer found is eval shorter than ``n_eval``, none a ConfigError. ``data.difficulty`` is
  not used: the generator's own config fields set difficulty.

``reasoning_gym`` is imported only when such a task is used (the import takes seconds).
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Callable
from typing import Any

from relayrl.api.fields import ConfigError

PREFIX = "reasoning_gym:"
Row = dict[str, object]


def _import() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ConfigError(
            f"data.task={PREFIX}...: the reasoning-gym package is not installed ({e}); pip install 'relayrl[envs]'"
        ) from None
    return reasoning_gym


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str, seed: int, size: int) -> Any:
    return _import().create_dataset(name, seed=seed, size=size, **json.loads(config_json))


EVAL_DRAWS = 20  # entries looked at per eval row wanted, past the training ones


def make_dataset(name: str, config: dict[str, object], seed: int = 0, size: int = 1) -> Any:
    """``reasoning_gym.create_dataset(name, seed=, size=, **config)``, cached; ConfigError naming a bad config."""
    _import()
    from reasoning_gym.factory import DATASETS  # every generator reasoning-gym registers

    if name not in DATASETS:
        close = difflib.get_close_matches(name, sorted(DATASETS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"data.task={PREFIX}{name}: reasoning-gym has no generator {name!r}; {hint}see its README")
    try:
        return _dataset(name, json.dumps(config, sort_keys=True), seed, size)
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(f"data.task_kwargs for {PREFIX}{name}: {e}") from None


def reasoning_gym_task(
    name: str,
    n_train: int,
    n_eval: int,
    difficulty: int = 2,
    seed: int = 0,
    system_prompt: str = "default",
    **config: object,
) -> tuple[list[Row], list[Row]]:
    """``(train_rows, eval_rows)`` from reasoning-gym generator ``name`` with ``config`` (module doc)."""
    del difficulty  # the generator's config sets difficulty
    ds = make_dataset(name, dict(config), seed, n_train + EVAL_DRAWS * n_eval)
    from reasoning_gym.utils import SYSTEM_PROMPTS

    system = str(SYSTEM_PROMPTS.get(system_prompt, system_prompt))  # a named prompt, else the text itself

    def row(i: int) -> Row:
        entry = ds[i]
        messages = [{"role": "user", "content": str(entry["question"])}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        return {
            "messages": messages,
            "answer": str(entry["answer"]),
            "task": f"{PREFIX}{name}",
            "rg_dataset": name,
            "rg_config": dict(config),
            "rg_entry": entry,
        }

    train = [{**row(i), "id": f"{PREFIX}{name}/train/{i}"} for i in range(n_train)]
    seen = {str(r["messages"]) for r in train}
    evals: list[Row] = []
    for i in range(n_train, n_train + EVAL_DRAWS * n_eval):
        if len(evals) == n_eval:
            break
        r = row(i)
        if str(r["messages"]) not in seen:
            seen.add(str(r["messages"]))
            evals.append({**r, "id": f"{PREFIX}{name}/eval/{len(evals)}"})
    if n_eval and not evals:
        raise ConfigError(
            f"data.task={PREFIX}{name}: no eval question that is not also a training one in {EVAL_DRAWS * n_eval} "
            f"draws: the generator's config has few distinct questions and data.n_train={n_train} covers them; "
            "lower data.n_train or widen data.task_kwargs"
        )
    return train, evals


def reasoning_gym_task_fn(value: str) -> Callable[..., tuple[list[Row], list[Row]]]:
    """The task function ``data.task=reasoning_gym:NAME`` names (its generator checked to exist)."""
    name = value[len(PREFIX) :]
    make_dataset(name, {})  # an unknown name fails here, before anything loads
    return functools.partial(reasoning_gym_task, name)
