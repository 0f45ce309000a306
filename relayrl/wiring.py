"""Builds concrete parts from a ``RunConfig``: the one place that knows every implementation.

Both sides of the system meet here (and in the trainer and recipes) and nowhere else, so
``rollout`` never imports ``train`` and ``train`` never imports ``inference``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from relayrl.api.config import RunConfig
from relayrl.api.engine import DataItem, InferenceEngine
from relayrl.api.io import GenerationConfig
from relayrl.api.workflow import RolloutWorkflow
from relayrl.data.datasets import RLDataLoader, load_rows_from_file
from relayrl.data.models import load_model
from relayrl.data.tasks import make_task
from relayrl.data.vision import attach_vision, has_images, vision_processor
from relayrl.rewards.math import gsm8k_reward_fn
from relayrl.rewards.pool import RewardPool
from relayrl.rewards.tasks import task_reward_fn
from relayrl.train.engine import TorchTrainEngine

RewardFn = Callable[..., float]


def load_rows(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[list[DataItem], list[DataItem]]:
    """Train and eval rows: a synthetic task, or files (``data.task=file``)."""
    d = cfg.data
    image_processor = vision_processor(cfg.model)
    if d.task != "file":
        train, evals = make_task(d.task, d.n_train, d.n_eval, d.difficulty, seed=cfg.seed)
        if image_processor is None:
            if any(has_images(r) for r in train[:1]):
                raise ValueError(
                    f"data.task={d.task!r} has images but model.path={cfg.model.path!r} takes none "
                    "(use a vision-language model, e.g. model.path=tiny-vl)"
                )
            return train, evals  # type: ignore[return-value]
        return tuple(  # type: ignore[return-value]
            attach_vision(rows, tokenizer, image_processor, d.skip_invalid_rows, f"task {d.task}") if rows else rows  # type: ignore[arg-type]
            for rows in (train, evals)
        )
    if not d.train_path:
        raise ValueError("data.task=file needs data.train_path (a jsonl, json or parquet file)")

    def load(path: str) -> list[DataItem]:
        return load_rows_from_file(
            path,
            prompt_key=d.prompt_key,
            answer_key=d.answer_key,
            tokenizer=tokenizer,
            max_prompt_len=d.max_prompt_len,
            skip_invalid=d.skip_invalid_rows,
            image_processor=image_processor,
        )

    return load(d.train_path), (load(d.eval_path) if d.eval_path else [])


def reward_fn_for(cfg: RunConfig) -> RewardFn:
    """The task's verifier, or the math-verify reward for file datasets."""
    return gsm8k_reward_fn if cfg.data.task == "file" else task_reward_fn(cfg.data.task)


def make_dataloader(cfg: RunConfig, rows: list[DataItem]) -> RLDataLoader:
    return RLDataLoader(rows, batch_size=cfg.rollout.batch_size, shuffle=cfg.data.shuffle, seed=cfg.seed)


def make_critic_engine(cfg: RunConfig) -> TorchTrainEngine:
    critic_train = copy.deepcopy(cfg.train)
    critic_train.optimizer.lr = cfg.actor.critic_lr
    return TorchTrainEngine(critic_train, cfg.model, model=load_model(cfg.model, cfg.seed), head="value", seed=cfg.seed)


def make_inference_engine(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> InferenceEngine:
    """LocalEngine in this process, or RemoteEngine to given / launched servers."""
    inf = cfg.inference
    if inf.backend == "local":
        from relayrl.inference.local import LocalEngine

        return LocalEngine(inf, model=load_model(cfg.model, cfg.seed), tokenizer=tokenizer, model_config=cfg.model)
    from relayrl.inference.remote import RemoteEngine

    return RemoteEngine(
        inf, model=cfg.model
    )  # launches inference.n_servers servers of cfg.model when no addresses are given


def make_reward_pool(cfg: RunConfig, reward_fn: RewardFn) -> RewardPool | None:
    """Reward worker processes (``rollout.reward_workers``), shared by the training and eval workflows."""
    if cfg.rollout.reward_workers == 0:
        return None
    return RewardPool(reward_fn, cfg.rollout.reward_workers, cfg.rollout.reward_timeout)


def make_workflow(
    cfg: RunConfig,
    tokenizer: PreTrainedTokenizerBase,
    reward_fn: RewardFn,
    gconfig: GenerationConfig | None = None,
    reward_pool: RewardPool | None = None,
) -> RolloutWorkflow:
    """The workflow named by ``cfg.workflow``, generating with ``gconfig`` (default ``cfg.gconfig``;
    evaluation passes ``cfg.eval.gconfig``)."""
    from relayrl.rollout.workflows import MultiTurnWorkflow, ReMaxWorkflow, RLVRWorkflow, ToolAgentWorkflow

    classes = {
        "rlvr": RLVRWorkflow,
        "multi_turn": MultiTurnWorkflow,
        "remax": ReMaxWorkflow,
        "tool_agent": ToolAgentWorkflow,
    }
    r = cfg.rollout
    kwargs: dict[str, object] = {
        "reward_pool": reward_pool,
        "reward_timeout": r.reward_timeout,
        "prompt_format": cfg.data.prompt_format,
    }
    if cfg.workflow == "multi_turn":
        kwargs.update(max_turns=r.max_turns, turn_discount=r.turn_discount)
    if cfg.workflow == "tool_agent":
        from relayrl.rollout.tools import SubprocessTool

        kwargs.update(max_tool_calls=r.max_tool_calls, tool=SubprocessTool(r.tool))
        if r.tool_format == "template":  # tool calls through the chat template (relayrl.agents)
            from relayrl.agents.builtin import tool_agent_workflow

            return tool_agent_workflow(reward_fn, gconfig or cfg.gconfig, tokenizer, kwargs["tool"], r.max_tool_calls)  # type: ignore[arg-type]
    return classes[cfg.workflow](reward_fn, gconfig or cfg.gconfig, tokenizer, **kwargs)  # type: ignore[arg-type]
