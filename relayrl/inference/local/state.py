"""The state LocalEngine's parts share, declared once (for readers and the type checker).

``LocalEngine`` (``engine.py``: lifecycle, the loop, weights) sets every field; its running batch
(``slab.py``), request checks and control (``requests.py``) and memory release (``memory.py``) are mixins over
``EngineState`` that use them on the loop thread. The fields stay on the engine, not in an object it
holds: the mixins are parts of one engine on one thread, and the decode loop reads them every step.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from relayrl.api.config import InferenceConfig
from relayrl.api.io import ModelResponse
from relayrl.inference.local.decode import FastDecoder
from relayrl.inference.local.graphs import StaticDecoder
from relayrl.inference.local.sampling import RowParams
from relayrl.inference.local.seq import Seq
from relayrl.utils.moe import RoutingRecorder


class EngineState:
    """What ``LocalEngine`` holds and its mixins use (see the module docstring)."""

    config: InferenceConfig
    model: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase | None
    device: torch.device
    vocab_size: int
    max_positions: int
    kv_capacity: int
    kv_capacity_by: str
    counters: dict[str, int]
    _waiting: queue.Queue[Seq]
    _wake: threading.Condition
    _released: bool
    # the running batch (touched only by the loop thread; slab.py)
    _rows: list[Seq]
    _alive: list[bool]  # finished rows stay in _rows (not alive) until the batch is compacted
    _preempted: deque[Seq]
    _params: RowParams | None
    _cache: DynamicCache | None
    _mask: torch.Tensor
    _mask_bool: torch.Tensor
    _pos: torch.Tensor
    _logits: torch.Tensor
    _fast: FastDecoder | None
    _static: StaticDecoder | None
    _static_stale: bool
    _mask_dict: bool
    _router: RoutingRecorder | None
    _router_shape: tuple[int, int]
    _route: torch.Tensor | None  # MoE: the experts of each row's newest token (from the last decode)
    _keep_arg: dict[str, int]
    # LocalEngine's methods the mixins call
    _generate: Callable[..., Awaitable[ModelResponse]]
    _call_in_loop: Callable[[Callable[[], Any]], Any]  # run on the loop thread, wait for its result
    _preempt_all: Callable[[], None]  # set the running rows aside
