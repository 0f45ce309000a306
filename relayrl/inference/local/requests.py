"""Requests in LocalEngine beyond ``agenerate`` (mixed into ``LocalEngine``): checked against the engine's
limits (``_validate``), streamed token by token (``astream``), OpenAI's ``top_logprobs`` recomputed from the
model (``atop_logprobs``) and SGLang's single-request abort (``abort_rid``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch

from relayrl.api.io import GenerationConfig, ModelRequest, StreamChunk
from relayrl.inference.local.sampling import top_logprobs
from relayrl.inference.local.seq import Seq
from relayrl.inference.local.state import EngineState


class RequestControl(EngineState):
    """Request checks, streaming, top logprobs and single-request aborts over ``LocalEngine``'s state."""

    def _validate(self, req: ModelRequest) -> None:
        """``ValueError`` naming the request and the field when ``req`` asks what this engine cannot give
        (checked before it queues, so a bad request fails alone)."""
        ids, g, at, vocab = req.input_ids, req.gconfig, f"request {req.rid!r}", self.vocab_size
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"{at}: input_ids must be a non-empty list of token ids")
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"{at}: input_ids[{i}]={t!r} is not a token id in [0, {vocab})")
        if not isinstance(g, GenerationConfig):
            raise ValueError(f"{at}: gconfig must be a GenerationConfig, got {type(g).__name__}")
        try:
            g.validate()
        except ValueError as e:
            raise ValueError(f"{at}: gconfig.{e}") from None
        if any(t >= vocab for t in g.stop_token_ids):
            raise ValueError(f"{at}: gconfig.stop_token_ids {g.stop_token_ids} has ids >= vocab size {vocab}")
        if g.stop and self.tokenizer is None:
            raise ValueError(f"{at}: gconfig.stop (stop strings) needs the engine to have a tokenizer")
        need = f"{at}: prompt length {len(ids)} + max_new_tokens {g.max_new_tokens}"
        if len(ids) + g.max_new_tokens > self.max_positions:
            raise ValueError(f"{need} exceeds the model's max_position_embeddings {self.max_positions}")
        if len(ids) + g.max_new_tokens > self.kv_capacity:
            raise ValueError(f"{need} cannot fit in the KV cache of {self.kv_capacity} tokens ({self.kv_capacity_by})")

    async def astream(self, req: ModelRequest) -> AsyncIterator[StreamChunk]:
        """Token by token (one chunk per generated token), then the response."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[int | None] = asyncio.Queue()

        def push(tok: int) -> None:  # on the engine's thread
            loop.call_soon_threadsafe(q.put_nowait, tok)

        task = asyncio.ensure_future(self._generate(req, True, on_token=push))
        task.add_done_callback(lambda _: q.put_nowait(None))  # after every token: they were scheduled first
        while (tok := await q.get()) is not None:  # one chunk per token, whatever the consumer's pace
            yield StreamChunk([tok])
        yield StreamChunk([], await task)

    async def atop_logprobs(
        self, prompt: list[int], output: list[int], gconfig: GenerationConfig, k: int
    ) -> list[list[tuple[int, float]]]:
        """Recomputed from the model on the loop thread: penalties, temperature and top-k/top-p as sampled."""
        if not output:
            return []

        def score() -> torch.Tensor:
            assert self.model is not None
            seq = torch.tensor([prompt + output], device=self.device)
            return self.model(seq).logits[0, len(prompt) - 1 : -1].float()

        return top_logprobs(await asyncio.to_thread(self._call_in_loop, score), output, gconfig, k)

    async def aprompt_logprobs(
        self, ids: list[int], start: int, k: int
    ) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
        """A teacher-forced forward of ``ids`` on the loop thread (between steps: the weights a request
        would see), at temperature 1: each token's logprob from position ``start`` (None at position 0,
        which nothing predicts) and, for ``k`` > 0, the ``k`` most likely (id, logprob) there."""

        def score() -> torch.Tensor:
            assert self.model is not None  # (_call_in_loop runs it in inference mode)
            logits = self.model(torch.tensor([ids], device=self.device), use_cache=False).logits[0, :-1]
            return torch.log_softmax(logits[max(start, 1) - 1 :].float(), -1).cpu()  # row t - 1: token t's distribution

        logp = await asyncio.to_thread(self._call_in_loop, score)
        picked = logp.gather(-1, torch.tensor(ids[max(start, 1) :]).unsqueeze(-1)).squeeze(-1).tolist()
        first: list[float | None] = [None] if start == 0 else []
        if k == 0:
            return first + picked, []
        vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
        tops = [[(int(j), float(v)) for v, j in zip(vr, ir, strict=True)] for vr, ir in zip(vals, idx, strict=True)]
        return first + picked, ([[]] if start == 0 else []) + tops

    def abort_rid(self, rid: str) -> int:
        """End the requests with this rid (running, set aside or queued) with stop_reason ``abort``
        and their partial output, not continued (SGLang's single-request abort); returns how many."""
        found: list[Seq] = []

        def apply() -> None:
            for i, seq in enumerate(self._rows):
                if self._alive[i] and seq.rid == rid:
                    self._alive[i] = False
                    found.append(seq)
            with self._waiting.mutex:
                for waiting in (self._preempted, self._waiting.queue):  # set aside, queued
                    found.extend(s for s in waiting if s.rid == rid)
                    kept = [s for s in waiting if s.rid != rid]
                    waiting.clear()
                    waiting.extend(kept)
            for seq in found:
                seq.cancelled = True
                seq.on_done(seq.response("abort"))
            self.counters["aborts"] += len(found)

        self._call_in_loop(apply)
        return len(found)
