"""The driver: every rank-0-only part of a training run, in one object.

Under ``torchrun`` only rank 0 generates, evaluates, logs and writes the run directory; the
other ranks train their share of each batch. ``Trainer.driver`` is this object on rank 0 and
None elsewhere, so no part of the trainer is an optional attribute that exists on some ranks.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from relayrl.api.config import RunConfig
from relayrl.api.engine import DataItem, InferenceEngine, TensorDict
from relayrl.api.workflow import RolloutWorkflow
from relayrl.data.datasets import RLDataLoader
from relayrl.data.models import vision_processor
from relayrl.data.vision import png_data_urls, row_from_json, row_to_json
from relayrl.evaluation import evaluate
from relayrl.rewards.pool import RewardPool
from relayrl.rollout.executor import WorkflowExecutor
from relayrl.rollout.staleness import token_staleness
from relayrl.utils import stats
from relayrl.utils.logging import MetricLogger
from relayrl.utils.rollouts import RolloutWriter


@dataclass
class Driver:
    """Rank 0's data, generators, workflows, reward workers, evaluation and metric sinks."""

    cfg: RunConfig
    run_dir: Path
    metrics: MetricLogger
    tokenizer: PreTrainedTokenizerBase
    dataloader: RLDataLoader
    eval_rows: list[DataItem]
    engine: InferenceEngine
    executor: WorkflowExecutor
    reward_pool: RewardPool | None
    workflow: RolloutWorkflow
    eval_workflow: RolloutWorkflow
    samples: int = field(default=0)
    rollout_writer: RolloutWriter | None = field(default=None)

    def stall_state(self) -> list[str]:
        """What the watchdog's stall report says of the rollout side: a summary line, then details."""
        lines = [f"rollout: {self.executor.describe()}", f"engine: {self.engine.describe()}"]
        if self.reward_pool is not None:
            lines.append(f"reward pool: {dict(self.reward_pool.stats)}, {self.reward_pool.n_alive} workers alive")
        return lines

    def report_step(self, step: int, batch: TensorDict, seconds: float) -> None:
        """This step's gauges from the batch, speed, executor, generators, reward pool and (when
        due) evaluation; a key another part reports too is an error (``utils.stats``)."""
        n = int(batch["rewards"].shape[0])
        self.samples += n
        loss_tokens = batch["loss_mask"].bool()
        with stats.scope("rollout"):  # the staleness of the batch the version step - 1 trained on
            stats.gauge(
                reward=float(batch["rewards"].float().mean()),
                completion_len=float(loss_tokens.sum(1).float().mean()),
                **token_staleness(batch["versions"], loss_tokens, step - 1),
            )
            for key, value in batch.items():  # workflows' per-episode counters (num_turns, malformed_tool_calls, ...)
                if key not in ("rewards", "prompt_index", "group_id") and value.dim() == 1 and value.shape[0] == n:
                    stats.gauge(**{key: float(value.float().mean())})
        with stats.scope("perf"):
            stats.gauge(step_seconds=seconds, samples_per_s=n / max(seconds, 1e-9), samples=float(self.samples))
        stats.gauge(version=float(step))
        self.executor.report()
        with stats.scope("inference"):  # generator health: live servers, evictions, re-admissions ...
            stats.gauge(**self.engine.stats())
        if self.reward_pool is not None:  # reward timeouts, worker deaths ...
            with stats.scope("reward"):
                stats.gauge(**{k: float(v) for k, v in self.reward_pool.stats.items()})
        every = self.cfg.eval.every_n_steps
        if every and step % every == 0 and self.eval_rows:
            stats.gauge(**self.evaluate())

    def log(self, step: int, metrics: dict[str, float], batch: TensorDict) -> None:
        """metrics.jsonl (with the row ids this step trained on: audits see nothing lost or repeated) and
        ``logging.rollouts_per_step`` of the step's rollouts, token by token, for ``relayrl show`` and
        ``relayrl inspect`` (format: ``relayrl.utils.rollouts``)."""
        self.metrics.log({**metrics, "prompt_ids": list(self.executor.last_prompt_ids)}, step=step)
        if self.cfg.logging.rollouts_per_step > 0:
            if self.rollout_writer is None:
                processor = vision_processor(self.cfg.model) if "pixel_values" in batch else None
                images = functools.partial(png_data_urls, processor) if processor is not None else None
                self.rollout_writer = RolloutWriter(self.run_dir, self.tokenizer, images)
            self.rollout_writer.write(step, batch, self.cfg.logging.rollouts_per_step)

    def evaluate(self) -> dict[str, float]:
        """Score the held-out rows with the eval generation config (executor paused; it resumes
        only if it was running: between steps the loop resumes it after reseeding generation)."""
        was_paused = self.executor.paused
        self.executor.pause()
        try:
            return evaluate(self.engine, self.eval_workflow, self.eval_rows, self.cfg.eval.n_samples)
        finally:
            if not was_paused:
                self.executor.resume()

    def state_dict(self) -> dict[str, Any]:
        """The driver's part of a checkpoint (JSON): data order and what the executor had not trained
        on (rows with images keep them as PNG)."""
        executor = self.executor.state_dict()
        pending = typing.cast(list[dict[str, Any]], executor["pending"])
        executor["pending"] = [{**p, "data": row_to_json(p["data"])} for p in pending]
        return {"dataloader": self.dataloader.state_dict(), "executor": executor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataloader.load_state_dict(state["dataloader"])
        executor = dict(state["executor"])
        if any(isinstance(p["data"].get("vision"), dict) for p in executor["pending"]):
            processor = vision_processor(self.cfg.model)
            executor["pending"] = [{**p, "data": row_from_json(p["data"], processor)} for p in executor["pending"]]
        self.executor.load_state_dict(executor)

    def close(self) -> None:
        """Stop the executor, generators (and launched servers), reward workers; flush metrics."""
        self.executor.destroy()
        self.engine.destroy()
        if self.reward_pool is not None:
            self.reward_pool.close()
        self.metrics.close()
