"""Synthetic tasks with verifiable answers, for tests, the CPU demo and recipes.

``make_task(name, n_train, n_eval, difficulty, seed)`` returns ``(train_rows, eval_rows)`` in
the row contract (``id``, ``messages``, ``answer`` plus task fields). Rows are deterministic
given the arguments, and no problem appears in both splits.

- ``arithmetic``: "23+58=" -> "81". ``difficulty`` = digits per operand; ``ops`` picks the
  operators ("+", "-", "+-"); subtraction keeps the result non-negative.
- ``countdown``: "Make 26 with 3 7 5:" -> an expression using each number exactly once,
  e.g. "3*7+5". ``difficulty`` = how many numbers (>= 2); numbers are 1..``max_number``.
- ``count``: "Count to 34700 from 34696:" -> "34696 34697 34698 34699 34700" (up to the next
  multiple of 100): the long-tailed completion lengths of chain-of-thought rollouts in
  miniature, with rules a tiny model learns in ~100 SFT steps (copy the start, add one, stop
  at a multiple of 100). How many numbers is log-normal with median ``3 * difficulty`` and
  sigma 0.75, clamped to ``[1, 15 * difficulty]``; numbers have 5 digits, so a completion is
  exactly ``6 * count`` tokens with EOS under a character tokenizer. ``difficulty=2``: median 6
  numbers (36 tokens), mean ~8 (49 tokens), 90th percentile ~17 (102 tokens), longest 30 (180).

Verifiers live in ``relayrl.rewards.tasks`` (``task_reward_fn(name)``); the expected
completion is the bare answer, optionally followed by EOS.

``demonstrations(rows, error_rate, seed)`` writes prompt/completion pairs for SFT warm-up, exactly
``round(error_rate * len(rows))`` of them wrong in plausible ways (``_wrong_*`` below), so a model
imitating them is measurably short of perfect and RL has room to improve it.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from typing import cast

from relayrl.rewards.tasks import evaluate_countdown
from relayrl.utils.resolve import registrar, resolve

Row = dict[str, object]
Problem = tuple[tuple[object, ...], str, str, Row]  # a key telling problems apart, prompt, answer, the task's fields
ERROR_KINDS = ("carry", "digit", "swap", "off_by")


def _split(
    name: str,
    problems: Callable[[random.Random], Problem],
    n_train: int,
    n_eval: int,
    difficulty: int,
    seed: int,
    capacity: int,
) -> tuple[list[Row], list[Row]]:
    """Draw ``n_train + n_eval`` distinct problems (keyed by ``problems``) as rows, then cut into splits."""
    need = n_train + n_eval
    if need > capacity // 2:
        raise ValueError(
            f"task {name!r} with difficulty={difficulty} has about {capacity} distinct problems; "
            f"n_train + n_eval = {need} is too many (at most {capacity // 2}): raise the difficulty or ask for fewer"
        )
    rng = random.Random(f"{name}-{difficulty}-{seed}")
    seen: set[tuple[object, ...]] = set()
    rows: list[Row] = []
    while len(rows) < need:
        key, prompt, answer, fields = problems(rng)
        if key in seen:
            continue
        seen.add(key)
        rows.append({"messages": [{"role": "user", "content": prompt}], "answer": answer, "task": name, **fields})
    for i, row in enumerate(rows):
        row["id"] = f"{name}/train/{i}" if i < n_train else f"{name}/eval/{i - n_train}"
    return rows[:n_train], rows[n_train:]


def arithmetic_task(
    n_train: int, n_eval: int, difficulty: int = 2, seed: int = 0, ops: str = "+"
) -> tuple[list[Row], list[Row]]:
    """Addition/subtraction of two ``difficulty``-digit numbers, e.g. "23+58=" -> "81"."""
    if not 1 <= difficulty <= 9:
        raise ValueError(f"arithmetic difficulty (digits) must be in [1, 9], got {difficulty}")
    if not ops or set(ops) - {"+", "-"}:
        raise ValueError(f"arithmetic ops must be made of '+' and '-', got {ops!r}")
    lo, hi = (0 if difficulty == 1 else 10 ** (difficulty - 1)), 10**difficulty - 1
    op_list = sorted(set(ops))

    def problem(rng: random.Random) -> Problem:
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(op_list)
        if op == "-" and a < b:
            a, b = b, a
        result = a + b if op == "+" else a - b
        return (a, op, b), f"{a}{op}{b}=", str(result), {"operands": [a, b], "op": op}

    capacity = (hi - lo + 1) ** 2 * len(op_list) // (2 if op_list == ["-"] else 1)
    return _split("arithmetic", problem, n_train, n_eval, difficulty, seed, capacity)


def _countdown_expr(rng: random.Random, numbers: list[int]) -> str:
    """A random left-fold expression over ``numbers`` with +, -, * (parenthesised where needed)."""
    expr = str(numbers[0])
    for n in numbers[1:]:
        op = rng.choice("+-*")
        if op == "*" and any(c in expr for c in "+-"):
            expr = f"({expr})"
        expr = f"{expr}{op}{n}"
    return expr


def countdown_task(
    n_train: int,
    n_eval: int,
    difficulty: int = 3,
    seed: int = 0,
    max_number: int = 9,
    max_target: int = 100,
) -> tuple[list[Row], list[Row]]:
    """Reach a target from ``difficulty`` numbers with +, -, *, each number used once."""
    if difficulty < 2:
        raise ValueError(f"countdown difficulty (how many numbers) must be >= 2, got {difficulty}")

    def problem(rng: random.Random) -> Problem:
        while True:
            numbers = [rng.randint(1, max_number) for _ in range(difficulty)]
            expr = _countdown_expr(rng, numbers)
            target = evaluate_countdown(expr, numbers)
            if target is not None and 0 < target <= max_target:
                break
        shown = sorted(numbers, key=lambda _: rng.random())
        prompt = f"Make {target} with {' '.join(map(str, shown))}:"
        return (tuple(sorted(numbers)), target), prompt, expr, {"numbers": shown, "target": target}

    capacity = min(max_number**difficulty * 3 ** (difficulty - 1), max_number**difficulty // 2 * max_target)
    return _split("countdown", problem, n_train, n_eval, difficulty, seed, capacity)


def count_task(
    n_train: int, n_eval: int, difficulty: int = 2, seed: int = 0, sigma: float = 0.75
) -> tuple[list[Row], list[Row]]:
    """Count up to the next multiple of 100: "Count to 34700 from 34696:" -> "34696 34697 34698 34699 34700"."""
    if not 1 <= difficulty <= 6:
        raise ValueError(f"count difficulty (length scale) must be in [1, 6], got {difficulty}")
    median, longest = 3 * difficulty, 15 * difficulty

    def problem(rng: random.Random) -> Problem:
        n = min(longest, max(1, round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))))
        b = 100 * rng.randint(101, 999)  # every number has 5 digits
        a = b - n + 1
        return (a, b), f"Count to {b} from {a}:", " ".join(map(str, range(a, b + 1))), {"start": a, "end": b}

    return _split("count", problem, n_train, n_eval, difficulty, seed, 899 * longest)


def count_squares_task(n_train: int, n_eval: int, difficulty: int = 2, seed: int = 0) -> tuple[list[Row], list[Row]]:
    """A visual task: "How many squares?" about a 56x56 image (``images`` column) holding 1 to
    ``difficulty + 1`` coloured squares, one per 28x28 quadrant (one vision token each on Qwen2-VL)."""
    from relayrl.data.vision import squares_image

    if not 1 <= difficulty <= 3:
        raise ValueError(f"count_squares difficulty (largest count - 1) must be in [1, 3], got {difficulty}")

    def problem(rng: random.Random) -> Problem:
        k = rng.randint(1, difficulty + 1)
        cells = tuple(sorted(rng.sample(range(4), k)))
        colours = tuple(rng.randrange(3) for _ in cells)
        offsets = tuple((rng.randint(0, 8), rng.randint(0, 8)) for _ in cells)
        images = [squares_image(cells, colours, offsets)]
        return (cells, colours, offsets), "How many squares?", str(k), {"images": images}

    return _split("count_squares", problem, n_train, n_eval, difficulty, seed, 20_000)


TaskFn = Callable[..., tuple[list[Row], list[Row]]]
TASKS: dict[str, TaskFn] = {
    "arithmetic": arithmetic_task,
    "countdown": countdown_task,
    "count": count_task,
    "count_squares": count_squares_task,
}
_register = registrar(TASKS, "task")


def register_task(name: str) -> Callable[[TaskFn], TaskFn]:
    """``@register_task("name")`` on ``(n_train, n_eval, difficulty, seed) -> (train_rows, eval_rows)``:
    ``data.task: name`` then selects it (rows as the built-in tasks make: ``id``, ``messages``, ``answer``)."""
    return _register(name)


def task_fn(value: str, field: str = "data.task") -> TaskFn:
    """``data.task``: a registered task name, ``reasoning_gym:NAME`` (``relayrl.data.reasoning_gym_tasks``)
    or ``package.module:function``."""
    if value.startswith("reasoning_gym:"):
        from relayrl.data.reasoning_gym_tasks import reasoning_gym_task_fn

        return reasoning_gym_task_fn(value)
    expected = "a function returning (train_rows, eval_rows)"
    return resolve(field, value, TASKS, expected, lambda obj: cast(TaskFn, obj) if callable(obj) else None)


def make_task(
    name: str, n_train: int, n_eval: int, difficulty: int = 2, seed: int = 0, **options: object
) -> tuple[list[Row], list[Row]]:
    """``(train_rows, eval_rows)`` of synthetic task ``name``; ``options`` go to the task (e.g. ops="+-")."""
    fn = task_fn(name)
    if n_train < 0 or n_eval < 0:
        raise ValueError(f"n_train and n_eval must be >= 0, got {n_train}, {n_eval}")
    return fn(n_train, n_eval, difficulty, seed, **options)


# ------------------------------------------------------------------ imperfect demonstrations


def _wrong_number(rng: random.Random, row: Row, kinds: tuple[str, ...]) -> str:
    """A plausible wrong answer to an arithmetic row (never the right one, never negative)."""
    answer = int(str(row["answer"]))
    a, b = (int(x) for x in cast(list[int], row["operands"]))
    digits = str(answer)
    for kind in rng.sample(kinds, len(kinds)) + ["off_by"]:
        if kind == "carry":  # digit-wise sum without carries / smaller-from-larger digit
            width = max(len(str(a)), len(str(b)))
            da, db = str(a).zfill(width), str(b).zfill(width)
            f = (lambda x, y: (x + y) % 10) if row["op"] == "+" else (lambda x, y: abs(x - y))
            cand = int("".join(str(f(int(x), int(y))) for x, y in zip(da, db, strict=True)))
        elif kind == "digit":
            i = rng.randrange(len(digits))
            d = (int(digits[i]) + rng.choice((1, -1))) % 10
            if i == 0 and d == 0 and len(digits) > 1:
                d = 1 if digits[0] != "1" else 2
            cand = int(digits[:i] + str(d) + digits[i + 1 :])
        elif kind == "swap":
            pairs = [
                i for i in range(len(digits) - 1) if digits[i] != digits[i + 1] and (i > 0 or digits[i + 1] != "0")
            ]
            if not pairs:
                continue
            i = rng.choice(pairs)
            cand = int(digits[:i] + digits[i + 1] + digits[i] + digits[i + 2 :])
        else:
            cand = answer + rng.choice((1, -1, 10, -10))
        if cand != answer and cand >= 0:
            return str(cand)
    return str(answer + 1)


def _wrong_expression(rng: random.Random, row: Row) -> str:
    """A countdown expression that misses the target: one operator or one number changed."""
    expr, target = str(row["answer"]), int(str(row["target"]))
    ops_at = [i for i, c in enumerate(expr) if c in "+-*"]
    nums = [int(n) for n in cast(list[int], row["numbers"])]
    for _ in range(50):
        if ops_at and rng.random() < 0.5:
            i = rng.choice(ops_at)
            cand = expr[:i] + rng.choice([o for o in "+-*" if o != expr[i]]) + expr[i + 1 :]
            used = nums
        else:
            # change one number literal: the expression still parses but uses a wrong number
            literal = rng.choice(list(re.finditer(r"\d+", expr)))
            new = max(1, int(literal[0]) + rng.choice((1, -1, 2)))
            cand = expr[: literal.start()] + str(new) + expr[literal.end() :]
            used = nums.copy()
            used.remove(int(literal[0]))
            used.append(new)
        value = evaluate_countdown(cand, used)
        if value is not None and value != target:
            return cand
    return expr + "+1"


COUNT_ERRORS = ("skip", "repeat", "early", "late")


def _wrong_count(rng: random.Random, row: Row) -> str:
    """A miscount of a count row: one number skipped or repeated, or stopping 1-3 numbers early or late."""
    a, b = int(str(row["start"])), int(str(row["end"]))
    nums = list(range(a, b + 1))
    fits = {"skip": len(nums) >= 3, "repeat": True, "early": len(nums) >= 2, "late": True}
    kinds = [k for k in COUNT_ERRORS if fits[k]]
    kind = rng.choice(kinds)
    if kind == "skip":
        del nums[rng.randrange(1, len(nums) - 1)]
    elif kind == "repeat":
        i = rng.randrange(len(nums))
        nums.insert(i, nums[i])
    elif kind == "early":
        del nums[len(nums) - rng.randint(1, min(3, len(nums) - 1)) :]
    else:
        nums += range(b + 1, b + rng.randint(1, 3) + 1)
    return " ".join(map(str, nums))


def demonstrations(
    rows: list[Row],
    error_rate: float,
    seed: int = 0,
    kinds: tuple[str, ...] = ERROR_KINDS,
) -> list[Row]:
    """SFT pairs for ``rows``: ``{"id", "messages", "completion", "answer", "correct"}``.

    ``completion`` is the answer text without EOS (the SFT side appends the tokenizer's EOS).
    Exactly ``round(error_rate * len(rows))`` rows, chosen by ``seed``, get a wrong completion.
    ``kinds`` picks the arithmetic error kinds (subset of ``ERROR_KINDS``).
    """
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
    if not kinds or set(kinds) - set(ERROR_KINDS):
        raise ValueError(f"kinds must be a non-empty subset of {ERROR_KINDS}, got {kinds}")
    rng = random.Random(f"demos-{seed}")
    wrong = set(rng.sample(range(len(rows)), round(error_rate * len(rows))))
    out: list[Row] = []
    for i, row in enumerate(rows):
        completion = str(row["answer"])
        if i in wrong:
            task = row.get("task")
            if task == "arithmetic":
                completion = _wrong_number(rng, row, tuple(kinds))
            elif task == "countdown":
                completion = _wrong_expression(rng, row)
            elif task == "count":
                completion = _wrong_count(rng, row)
            else:
                raise ValueError(
                    f"row {i} (id={row.get('id')!r}): demonstrations need a synthetic task row, got task={task!r}"
                )
        out.append(
            {
                "id": row["id"],
                "messages": row["messages"],
                "completion": completion,
                "answer": row["answer"],
                "correct": i not in wrong,
            }
        )
    return out
