"""Held-out evaluation: accuracy, mean reward, pass@n and accuracy_mean against the scores the
reward fn actually gave, recomputed plainly here (real LocalEngine, tiny model); evaluation runs
the run's own workflow and reward path (async judges, user workflows, failing episodes)."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig
from relayrl.data.tasks import make_task
from relayrl.evaluation import evaluate
from relayrl.inference.local import LocalEngine
from relayrl.rollout.workflows.rlvr import RLVRWorkflow


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
        workflow = RLVRWorkflow(reward_fn, GenerationConfig(max_new_tokens=5, top_k=0), tokenizer)
        out = evaluate(engine, workflow, rows, n_samples=n)
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


def _train_cfg(tmp_path, *extra):
    from relayrl.api.config import RunConfig, load_config

    return load_config(
        RunConfig,
        None,
        [
            f"run_dir={tmp_path}",
            "total_steps=1",
            "rollout.batch_size=2",
            "rollout.group_size=2",
            "gconfig.max_new_tokens=4",
            "data.n_train=8",
            "data.n_eval=5",
            "eval.before_training=true",
            "eval.every_n_steps=1",
            "eval.n_samples=2",
            "logging.tensorboard=false",
            "logging.progress=off",
            "checkpoint.save_final=false",
            *extra,
        ],
    )


def test_trainer_evaluates_with_an_async_judge(tmp_path):
    """An async judge (``async def judge(engine, **kw)``) scores eval episodes as it scores training ones
    (evaluate used to call it like a plain function and crash on the coroutine)."""
    import json

    from relayrl.trainer import train

    given: list[float] = []

    async def judge(engine, prompt, completions, prompt_ids, completion_ids, **data):
        await asyncio.sleep(0)
        score = float(len(completion_ids) % 2)
        given.append(score)
        return score

    cfg = _train_cfg(tmp_path)
    train(cfg, reward_fn=judge)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 1]
    # step 0: 5 prompts x 2 samples, all judged before any training episode
    assert evals[0]["eval/reward"] == pytest.approx(sum(given[:10]) / 10)
    assert evals[0]["eval/failed"] == 0 and evals[0]["eval/n_prompts"] == 5


def test_trainer_evaluates_through_the_users_workflow(tmp_path):
    """A workflow passed to the trainer is the one evaluation runs; its trajectories' rewards are the scores,
    a rejected episode scores 0 and is counted, a failing one is counted and does not stop the run."""
    from relayrl.api.io import ModelRequest
    from relayrl.api.workflow import RolloutWorkflow, trajectory_from_response
    from relayrl.data.models import chat_ids
    from relayrl.trainer import Trainer

    class Tagged(RolloutWorkflow):
        def __init__(self, tok):
            self.tok, self.seen = tok, []

        async def arun_episode(self, engine, data):
            self.seen.append(data["id"])
            ids = chat_ids(self.tok, data["messages"])
            resp = await engine.agenerate(
                ModelRequest(rid=str(len(self.seen)), input_ids=ids, gconfig=GenerationConfig(max_new_tokens=3))
            )
            if data["id"] == eval_ids[0]:
                return None
            if data["id"] == eval_ids[1]:
                raise RuntimeError("tool crashed")
            return trajectory_from_response(resp, 0.25)

    cfg = _train_cfg(tmp_path, "eval.every_n_steps=0")
    trainer = Trainer(cfg, workflow=Tagged(None))
    try:
        trainer.workflow.tok = trainer.tokenizer
        eval_ids = [r["id"] for r in trainer.eval_rows]
        out = trainer.evaluate()
    finally:
        trainer.close()
    assert sorted(trainer.workflow.seen) == sorted(eval_ids * 2)
    assert out["eval/rejected"] == 2 and out["eval/failed"] == 2
    assert out["eval/reward"] == pytest.approx(0.25 * 3 / 5)
    assert out["eval/accuracy"] == 0.0
