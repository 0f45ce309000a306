"""Builds concrete parts from a ``RunConfig``: the one place that knows every implementation.

Both sides of the system meet here (and in the trainer and recipes) and nowhere else, so
``rollout`` never imports ``train`` and ``train`` never imports ``inference``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable, Mapping

from transformers import PreTrainedTokenizerBase

from relayrl.api.config import ConfigError, LoraConfig, RunConfig
from relayrl.api.engine import DataItem, InferenceEngine
from relayrl.api.io import GenerationConfig
from relayrl.api.workflow import RewardFn, RolloutWorkflow
from relayrl.data.datasets import RLDataLoader, attach_vision, load_rows_from_file
from relayrl.data.models import load_model, vision_processor
from relayrl.data.preflight import check_run
from relayrl.data.tasks import make_task, task_fn
from relayrl.data.vision import has_images
from relayrl.rewards.pool import RewardPool
from relayrl.rewards.registry import resolve_reward_fn
from relayrl.train.engine import TorchTrainEngine
from relayrl.utils.resolve import import_modules


def load_rows(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[list[DataItem], list[DataItem]]:
    """Train and eval rows: a synthetic task, or files (``data.task=file``)."""
    d = cfg.data
    image_processor = vision_processor(cfg.model)
    if d.task != "file":
        train, evals = make_task(d.task, d.n_train, d.n_eval, d.difficulty, seed=cfg.seed, **d.task_kwargs)
        if image_processor is None:
            if any(has_images(r) for r in train[:1]):
                raise ValueError(
                    f"data.task={d.task!r} has images but model.path={cfg.model.path!r} takes none "
                    "(use a vision-language model, e.g. model.path=tiny-vl)"
                )
            return train, evals
        where = f"task {d.task}"
        return (
            attach_vision(train, tokenizer, image_processor, d.skip_invalid_rows, where),
            attach_vision(evals, tokenizer, image_processor, d.skip_invalid_rows, where) if evals else evals,
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
    """``reward_fn`` with ``reward_kwargs`` bound; by default the task's verifier (math-verify for files)."""
    return resolve_reward_fn(cfg.reward_fn, cfg.data.task, cfg.reward_kwargs)


def resolve_extensions(cfg: RunConfig, workflow_given: bool = False, reward_fn_given: bool = False) -> None:
    """Import ``imports``, then resolve every extension point of ``cfg`` now, before any model loads,
    so a bad name or path fails in one line naming its field."""
    import_modules(cfg.imports)
    check_run(cfg)
    from relayrl.rollout.workflows import workflow_factory
    from relayrl.train.actor import check_actor_config

    check_actor_config(cfg.actor)
    if not workflow_given:
        _check_workflow_kwargs(cfg, workflow_factory(cfg.workflow))
    if cfg.data.task != "file":
        task_fn(cfg.data.task)
    if not reward_fn_given:
        reward_fn_for(cfg)


def make_dataloader(cfg: RunConfig, rows: list[DataItem]) -> RLDataLoader:
    return RLDataLoader(rows, batch_size=cfg.rollout.batch_size, shuffle=cfg.data.shuffle, seed=cfg.seed)


def make_critic_engine(cfg: RunConfig) -> TorchTrainEngine:
    critic_train = copy.deepcopy(cfg.train)
    critic_train.optimizer.lr = cfg.actor.critic_lr
    return TorchTrainEngine(critic_train, cfg.model, model=load_model(cfg.model, cfg.seed), head="value", seed=cfg.seed)


def make_teacher_engine(cfg: RunConfig, student: TorchTrainEngine) -> TorchTrainEngine | None:
    """Distillation's local teacher (``actor.teacher.path``), frozen, on the student's train settings;
    None when distillation is off or has no local teacher. Its vocabulary must be the student's."""
    from relayrl.train.actor import needs_teacher

    path = cfg.actor.teacher.path
    if not path or not needs_teacher(cfg.actor):
        return None
    model_cfg = dataclasses.replace(cfg.model, path=path, tokenizer_path="", vocab_size=0, lora=LoraConfig())
    teacher = TorchTrainEngine(cfg.train, model_cfg, model=load_model(model_cfg, cfg.seed), trainable=False)
    teacher.initialize()
    sizes = [int(e._require().get_output_embeddings().weight.shape[0]) for e in (student, teacher)]
    if sizes[0] != sizes[1]:
        raise ConfigError(
            f"actor.teacher.path={path!r} has a vocabulary of {sizes[1]} tokens, the student ({cfg.model.path!r}) "
            f"{sizes[0]}: distillation scores the student's tokens, so the two must share a tokenizer"
        )
    return teacher


def make_inference_engine(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> InferenceEngine:
    """LocalEngine in this process, or RemoteEngine to given / launched servers."""
    inf = cfg.inference
    if inf.backend == "local":
        from relayrl.inference.local import LocalEngine

        return LocalEngine(inf, model=load_model(cfg.model, cfg.seed), tokenizer=tokenizer, model_config=cfg.model)
    from relayrl.inference.remote import RemoteEngine

    # launches inference.n_servers servers of cfg.model when no addresses are given
    return RemoteEngine(inf, model=cfg.model)


def make_reward_pool(cfg: RunConfig, reward_fn: RewardFn) -> RewardPool | None:
    """Reward worker processes (``rollout.reward_workers``), shared by the training and eval workflows."""
    r = cfg.rollout
    return RewardPool(reward_fn, r.reward_workers, r.reward_timeout) if r.reward_workers else None


def make_workflow(
    cfg: RunConfig,
    tokenizer: PreTrainedTokenizerBase,
    reward_fn: RewardFn,
    gconfig: GenerationConfig | None = None,
    reward_pool: RewardPool | None = None,
) -> RolloutWorkflow:
    """The workflow ``cfg.workflow`` resolves to, generating with ``gconfig`` (default ``cfg.gconfig``;
    evaluation passes ``cfg.eval.gconfig``).

    The factory gets, of the run's standard arguments, those its signature names (``reward_fn``,
    ``gconfig``, ``tokenizer``, ``reward_pool``, ``reward_timeout``, ``prompt_format``, ``max_turns``,
    ``turn_discount``, ``max_tool_calls``, ``tool``), then ``workflow_kwargs``.
    """
    from relayrl.rollout.tools import SubprocessTool
    from relayrl.rollout.workflows import ToolAgentWorkflow, workflow_factory

    factory = workflow_factory(cfg.workflow)
    r = cfg.rollout
    gconfig = gconfig or cfg.gconfig
    if factory is ToolAgentWorkflow and r.tool_format == "template":  # tool calls through the chat template
        from relayrl.agents.builtin import tool_agent_workflow

        return tool_agent_workflow(
            reward_fn,
            gconfig,
            tokenizer,
            SubprocessTool(r.tool, r.tool_timeout),
            r.max_tool_calls,
            reward_pool=reward_pool,
            reward_timeout=r.reward_timeout,
        )
    offered: dict[str, Callable[[], object]] = {
        "reward_fn": lambda: reward_fn,
        "gconfig": lambda: gconfig,
        "tokenizer": lambda: tokenizer,
        "reward_pool": lambda: reward_pool,
        "reward_timeout": lambda: r.reward_timeout,
        "prompt_format": lambda: cfg.data.prompt_format,
        "max_turns": lambda: r.max_turns,
        "turn_discount": lambda: r.turn_discount,
        "max_tool_calls": lambda: r.max_tool_calls,
        "tool": lambda: SubprocessTool(r.tool, r.tool_timeout),
    }
    params = _check_workflow_kwargs(cfg, factory)
    kwargs = {k: make() for k, make in offered.items() if k in params and k not in cfg.workflow_kwargs}
    workflow = factory(**kwargs, **cfg.workflow_kwargs)
    if not hasattr(workflow, "arun_episode"):
        raise ConfigError(f"workflow={cfg.workflow!r} returned a {type(workflow).__name__}, expected a RolloutWorkflow")
    return workflow


def _check_workflow_kwargs(cfg: RunConfig, factory: Callable[..., object]) -> Mapping[str, inspect.Parameter]:
    """The factory's parameters; ConfigError naming ``workflow_kwargs.KEY`` for an argument it does not take."""
    params = inspect.signature(factory).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        for key in cfg.workflow_kwargs:
            if key not in params:
                raise ConfigError(
                    f"workflow_kwargs.{key}: workflow={cfg.workflow!r} takes no argument {key!r} "
                    f"(its arguments: {list(params)})"
                )
    return params
