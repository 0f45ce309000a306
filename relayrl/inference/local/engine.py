"""LocalEngine: in-process continuous-batching generation over any HF causal LM.

One background thread owns the model and runs the decode loop::

    admit waiting requests (prefill them in groups of similar length, merge their KV caches into the batch)
    sample one token for every running row (exact logprobs, version tags)
    finished rows leave the batch at once and their futures resolve
    one forward step for the rows that remain

The running batch is a left-padded KV slab on ``inference.device`` (``slab.py``: prefill, merge,
trim, decode step; on CUDA over ``graphs.py``'s static buffers as captured CUDA graphs), so prompts
of any length share it. Its rows x columns stay within ``kv_capacity`` (``device.py``): when they
would not, the latest rows are preempted, set aside and continued later from prompt + output.

``agenerate`` is callable from any thread and asyncio loop: it queues the request and awaits
a future the loop thread resolves through ``loop.call_soon_threadsafe``. A weight update
pauses the loop at a step boundary, loads the weights and bumps the version; the requests
that were running end with ``stop_reason="abort"`` and ``agenerate`` continues them under
the new weights (prompt + partial output), so one response can carry several versions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import sys
import threading
import time
import typing
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from relayrl.api.config import InferenceConfig, ModelConfig
from relayrl.api.engine import InferenceEngine
from relayrl.api.io import ModelRequest, ModelResponse, WeightUpdate
from relayrl.data.vision import is_vision_config, load_image_processor
from relayrl.inference.local.decode import FastDecoder
from relayrl.inference.local.device import accepts_mask_dict, kv_capacity, resolve_device, takes_logits_to_keep
from relayrl.inference.local.graphs import Kernels, StaticDecoder
from relayrl.inference.local.memory import MemoryRelease
from relayrl.inference.local.requests import RequestControl
from relayrl.inference.local.sampling import RowParams, penalized, sample
from relayrl.inference.local.seq import Seq, load_hf_state_dict, resolver
from relayrl.inference.local.slab import SlabBatch
from relayrl.inference.local.vision import image_key, request_vision
from relayrl.utils.batching import length_groups
from relayrl.utils.moe import RoutingRecorder, routing_shape

if typing.TYPE_CHECKING:
    from transformers.image_processing_utils import BaseImageProcessor

T = typing.TypeVar("T")


class LocalEngine(RequestControl, SlabBatch, MemoryRelease, InferenceEngine):
    """Continuous-batching ``InferenceEngine`` in this process (see module docstring)."""

    def __init__(
        self,
        config: InferenceConfig,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        model_config: ModelConfig | None = None,
        static_steps: bool | None = None,
        image_processor: BaseImageProcessor | None = None,
        kernels: Kernels | None = None,
    ) -> None:
        """``static_steps``: decode over ``StaticDecoder``'s bucketed buffers (None: on CUDA with
        ``inference.cuda_graphs``; True on CPU runs the same step eagerly, as tests do).
        ``kernels``: the static step's CUDA graph capture and flash-attn kernel (None: what the
        device has, ``Kernels.for_device``; capture only with ``inference.cuda_graphs``)."""
        if model is None and model_config is None:
            raise ValueError("LocalEngine needs a `model` or a `model_config` to load one from")
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.image_processor = image_processor  # vision models: turns a request's image_data into pixels
        # prefills: forwards run to admit requests; prefill_rows / prefill_unique: rows admitted / rows computed;
        # prefill_shared_tokens: prompt tokens not recomputed because every row of a prefill starts with them
        # preemptions: rows set aside (and continued later) because the KV cache was full
        # kv_peak: most KV slab cells (rows x columns) held
        self.counters = dict.fromkeys(
            "requests aborts tokens steps prefills prefill_rows prefill_unique prefill_shared_tokens preemptions "
            "kv_peak".split(),
            0,
        )
        self.device = torch.device("cpu")
        self.kv_capacity, self.kv_capacity_by = config.max_tokens_in_flight, "inference.max_tokens_in_flight"
        self._waiting = queue.Queue()
        self._control: queue.Queue[tuple[Callable[[], object], Future[object]]] = queue.Queue()
        self._wake = threading.Condition()
        self._paused = False
        self._released = False  # release_memory(): no KV cache, no stepping until resume_memory()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._keys = itertools.count()
        self._key_lock = threading.Lock()
        # running batch state (touched only by the loop thread; its empty form: slab.SlabBatch._reset_batch)
        self._reset_batch()
        self._preempted = deque()  # set aside when the KV cache was full; admitted first
        self._logits = torch.zeros(0, 0)
        self._fast = None
        self.static_steps = static_steps
        self._router = None  # MoE models: records the experts of every token run
        self._router_shape = (0, 0)
        self.routing_shape: tuple[int, int] | None = None  # (n_moe_layers, top_k) of an MoE model
        self.kernels = kernels
        self._static = None

    # ------------------------------------------------------------------ lifecycle
    def initialize(self) -> None:
        """Load the model (if only a config was given) and start the loop thread."""
        if self._thread is not None:
            return
        if self.model is None:
            from relayrl.data.models import load_model, load_tokenizer

            assert self.model_config is not None
            self.model = load_model(self.model_config, seed=self.config.seed)
            if self.tokenizer is None:
                self.tokenizer = load_tokenizer(self.model_config)
        if self.image_processor is None and self.model_config is not None and is_vision_config(self.model.config):
            self.image_processor = load_image_processor(self.model_config.path)
        self.device = resolve_device(self.config.device)
        typing.cast(nn.Module, self.model).to(self.device)  # (transformers types PreTrainedModel.to oddly)
        self.model.eval()
        cfg = self.model.config
        self.vocab_size = int(cfg.get_text_config().vocab_size)
        self.image_token_id = int(cfg.image_token_id) if is_vision_config(cfg) else -1
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = cfg.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        layer_types = getattr(cfg.get_text_config(), "layer_types", None) or ["full_attention"]
        self._full_attention_only = all(t == "full_attention" for t in layer_types)
        self._fast = FastDecoder(self.model) if self.config.fast_decode and FastDecoder.supports(self.model) else None
        static = (
            self.device.type == "cuda" and self.config.cuda_graphs if self.static_steps is None else self.static_steps
        )
        if static and self._fast is not None:
            dtype, graphs = next(self.model.parameters()).dtype, self.config.cuda_graphs
            kernels = self.kernels or Kernels.for_device(self.device, dtype, graphs)
            if not graphs:
                kernels = Kernels(None, kernels.flash_decode)
            self._static = StaticDecoder(self._fast, kernels)
        # generic path: a ready 4D mask where the model takes one, else transformers builds masks from the 2D one
        self._mask_dict = (
            self._fast is None and self._full_attention_only and accepts_mask_dict(self.model, self.device)
        )
        shape = self.routing_shape = routing_shape(self.model)
        if shape is not None and self._router is None:
            self._router, self._router_shape = RoutingRecorder(self.model), shape
        self._keep_arg = {"logits_to_keep": 1} if takes_logits_to_keep(self.model) else {}
        self.kv_capacity, self.kv_capacity_by = kv_capacity(
            self.model, self.device, self.config.kv_cache_fraction, self.config.max_tokens_in_flight
        )
        self._reset_batch()
        self.max_positions = int(getattr(cfg.get_text_config(), "max_position_embeddings", 1 << 30))
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="LocalEngine-loop", daemon=True)
        self._thread.start()

    def destroy(self) -> None:
        """Stop the loop; requests still queued or running end with ``stop_reason="abort"``."""
        if self._thread is None:
            return
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        self._thread.join()
        self._thread = None

    # ------------------------------------------------------------------ generation
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one completion; continues transparently across weight updates."""
        return await self._generate(req, continue_aborted=True)

    async def agenerate_once(self, req: ModelRequest) -> ModelResponse:
        """One pass: a request interrupted (weight update, aborting pause) ends with stop_reason
        ``abort`` and its partial output, as SGLang's /generate answers; the client continues it."""
        return await self._generate(req, continue_aborted=False)

    async def _generate(
        self, req: ModelRequest, continue_aborted: bool, on_token: Callable[[int], None] | None = None
    ) -> ModelResponse:
        if self._thread is None:
            raise RuntimeError("LocalEngine.agenerate called before initialize() (or after destroy())")
        self._validate(req)
        loop = asyncio.get_running_loop()
        with self._key_lock:
            key = self.config.seed * 1_000_003 + next(self._keys)
        self.counters["requests"] += 1
        start = time.perf_counter()
        vision = None
        if req.image_data or self.image_token_id >= 0:  # decoding and processing images: off the caller's loop
            processor = self.image_processor if self.image_token_id >= 0 else None
            vision = await asyncio.to_thread(request_vision, req, processor, self.image_token_id)
        seq = Seq(
            prompt=list(req.input_ids),
            g=req.gconfig,
            key=key,
            on_done=lambda r: None,
            rid=req.rid,
            on_token=on_token,
            vision=vision,
        )
        seq.vision_key = image_key(req.image_data)
        ttft = 0.0
        while True:
            fut: asyncio.Future[ModelResponse] = loop.create_future()
            seq.on_done = resolver(loop, fut)
            self._enqueue(seq)
            resp = await fut
            ttft = ttft or (resp.ttft + seq.submitted - start if resp.output_tokens else 0.0)
            if resp.stop_reason != "abort" or self._stopped or not continue_aborted or seq.cancelled:
                break
            # interrupted by a weight update: the same request again from prompt + partial output, timed anew
            seq = dataclasses.replace(
                seq,
                out=resp.output_tokens,
                logprobs=resp.output_logprobs,
                versions=resp.output_versions,
                submitted=time.perf_counter(),
                first_token_at=0.0,
            )
        resp.latency = time.perf_counter() - start
        resp.ttft = ttft or resp.latency
        return resp

    def _enqueue(self, seq: Seq) -> None:
        seq.stop_ids = frozenset(seq.g.stop_token_ids) | (frozenset() if seq.g.ignore_eos else self.eos_ids)
        with self._wake:
            if self._stopped:
                seq.on_done(seq.response("abort"))
                return
            self._waiting.put(seq)
            self._wake.notify_all()

    # ------------------------------------------------------------------ weights and control
    def update_weights(self, update: WeightUpdate) -> None:
        """Load new weights between decode steps and set the version (blocking)."""
        if update.kind == "tensors":
            assert update.tensors is not None
            state = update.tensors
        elif update.kind == "disk":
            state = load_hf_state_dict(update.path)
        else:
            raise ValueError(f"LocalEngine cannot apply WeightUpdate(kind={update.kind!r}); use 'tensors' or 'disk'")

        def apply() -> None:
            self._load_state(state)
            self._abort_running()
            self._version = update.version

        self._call_in_loop(apply)

    def abort_running(self) -> None:
        """End every running request now with stop_reason ``abort`` and its partial output
        (``agenerate`` continues it; ``agenerate_once`` returns it)."""
        self._call_in_loop(self._abort_running)

    def _load_state(self, state: dict[str, torch.Tensor]) -> None:
        assert self.model is not None
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or []) | {"lm_head.weight"}
        tie = bool(getattr(self.model.config.get_text_config(), "tie_word_embeddings", False))
        bad_missing = [k for k in missing if not (tie and k in tied)]
        if unexpected or bad_missing:
            raise ValueError(
                f"weight update does not match the model: missing {bad_missing[:5]}, unexpected {unexpected[:5]}"
            )
        if tie:
            self.model.tie_weights()
        if self._fast is not None:
            self._fast.refresh()
        if self._static is not None:  # the graphs point at the old fused weights
            self._static.reset()
            self._static_stale = True

    def _call_in_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the loop thread at a step boundary (or here if no loop runs); its error raises here."""
        if self._thread is None or threading.current_thread() is self._thread:
            with torch.inference_mode():
                return fn()
        done: Future[T] = Future()
        with self._wake:
            self._control.put((fn, typing.cast(Future[object], done)))
            self._wake.notify_all()
        return done.result()

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.counters.items()}

    def can_release_memory(self) -> bool:
        return self.device.type == "cuda"

    def state_dict(self) -> dict[str, int]:
        """The sampling stream's position (requests draw keys in arrival order). The trainer
        sets it per step so that resumed runs sample exactly like uninterrupted ones."""
        with self._key_lock:
            nxt = next(self._keys)
            self._keys = itertools.count(nxt)
        return {"next_key": nxt}

    def load_state_dict(self, state: dict[str, int]) -> None:
        with self._key_lock:
            self._keys = itertools.count(int(state["next_key"]))

    def pause(self) -> None:
        """Stop after the current decode step; running and queued requests wait."""
        with self._wake:
            self._paused = True
        self._call_in_loop(lambda: None)  # returns once the loop reached a step boundary

    def resume(self) -> None:
        with self._wake:
            self._paused = False
            self._wake.notify_all()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    self._wake.wait_for(self._has_work)
                    stopped = self._stopped
                self._run_control()
                if stopped:
                    break
                if self._paused or self._released:
                    continue
                try:
                    self._step()
                except torch.OutOfMemoryError as e:  # the cache outgrew the memory: shrink it, keep the requests
                    self._shrink_after_oom(e)
                except Exception as e:  # a model error fails the running requests, not the engine
                    for seq in self._take_running():
                        seq.on_done(e)  # the future raises it
            self._abort_running()
            while not self._waiting.empty():
                seq = self._waiting.get()
                seq.on_done(seq.response("abort"))
            self._run_control()

    def _has_work(self) -> bool:
        """Stop, a control call, or rows to step (none while paused or released): what wakes the loop."""
        idle = self._paused or self._released or (not self._rows and not self._preempted and self._waiting.empty())
        return self._stopped or not self._control.empty() or not idle

    def _run_control(self) -> None:
        while not self._control.empty():
            fn, done = self._control.get()
            try:
                done.set_result(fn())
            except BaseException as e:  # handed back to the caller's thread
                done.set_exception(e)

    def _take_running(self) -> list[Seq]:
        """The rows still running (finished ones stay in ``_rows`` until compaction); the batch is emptied."""
        rows = [seq for seq, alive in zip(self._rows, self._alive, strict=True) if alive]
        self._reset_batch()
        return rows

    def _abort_running(self) -> None:
        rows = self._take_running() + list(self._preempted)
        self.counters["aborts"] += len(rows)
        self._preempted.clear()
        for seq in rows:
            seq.on_done(seq.response("abort"))

    def _shrink_after_oom(self, error: torch.OutOfMemoryError) -> None:
        """Out of memory in a decode step: lower ``kv_capacity`` below what the batch held and set
        every running row aside (continued under the lower budget); with nothing to give up, fail."""
        held = len(self._rows) * self._mask.shape[1]
        if not any(self._alive) or held * 9 // 10 < 16:
            for seq in self._take_running():
                seq.on_done(RuntimeError(f"out of memory on {self.device} with {held} KV tokens held: {error}"))
            return
        self.kv_capacity = min(self.kv_capacity, held * 9 // 10)
        self.kv_capacity_by = f"lowered after running out of memory on {self.device} with {held} KV tokens held"
        self._preempt_all()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _preempt_all(self) -> None:
        """Set every running row aside (continued from prompt + output when admitted again)."""
        rows = self._take_running()
        self.counters["preemptions"] += len(rows)
        self._preempted.extendleft(reversed(rows))

    def _step(self) -> None:
        if not self._rows:
            self._coalesce()
        self._admit()
        if not self._rows:
            return
        tokens, logprobs = self._sample()
        assert self._params is not None
        self._params.counters += 1  # the next token of every row uses the next uniform
        self.counters["steps"] += 1
        now = time.perf_counter()
        n, route, self._route = len(self._rows), self._route, None
        parts = [tokens.double(), logprobs.double()] + ([] if route is None else [route.double().flatten()])
        host = torch.cat(parts).cpu()  # the one device -> host copy per step
        routes = None if route is None else host[2 * n :].view(route.shape).to(torch.int32)
        for i, (seq, tok, lp) in enumerate(
            zip(self._rows, host[:n].long().tolist(), host[n : 2 * n].tolist(), strict=True)
        ):
            if not self._alive[i]:
                continue
            if routes is not None and i < routes.shape[0]:  # rows merged this step were just prefilled
                seq.routes.append(routes[i : i + 1].clone())  # not a view: it would keep the whole step alive
            if not seq.first_token_at:
                seq.first_token_at = now
            seq.out.append(tok)
            if seq.on_token is not None:
                seq.on_token(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self._version)
            self.counters["tokens"] += 1
            reason = seq.finished(tok, self.tokenizer)
            if reason is not None:  # the future resolves now; the row leaves at the next compaction
                self._alive[i] = False
                seq.on_done(seq.response(reason))
        dead = self._alive.count(False)
        over = len(self._rows) * (self._mask.shape[1] + 1) > self.kv_capacity  # the next column would not fit
        if over or (dead and (dead == len(self._rows) or dead >= len(self._rows) // 8 or not self._waiting.empty())):
            keep = self._fit([i for i, alive in enumerate(self._alive) if alive])
            self._select(keep)
            tokens = tokens[torch.tensor(keep, dtype=torch.long).to(self.device, non_blocking=True)]
        if self._rows:
            self._decode(tokens)

    def _fit(self, keep: list[int]) -> list[int]:
        """The rows of ``keep`` that fit the KV cache after the next column; the latest admitted
        of the others are preempted (set aside and continued later), never dropped."""
        lengths = [len(self._rows[i].prompt) + len(self._rows[i].out) for i in keep]  # cache length after the step
        while len(keep) > 1 and len(keep) * max(lengths) > self.kv_capacity:
            self._preempted.appendleft(self._rows[keep.pop()])
            lengths.pop()
            self.counters["preemptions"] += 1
        return keep

    def _sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows, dev = self._rows, self.device
        if self._params is None:  # rebuilt only when the batch changes; counters advance per step
            self._params = RowParams.of(rows, dev)
        banned = None
        young = [i for i, s in enumerate(rows) if len(s.out) < s.g.min_new_tokens and s.stop_ids and self._alive[i]]
        if young:
            at = [(i, t) for i in young for t in rows[i].stop_ids]
            banned = torch.zeros(self._logits.shape, dtype=torch.bool, device=dev)
            banned[torch.tensor([i for i, _ in at], device=dev), torch.tensor([t for _, t in at], device=dev)] = True
        pen = [i for i, s in enumerate(rows) if (s.g.frequency_penalty or s.g.presence_penalty) and s.out]
        return sample(
            penalized(self._logits, [rows[i] for i in pen], pen) if pen else self._logits, self._params, banned
        )

    # ------------------------------------------------------------------ batch and KV cache
    def _coalesce(self) -> None:
        """Idle engine: wait (up to ``admit_window_ms``) while requests keep arriving. Episodes
        submit one by one; admitting the first at once would prefill a burst piecemeal and
        miss that the samples of a group share their prompt (``_prefill``)."""
        deadline = time.perf_counter() + self.config.admit_window_ms / 1000
        n = self._waiting.qsize()
        while time.perf_counter() < deadline:
            time.sleep(0.0005)
            if self._waiting.qsize() == n:
                return  # nothing arrived during the pause: the burst is over
            n = self._waiting.qsize()

    def _admit(self) -> None:
        """Move set-aside, then waiting requests into the running batch (prefilled in groups of
        similar length) while the left-padded KV slab, rows x columns, fits ``kv_capacity``
        with one more column."""
        new: list[Seq] = []
        width = self._mask.shape[1]
        max_rows = self.config.max_batch_size or sys.maxsize  # 0: the KV budget is the only bound
        while len(self._rows) + len(new) < max_rows and (self._preempted or not self._waiting.empty()):
            seq = self._preempted[0] if self._preempted else self._waiting.queue[0]
            w = max(width, len(seq.prompt) + len(seq.out))
            if (self._rows or new) and (len(self._rows) + len(new) + 1) * (w + 1) > self.kv_capacity:
                break
            new.append(self._preempted.popleft() if self._preempted else self._waiting.get())
            width = w
        if not new:
            return
        groups = [[new[i] for i in g] for g in length_groups([len(s.prompt) + len(s.out) for s in new])]
        parts, new = [], []
        for group in groups:
            for part, seqs in self._prefill_or_fail(group):
                parts.append(part)
                new += seqs  # rows join in prefill order
        if not parts:
            return
        try:
            self._merge(parts, new)
        except BaseException:  # e.g. out of memory: the prefilled requests wait again instead of being lost
            self._preempted.extendleft(reversed(new))
            raise
