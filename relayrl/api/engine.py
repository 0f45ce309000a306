"""The two engine contracts: one generates tokens, one turns batches into gradients.

Algorithm code talks only to these interfaces, so the same actor runs on one process or on
FSDP2, and the same workflow runs against an in-process engine or a fleet of servers.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from typing import Self

import torch

from relayrl.api.io import GenerationConfig, ModelRequest, ModelResponse, SaveLoadMeta, StreamChunk, WeightUpdate

TensorDict = dict[str, torch.Tensor]
"""A batch: token-level tensors ``[B, L]`` and sequence-level tensors ``[B]`` (see workflow.py)."""

DataItem = dict[str, object]
"""One dataset row as handed to a workflow (e.g. ``{"messages": [...], "answer": "42"}``)."""

LossFn = Callable[[torch.Tensor, TensorDict], torch.Tensor]
"""``loss_fn(logits, packed_batch) -> scalar``.

``logits`` is ``[T, V]`` for one packed micro-batch (``T`` tokens of several sequences laid
end to end; ``packed_batch["cu_seqlens"]`` marks the boundaries). ``logits[i]`` predicts
token ``i + 1``. Every token-level key of ``packed_batch`` is token-aligned: ``key[i]``
belongs to ``input_ids[i]`` (``loss_mask[i] == 1`` when token ``i`` was generated).
``relayrl.train.packing.token_logprobs`` turns logits into token-aligned logprobs.
Sequence-level keys (``rewards``) stay ``[n_seqs]``.

A loss marked with ``relayrl.train.lmhead.token_stats_loss`` (it uses its first argument only
through ``token_logprobs`` / ``token_entropy``, at loss tokens) may get a ``TokenStats`` instead:
the LM head computed only at loss positions (docs/write_a_loss.md). Unmarked losses get logits.
"""

LossWeightFn = Callable[[TensorDict], float]
"""Weight of a micro-batch in the batch's loss, e.g. its number of loss tokens.

``train_batch`` computes ``sum_mb loss_fn(mb) * w(mb) / sum_mb w(mb)``, so a loss that
averages over the tokens of its micro-batch gives exactly the unsplit batch's gradient.
"""

PostFn = Callable[[torch.Tensor, TensorDict], torch.Tensor]
"""``post_fn(logits, packed_batch) -> [T]`` token-aligned values (see ``TrainEngine.forward``)."""


class InferenceEngine(abc.ABC):
    """Generates tokens with per-token logprobs and weight versions.

    Implementations: ``inference.local.LocalEngine`` (in-process) and
    ``inference.remote.RemoteEngine`` (HTTP to relayrl / SGLang / vLLM servers).

    Episodes are run by a ``rollout.WorkflowExecutor(config, engine)``: its ``submit`` / ``wait`` /
    ``rollout_batch`` / ``prepare_batch`` are the rollout verbs (the engine does not forward them,
    so there is one way to call them and no back-reference from engine to executor).
    """

    # True when the engine takes LoRA adapters (``WeightUpdate(kind="adapter")``) instead of merged
    # weights: set by RemoteEngine at connect for SGLang / vLLM servers with ``model.lora.sync`` adapter
    accepts_adapters: bool = False

    @abc.abstractmethod
    def initialize(self) -> None:
        """Load the model / connect to servers. Called once before use."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release threads, processes and connections. Safe to call twice."""

    def __enter__(self) -> Self:
        """``with engine:`` initializes it, and destroys it on the way out."""
        self.initialize()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one completion. Callable from any asyncio loop and thread.

        If weights change while the request runs, generation is interrupted and
        transparently continued under the new weights (prompt + partial output), so the
        response may carry tokens of several versions, each tagged in ``output_versions``.
        One request, one completion, one return type: for n samples of a prompt send n requests concurrently;
        engines share the prompt's work between them (LocalEngine prefills it once), and
        ``RLVRWorkflow`` does this for ``rollout.group_size``.
        """

    async def astream(self, req: ModelRequest) -> AsyncIterator[StreamChunk]:
        """``agenerate`` with the tokens handed out as they are generated; the last chunk carries the
        response. Engines that cannot stream (this default) send the whole completion as one chunk."""
        resp = await self.agenerate(req)
        yield StreamChunk(list(resp.output_tokens), resp)

    async def atop_logprobs(
        self, prompt: list[int], output: list[int], gconfig: GenerationConfig, k: int
    ) -> list[list[tuple[int, float]]]:
        """The ``k`` most likely tokens and their logprobs at each output position, under the
        distribution ``gconfig`` samples from (OpenAI's ``top_logprobs``). Engines that return only
        the sampled token's logprob (this default) refuse."""
        raise NotImplementedError(
            f"{type(self).__name__} returns the sampled token's logprob only (top_logprobs needs the model in-process)"
        )

    @abc.abstractmethod
    def update_weights(self, update: WeightUpdate) -> None:
        """Apply new weights (blocking) and set the version to ``update.version``."""

    _version = 0  # the version of the weights served (update_weights sets it)

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop scheduling new decode steps (in-flight requests wait, nothing is lost)."""

    @abc.abstractmethod
    def resume(self) -> None: ...

    # What the trainer asks every engine; the defaults suit an engine with nothing to report or restore.
    def stats(self) -> dict[str, float]:
        """Work and health counters (requests, evictions, live servers ...): the ``inference/*`` metrics."""
        return {}

    def describe(self) -> str:
        """One line of what it is doing now, for the watchdog's stall report (never blocks)."""
        return ", ".join(f"{k}={v:g}" for k, v in self.stats().items()) or type(self).__name__

    def state_dict(self) -> dict[str, int]:
        """Generation state worth restoring (LocalEngine: the sampling stream's position)."""
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore ``state_dict()``; the trainer sets it per step so resumed runs sample as uninterrupted ones."""
        return None  # default: nothing to do

    def can_release_memory(self) -> bool:
        """Whether ``release_memory()`` frees device memory a trainer on the same device can use."""
        return False

    def release_memory(self) -> None:
        """Free generation memory (KV cache) until ``resume_memory()``; in-flight requests wait."""
        return None  # default: nothing to do

    def resume_memory(self) -> None:
        """Undo ``release_memory()``."""
        return None  # default: nothing to do


class TrainEngine(abc.ABC):
    """Turns padded batches (the Trajectory format) into forward values and gradient steps.

    Implementations pack each micro-batch into one 1D sequence (``cu_seqlens``, restarting
    positions) and split batches by token budget; callers never see packing except in the
    ``loss_fn`` / ``post_fn`` they pass.
    """

    @abc.abstractmethod
    def initialize(self) -> None:
        """Build model and optimizer (and the process group under torch.distributed)."""

    @abc.abstractmethod
    def destroy(self) -> None: ...

    @abc.abstractmethod
    def train(self, mode: bool = True) -> None:
        """Training mode (dropout, gradient checkpointing on)."""

    def eval(self) -> None:
        self.train(False)

    @abc.abstractmethod
    def forward(self, batch: TensorDict, post_fn: PostFn | None = None, temperature: float = 1.0) -> torch.Tensor:
        """No-grad forward over a padded batch; returns ``[B, L]`` token-aligned values.

        Default ``post_fn``: log pi(input_ids[t] | input_ids[:t]) at ``temperature``
        (0 at position 0 of each sequence and on padding).
        """

    @abc.abstractmethod
    def train_batch(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """One optimizer step over the whole batch (split into micro-batches by tokens).

        Returns stats including ``loss``, ``grad_norm``, ``lr`` (the rate this step used) and
        ``skipped`` (1.0 when the NaN/inf guard skipped the step). The LR schedule advances
        once per call, here, so no training loop has to remember to step it.
        """

    @abc.abstractmethod
    def eval_batch(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> float:
        """The weighted loss of the batch, no gradient."""

    @abc.abstractmethod
    def save(self, meta: SaveLoadMeta) -> None: ...

    @abc.abstractmethod
    def load(self, meta: SaveLoadMeta) -> None: ...

    @abc.abstractmethod
    def update_weights(self, target: InferenceEngine | None) -> None:
        """Push current weights to ``target`` (version = this engine's version); a collective under
        torch.distributed, where ranks without generators pass None."""

    @abc.abstractmethod
    def get_version(self) -> int: ...

    @abc.abstractmethod
    def set_version(self, version: int) -> None: ...
