"""RLVR: one sampled completion per episode, scored by a verifiable reward function.

The executor runs ``group_size`` episodes per prompt, so the workflow itself samples once.
Reward functions (``relayrl.api.workflow.RewardFn``) are ``reward_fn(prompt, completions, prompt_ids,
completion_ids, **data) -> float``. They run

- in a ``RewardPool`` (worker processes, per-call timeout) when one is given;
- else in a daemon thread with ``reward_timeout`` seconds (a hanging fn fails the episode
  with ``TimeoutError`` and does not block the event loop);
- else inline on the event loop (fast fns only).

An async callable (e.g. a ``GenerativeJudge``) is awaited with the engine as first argument.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import queue
import threading
import typing
import uuid
from collections.abc import Awaitable, Callable
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from relayrl.api.engine import DataItem, InferenceEngine
from relayrl.api.io import GenerationConfig, ModelRequest, ModelResponse
from relayrl.api.workflow import RewardFn, RolloutWorkflow, Trajectory, trajectory_from_response
from relayrl.data.vision import row_vision

_NOT_FOR_REWARDS = ("vision",)  # a row's processed images (tensors) stay out of reward fns


class AsyncRewardPool(Protocol):
    """What workflows need of ``relayrl.rewards.pool.RewardPool``."""

    async def acall(self, **kwargs: object) -> float: ...


def prompt_ids_of(tokenizer: PreTrainedTokenizerBase, data: DataItem, prompt_format: str = "chat") -> list[int]:
    """Prompt ids of a row (``messages`` ends with the user turn, as ``relayrl.data.datasets`` checks): chat-templated, or the
    turns' plain text for base models (``prompt_format="plain"``, also used when the tokenizer has no template)."""
    from relayrl.data.chat import prompt_ids

    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise KeyError(
            f"data row {data.get('id', '?')!r} needs 'messages' (a non-empty list of chat turns); "
            f"it has keys {sorted(data)}"
        )
    return prompt_ids(tokenizer, messages, prompt_format)


class _RewardThreads:
    """Daemon threads that run blocking reward fns: no thread is started per call (that cost
    ~20% of a short RL step), and a call that hangs past its timeout costs one thread, which is
    replaced, never the process's exit (daemon threads are not joined)."""

    def __init__(self, size: int = 4) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        for _ in range(size):
            self.add_thread()

    def add_thread(self) -> None:
        threading.Thread(target=self._work, name="reward-fn", daemon=True).start()

    def _work(self) -> None:
        while True:
            self._jobs.get()()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)


_THREADS: _RewardThreads | None = None
_THREADS_LOCK = threading.Lock()


async def _in_thread(fn: RewardFn, kwargs: dict[str, object], timeout: float) -> float:
    """Run ``fn`` on a reward thread; a hang past ``timeout`` fails the call, not the process."""
    global _THREADS
    with _THREADS_LOCK:
        if _THREADS is None:
            _THREADS = _RewardThreads()
        threads = _THREADS
    fut: concurrent.futures.Future[float] = concurrent.futures.Future()

    def run() -> None:
        if fut.set_running_or_notify_cancel():  # else it timed out while waiting for a thread
            try:
                fut.set_result(float(fn(**kwargs)))
            except BaseException as e:  # handed to the awaiting episode
                fut.set_exception(e)

    threads.submit(run)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
    except TimeoutError:
        if not fut.cancel():  # running: the hung call keeps its thread, a new one serves the others
            threads.add_thread()
        raise TimeoutError(f"reward fn {getattr(fn, '__name__', fn)!r} did not return within {timeout}s") from None


async def compute_reward(
    reward_fn: RewardFn,
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    resp: ModelResponse,
    data: DataItem,
    reward_pool: AsyncRewardPool | None = None,
    reward_timeout: float | None = None,
    prompt_ids: list[int] | None = None,
    completion_ids: list[int] | None = None,
) -> float:
    """Score one completion with a reward fn (the signature and where it runs: module doc for where it runs)."""
    p_ids = list(resp.input_tokens if prompt_ids is None else prompt_ids)
    c_ids = list(resp.output_tokens if completion_ids is None else completion_ids)
    kwargs = reward_kwargs(
        data,
        prompt=tokenizer.decode(p_ids, skip_special_tokens=True),
        completions=tokenizer.decode(c_ids, skip_special_tokens=False),
        prompt_ids=p_ids,
        completion_ids=c_ids,
    )
    return await call_reward(reward_fn, engine, kwargs, reward_pool, reward_timeout)


def reward_kwargs(data: DataItem, **named: object) -> dict[str, object]:
    """A reward fn's keyword arguments: the row's fields (not its processed images) and the named ones
    (``prompt``, ``completions``, ``prompt_ids``, ``completion_ids``), which win over the row's."""
    return {**{k: v for k, v in data.items() if k not in _NOT_FOR_REWARDS}, **named}


async def call_reward(
    reward_fn: RewardFn,
    engine: InferenceEngine | None,
    kwargs: dict[str, object],
    reward_pool: AsyncRewardPool | None = None,
    reward_timeout: float | None = None,
) -> float:
    """Run a reward fn where it belongs (module doc): awaited with the engine when async, else in the
    pool, in a thread with a deadline, or inline; a non-finite reward is an error."""
    if inspect.iscoroutinefunction(reward_fn) or inspect.iscoroutinefunction(type(reward_fn).__call__):
        value = await typing.cast(Callable[..., Awaitable[float]], reward_fn)(engine, **kwargs)
    elif reward_pool is not None:
        value = await reward_pool.acall(**kwargs)
    elif reward_timeout is not None:
        value = await _in_thread(reward_fn, kwargs, reward_timeout)
    else:
        value = reward_fn(**kwargs)
    if not math.isfinite(float(value)):  # the episode fails (counted), the batch fills from others
        raise ValueError(
            f"reward fn {getattr(reward_fn, '__name__', 'reward_fn')!r} returned {float(value)} for row "
            f"{kwargs.get('id', '?')!r}; rewards must be finite"
        )
    return float(value)


class PromptWorkflow(RolloutWorkflow):
    """What the built-in workflows share: the run's six standard arguments, a row's prompt ids and
    the reward of a completion (``compute_reward`` with the workflow's pool and timeout)."""

    def __init__(
        self,
        reward_fn: RewardFn,
        gconfig: GenerationConfig,
        tokenizer: PreTrainedTokenizerBase,
        reward_pool: AsyncRewardPool | None = None,
        reward_timeout: float | None = None,
        prompt_format: str = "chat",
    ) -> None:
        self.reward_fn, self.gconfig, self.tokenizer = reward_fn, gconfig, tokenizer
        self.reward_pool, self.reward_timeout, self.prompt_format = reward_pool, reward_timeout, prompt_format

    def prompt_ids(self, data: DataItem) -> list[int]:
        return prompt_ids_of(self.tokenizer, data, self.prompt_format)

    async def reward(
        self,
        engine: InferenceEngine,
        resp: ModelResponse,
        data: DataItem,
        prompt_ids: list[int] | None = None,
        completion_ids: list[int] | None = None,
    ) -> float:
        """``compute_reward`` of ``resp`` (scored on ``prompt_ids`` / ``completion_ids`` when given)."""
        args = (self.reward_fn, engine, self.tokenizer, resp, data, self.reward_pool, self.reward_timeout)
        return await compute_reward(*args, prompt_ids=prompt_ids, completion_ids=completion_ids)


class RLVRWorkflow(PromptWorkflow):
    """Chat-templated prompt -> one sample -> reward; adds sequence-level ``truncated``
    (True when the completion hit ``max_new_tokens``)."""

    async def arun_episode(self, engine: InferenceEngine, data: DataItem) -> Trajectory | None:
        vp = row_vision(data)  # a row with images (relayrl.data.datasets.attach_vision)
        ids = vp.input_ids if vp is not None else self.prompt_ids(data)
        images: list[str | bytes] = list(vp.image_data) if vp is not None else []
        req = ModelRequest(rid=uuid.uuid4().hex, input_ids=ids, gconfig=self.gconfig, image_data=images)
        resp = await engine.agenerate(req)
        if resp.output_len == 0:
            return None  # nothing to train on
        reward = await self.reward(engine, resp, data)
        extras = {"truncated": torch.tensor([resp.stop_reason == "length"], dtype=torch.bool)}
        if vp is not None:  # the trainer's vision inputs travel with the episode
            extras.update(pixel_values=vp.vision.pixel_values[None], image_grid_thw=vp.vision.image_grid_thw[None])
        return trajectory_from_response(resp, reward, **extras)
