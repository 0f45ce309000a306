"""Held-out evaluation through the run's own workflow and reward path.

Each held-out row runs ``n_samples`` episodes of the workflow (the same class, reward fn,
reward pool and judges as training; usually built with the eval generation config), and an
episode's score is its trajectory's reward. So multi-turn, tool and user workflows, async
judges and reward workers are evaluated exactly as they are trained.

Requests go straight to the inference engine (bypassing the rollout executor's queue), so
evaluation is not stuck behind training rollouts; in asynchronous mode the trainer pauses
the executor's new submissions while evaluating.
"""

from __future__ import annotations

import asyncio

from relayrl.api.engine import DataItem, InferenceEngine
from relayrl.api.workflow import RolloutWorkflow
from relayrl.utils.logging import get_logger

logger = get_logger("relayrl.evaluation")


async def _episode_score(engine: InferenceEngine, workflow: RolloutWorkflow, row: DataItem) -> float | str:
    """The episode's reward (mean over its rows), ``"rejected"`` (the workflow returned None) or
    ``"failed: <error>"``; one bad episode never stops the evaluation."""
    try:
        traj = await workflow.arun_episode(engine, dict(row))
    except Exception as e:  # noqa: BLE001  (counted and reported, like a failed training episode)
        return f"failed: {type(e).__name__}: {e}"
    if traj is None:
        return "rejected"
    return float(traj["rewards"].float().mean())


def evaluate(
    engine: InferenceEngine,
    workflow: RolloutWorkflow,
    rows: list[DataItem],
    n_samples: int = 1,
) -> dict[str, float]:
    """``eval/accuracy`` (first sample correct), ``eval/reward`` and, for n > 1, ``eval/pass@n``
    and ``eval/accuracy_mean``; ``eval/rejected`` and ``eval/failed`` count episodes that gave
    no trajectory (each scores 0).

    A sample counts as correct when its reward is at least 1. If every episode fails, the first
    error is raised: a broken evaluation must not read as a model scoring 0.
    """
    if not rows:
        raise ValueError("evaluate: no eval rows")

    async def run() -> list[float | str]:
        return await asyncio.gather(*(_episode_score(engine, workflow, r) for r in rows for _ in range(n_samples)))

    results = asyncio.run(run())
    failed = [r for r in results if isinstance(r, str) and r.startswith("failed")]
    if len(failed) == len(results):
        raise RuntimeError(f"evaluate: every episode failed; first: {failed[0].removeprefix('failed: ')}")
    if failed:
        logger.warning("evaluate: %d of %d episodes failed (scored 0); first: %s", len(failed), len(results), failed[0])
    flat = [r if isinstance(r, float) else 0.0 for r in results]
    scores = [flat[i * n_samples : (i + 1) * n_samples] for i in range(len(rows))]
    out = {
        "eval/accuracy": sum(s[0] >= 1.0 for s in scores) / len(scores),
        "eval/reward": sum(sum(s) / len(s) for s in scores) / len(scores),
        "eval/n_prompts": float(len(scores)),
        "eval/rejected": float(sum(r == "rejected" for r in results)),
        "eval/failed": float(len(failed)),
    }
    if n_samples > 1:
        out[f"eval/pass@{n_samples}"] = sum(max(s) >= 1.0 for s in scores) / len(scores)
        out["eval/accuracy_mean"] = sum(sum(x >= 1.0 for x in s) / len(s) for s in scores) / len(scores)
    return out
