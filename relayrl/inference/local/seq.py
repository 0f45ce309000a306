"""Pieces of LocalEngine that need none of its state: a request's record, the thread-safe
future resolver and reading a checkpoint directory's weights."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from relayrl.api.io import GenerationConfig, ModelResponse, StopReason
from relayrl.data.vision import VisionInputs

# one prefill's result: per-layer (keys, values), padding mask [n, L], last logits [n, V]
Prefilled = tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]


@dataclass
class Seq:
    """One request inside the engine (a continuation carries its earlier output)."""

    prompt: list[int]
    g: GenerationConfig
    key: int
    on_done: Callable[[ModelResponse | BaseException], None]  # an exception: the request's future raises it
    rid: str = ""
    cancelled: bool = False  # aborted by rid: ends as "abort", never continued
    on_token: Callable[[int], None] | None = None  # streaming: called on the loop thread with each new token
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0
    stop_ids: frozenset[int] = frozenset()
    routes: list[torch.Tensor] = field(default_factory=list)  # MoE: expert ids [n, layers, k] of the tokens run
    vision: VisionInputs | None = None  # the prompt's images, processed (see ``vision.py``)
    vision_key: str = ""  # digest of the request's images: equal prompts share a prefill only with equal images
    rope_delta: int = 0  # M-RoPE: decode position = tokens so far + rope_delta (0 without images)

    def finished(self, tok: int, tokenizer: PreTrainedTokenizerBase | None) -> StopReason | None:
        """Why this request ends after appending ``tok`` (None: it goes on)."""
        g, n = self.g, len(self.out)
        if n >= g.min_new_tokens and tok in self.stop_ids:
            return "stop"
        if g.stop and n >= g.min_new_tokens:
            longest = max(len(s) for s in g.stop)
            assert tokenizer is not None, "stop strings need a tokenizer"
            tail = str(tokenizer.decode(self.out[-(longest + 8) :]))
            if any(s in tail for s in g.stop):
                return "stop"
        if n >= g.max_new_tokens:
            return "length"
        return None

    def response(self, reason: StopReason) -> ModelResponse:
        now = time.perf_counter()
        return ModelResponse(
            input_tokens=list(self.prompt),
            output_tokens=list(self.out),
            output_logprobs=list(self.logprobs),
            output_versions=list(self.versions),
            stop_reason=reason,
            latency=now - self.submitted,
            ttft=(self.first_token_at or now) - self.submitted,
            routed_experts=torch.cat(self.routes) if self.routes else None,
        )


def load_hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the ``model*.safetensors`` files of a Hugging Face checkpoint directory."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "model*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors files in checkpoint directory {path!r}")
    return {name: tensor for file in files for name, tensor in load_file(file).items()}


def resolver(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[ModelResponse]
) -> Callable[[ModelResponse | BaseException], None]:
    """A callback, safe from any thread, that resolves ``fut`` (or fails it with an exception)."""

    def settle(result: ModelResponse | BaseException) -> None:
        if fut.done():
            return
        if isinstance(result, BaseException):
            fut.set_exception(result)
        else:
            fut.set_result(result)

    def done(result: ModelResponse | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(settle, result)

    return done
