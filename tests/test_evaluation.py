"""Held-out evaluation: accuracy, mean reward, pass@n and accuracy_mean against the scores the
reward fn actually gave, recomputed plainly here (real LocalEngine, tiny model)."""

from __future__ import annotations

import pytest

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig
from relayrl.data.tasks import make_task
from relayrl.evaluation import evaluate
from relayrl.inference.local import LocalEngine


@pytest.mark.parametrize("n", [1, 4])
def test_eval_metrics_match_the_scores_given(tiny_model, tokenizer, n):
    rows = make_task("arithmetic", 12, 2, seed=3)[0]
    given: dict[str, list[float]] = {}

    def reward_fn(prompt, completions, prompt_ids, completion_ids, **data):
        score = float(sum(completion_ids) % 3 == 0)  # an arbitrary but reproducible verdict per sample
        given.setdefault(data["id"], []).append(score)
        return score

    engine = LocalEngine(InferenceConfig(seed=0, max_batch_size=64), model=tiny_model, tokenizer=tokenizer)
    engine.initialize()
    try:
        out = evaluate(engine, tokenizer, rows, GenerationConfig(max_new_tokens=5, top_k=0), reward_fn, n_samples=n)
    finally:
        engine.destroy()
    assert sorted(given) == sorted(r["id"] for r in rows) and all(len(s) == n for s in given.values())
    scores = [given[r["id"]] for r in rows]
    assert out["eval/n_prompts"] == len(rows)
    assert out["eval/accuracy"] == pytest.approx(sum(1 for s in scores if s[0] == 1.0) / len(rows))
    assert out["eval/reward"] == pytest.approx(sum(sum(s) / n for s in scores) / len(rows))
    if n == 1:
        assert "eval/pass@1" not in out
        return
    passed = 0
    for s in scores:
        if any(x == 1.0 for x in s):
            passed += 1
    assert out[f"eval/pass@{n}"] == pytest.approx(passed / len(rows))
    assert out["eval/accuracy_mean"] == pytest.approx(sum(sum(s) / n for s in scores) / len(rows))
    assert 0 < out["eval/accuracy_mean"] < out[f"eval/pass@{n}"] < 1  # the verdicts are mixed, so this can tell
