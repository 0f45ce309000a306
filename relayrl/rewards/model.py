"""A learned reward model as a reward fn that scores many completions in one forward.

``TorchTrainEngine.as_reward_fn()`` (``head="reward"``) returns a ``RewardModelFn``. It is an async
reward fn (``await fn(engine, prompt=..., completions=..., prompt_ids=..., completion_ids=..., **row)``),
so the RLVR workflow awaits it on the event loop instead of calling it once per completion: every
call made before the loop next runs its ready callbacks (a group's completions, which the generator
returns together; episodes finishing in the same turn) joins one right-padded batch of at most
``max_batch`` sequences, scored by the engine's ``score`` (last-token value). Scoring one sequence at a
time cost the 5M-parameter stand-in in ``recipes/reward_model.py`` more than the policy's own step.

The batch runs inline on the loop, as a synchronous reward fn would: a reward model is a forward,
not a hang risk, and the loop has nothing else to do while it runs on a machine without a GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch
from torch.nn.utils.rnn import pad_sequence

from relayrl.api.engine import InferenceEngine

Scorer = Callable[[dict[str, torch.Tensor]], torch.Tensor]


class RewardModelFn:
    """``score``: ``{"input_ids", "attention_mask"}`` (right-padded) -> ``[B]`` scores."""

    def __init__(self, score: Scorer, max_batch: int = 64) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.score, self.max_batch = score, max_batch
        # per event loop: a future belongs to the loop that made it (eval may run on another one)
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[list[int], asyncio.Future[float]]]] = {}
        self.batches = 0  # forwards run (the tests read it)

    async def __call__(
        self,
        engine: InferenceEngine | None,
        prompt: str = "",
        completions: str = "",
        prompt_ids: list[int] | None = None,
        completion_ids: list[int] | None = None,
        **data: object,
    ) -> float:
        ids = [*(prompt_ids or []), *(completion_ids or [])]
        if not ids:
            raise ValueError("a reward model scores token ids: prompt_ids + completion_ids is empty")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[float] = loop.create_future()
        pending = self._pending.setdefault(loop, [])
        pending.append((ids, fut))
        if len(pending) == 1:  # the first call of this turn schedules the batch
            loop.call_soon(self._flush, loop)
        return await fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        pending = self._pending.pop(loop, [])
        for i in range(0, len(pending), self.max_batch):
            chunk = [(ids, fut) for ids, fut in pending[i : i + self.max_batch] if not fut.done()]  # not cancelled
            if not chunk:
                continue
            try:
                scores = self.score_ids([ids for ids, _ in chunk])
            except Exception as e:  # each waiting episode fails with it (counted); the run goes on
                for _, fut in chunk:
                    fut.set_exception(e)
                continue
            for (_, fut), s in zip(chunk, scores, strict=True):
                fut.set_result(s)

    @torch.no_grad()
    def score_ids(self, seqs: list[list[int]]) -> list[float]:
        """Scores of token-id sequences, in one right-padded forward."""
        input_ids = pad_sequence([torch.tensor(s, dtype=torch.int64) for s in seqs], batch_first=True)
        mask = pad_sequence([torch.ones(len(s), dtype=torch.bool) for s in seqs], batch_first=True)
        self.batches += 1
        return [float(v) for v in self.score({"input_ids": input_ids, "attention_mask": mask})]
