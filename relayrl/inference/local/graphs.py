"""The decode step over static buffers at bucketed batch sizes, CUDA-graph captured on CUDA.

A CUDA graph replays fixed kernels on fixed addresses, so the step it captures must see the
same shapes and buffers every time. ``StaticDecoder`` keeps the running batch's KV cache, its
padding mask and the step's inputs in buffers of a bucketed shape: rows rounded up to the next
of ``ROW_BUCKETS``, columns to a multiple of ``COL_STEP``. Rows past the batch are padding
(their logits are ignored); columns past the written ones are masked. The step writes the new
keys/values into column ``col`` (a device scalar, so one graph serves every column of a
bucket), marks it in the mask and attends over the whole bucket. When the batch changes (rows
join or leave, which already copies the cache) or the bucket's columns are used up, ``load``
lays the batch out in the buffers again: the only copies, and none per step.

On CUDA each (rows, columns) bucket is captured once (``inference.cuda_graphs``); elsewhere
the same step runs eagerly, which is how CPU tests check it against the ordinary step.
Attention is SDPA over the masked bucket, or flash-attn's KV-cache kernel
(``flash_attn_with_kvcache`` with per-row left padding) when it is installed on CUDA.

Both CUDA-only pieces come in through ``Kernels`` (the seam tests use to put failing ones in
their place on CPU) and fail safe (``relayrl.utils.failsafe``): the first step runs each against
the eager SDPA step; one that raises or disagrees is dropped for the rest of the run with one
warning, and every later capture that raises drops the graphs the same way.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from collections.abc import Callable

import torch
from torch.nn import functional

from relayrl.inference.local.decode import FastDecoder, SlabLayer
from relayrl.utils.failsafe import check, fall_back, reason

if typing.TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

CUDA_GRAPHS = "CUDA graphs (inference.cuda_graphs)"
FLASH_DECODE = "flash-attn decode (flash_attn_with_kvcache)"
Replay = Callable[[], None]
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]]  # run -> (replay, its output buffer)
FlashDecode = Callable[..., torch.Tensor]  # flash_attn_with_kvcache's signature

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
COL_STEP = 128


def bucket_rows(n: int) -> int:
    """The row bucket of a batch of ``n`` rows (past the largest bucket: the next multiple of 128)."""
    return next((b for b in ROW_BUCKETS if n <= b), -(-n // 128) * 128)


def bucket_cols(n: int, step: int = COL_STEP) -> int:
    """The column bucket holding ``n`` columns."""
    return -(-n // step) * step


def choose_attention(device: torch.device, dtype: torch.dtype, flash_installed: bool | None = None) -> str:
    """``flash_attn`` (the KV-cache kernel) on CUDA in fp16/bf16 when flash-attn is installed, else ``sdpa``."""
    if flash_installed is None:
        flash_installed = importlib.util.find_spec("flash_attn") is not None
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_installed:
        return "flash_attn"
    return "sdpa"


class CudaGraphCapture:
    """Captures a step as a CUDA graph (all of a decoder's graphs share one memory pool)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: _POOL_HANDLE = torch.cuda.graph_pool_handle()

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: the same writes the replay repeats
            run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        return graph.replay, out


def load_flash_decode() -> FlashDecode:
    """flash-attn's KV-cache decode kernel (imported at first use: a broken build fails here)."""
    from flash_attn import flash_attn_with_kvcache

    return typing.cast(FlashDecode, flash_attn_with_kvcache)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The CUDA-only pieces of the static step: ``capture`` makes a capturer for a device (None:
    eager steps), ``flash_decode`` loads the KV-cache kernel (None: SDPA)."""

    capture: Callable[[torch.device], Capture] | None = None
    flash_decode: Callable[[], FlashDecode] | None = None

    @staticmethod
    def for_device(device: torch.device, dtype: torch.dtype, cuda_graphs: bool) -> Kernels:
        """CUDA graphs on CUDA with ``inference.cuda_graphs``; flash-attn where ``choose_attention`` picks it."""
        capture = CudaGraphCapture if device.type == "cuda" and cuda_graphs else None
        flash = load_flash_decode if choose_attention(device, dtype) == "flash_attn" else None
        return Kernels(capture, flash)


class StaticDecoder:
    """``FastDecoder``'s step over bucketed static buffers (see module docstring)."""

    def __init__(self, fast: FastDecoder, kernels: Kernels | None = None):
        self.fast, self.kernels = fast, kernels or Kernels()
        self.attention = "flash_attn" if self.kernels.flash_decode is not None else "sdpa"
        self.capture = self.kernels.capture is not None
        self._flash: FlashDecode | None = None
        self.checked = False  # the first step checks the fast paths against the eager SDPA step
        p = next(fast.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.n_layers = len(fast.layers)
        self.graphs: dict[tuple[int, int], tuple[Replay, torch.Tensor]] = {}
        self.captures = 0  # graphs captured so far (a count for tests and benches)
        self.loads = 0  # times the batch was laid out in the buffers again
        self.reset()

    def reset(self) -> None:
        """Drop buffers and graphs (after a weight update re-fused the weights, or to free memory)."""
        self.graphs.clear()
        self._capturer: Capture | None = None
        self._flat_k: list[torch.Tensor] = []
        self._flat_v: list[torch.Tensor] = []
        self._mask = torch.zeros(0, dtype=torch.bool, device=self.device)
        self._rows = torch.zeros(0, dtype=torch.long, device=self.device)
        self.n = self.b = self.c = self.col = 0

    def _ensure(self, b: int, c: int) -> None:
        """Buffers for ``b`` rows x ``c`` columns (reallocated, zeroed, when larger: graphs are dropped)."""
        d, h = self.fast.head_dim, self.fast.n_kv
        if self._flat_k and self._flat_k[0].numel() >= b * h * c * d and self._rows.numel() >= 3 * b:
            return
        cells = max(b * c, self._mask.numel())
        rows = max(b, self._rows.numel() // 3)
        self.graphs.clear()
        self._capturer = None
        zeros = lambda n, dt=self.dtype: torch.zeros(n, dtype=dt, device=self.device)  # noqa: E731 - finite padding
        self._flat_k = [zeros(cells * h * d) for _ in range(self.n_layers)]
        self._flat_v = [zeros(cells * h * d) for _ in range(self.n_layers)]
        self._mask = zeros(cells, torch.bool)
        self._rows = zeros(rows * 3, torch.long)  # tokens, positions, left padding of each row
        self._col = zeros(1, torch.long)
        self._seqlens = zeros(rows, torch.int32)

    def _views(self, b: int, c: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        h, d = self.fast.n_kv, self.fast.head_dim
        ks = [f[: b * h * c * d].view(b, h, c, d) for f in self._flat_k]
        vs = [f[: b * h * c * d].view(b, h, c, d) for f in self._flat_v]
        return ks, vs, self._mask[: b * c].view(b, c)

    def load(self, layers: list[SlabLayer], mask: torch.Tensor, pos: torch.Tensor) -> list[SlabLayer]:
        """Lay the running batch (KV ``layers``, bool ``mask`` [n, L] of its cached columns, next
        positions ``pos`` [n]) out in the buffers; returns cache layers viewing them."""
        n, width = mask.shape
        b, c = bucket_rows(n), bucket_cols(width + 1, COL_STEP)
        src = [(layer.keys, layer.values) for layer in layers]
        if (
            self._flat_k
            and src
            and src[0][0].untyped_storage().data_ptr() == self._flat_k[0].untyped_storage().data_ptr()
        ):
            src = [(k.clone(), v.clone()) for k, v in src]  # a new layout over the same buffers: copy out first
        self._ensure(b, c)
        ks, vs, m = self._views(b, c)
        for (k, v), kb, vb in zip(src, ks, vs, strict=True):
            kb[:n, :, :width] = k
            vb[:n, :, :width] = v
        m.zero_()
        m[:n, :width] = mask
        pad = (~mask).sum(1)  # left padding of each row (for flash-attn: its cached columns are the rest)
        if self.attention == "flash_attn" and not torch.equal(
            mask, torch.arange(width, device=mask.device) >= pad[:, None]
        ):
            fall_back(FLASH_DECODE, "the batch's cached columns are not each row's right end", "SDPA")
            self.attention = "sdpa"  # SDPA reads the mask itself: any pattern is exact
        self._rows[2 * b : 2 * b + n] = pad
        self._rows[n:b] = 0  # padding rows: token 0 at position 0, not a former row's stale ids
        self._rows[b + n : 2 * b] = 0
        self._rows[2 * b + n : 3 * b] = width  # padding rows: empty but for the column each step writes
        self.n, self.b, self.c, self.col = n, b, c, width
        self.loads += 1
        return [SlabLayer.over(kb[:n], vb[:n], width) for kb, vb in zip(ks, vs, strict=True)]

    def has_room(self, n: int) -> bool:
        """Whether the loaded buffers hold the batch of ``n`` rows for one more step."""
        return n == self.n and self.col < self.c

    def step(self, tokens: torch.Tensor, pos: torch.Tensor, layers: list[SlabLayer]) -> torch.Tensor:
        """Logits [n, V] for ``tokens`` [n] at ``pos`` [n]; writes column ``col`` of every layer."""
        n, b, c = self.n, self.b, self.c
        self._rows[:n].copy_(tokens)
        self._rows[b : b + n].copy_(pos)
        self._col.fill_(self.col)
        if not self.checked:
            out = self._first_step(b, c)
        elif self.capture and ((b, c) in self.graphs or self._capture(b, c)):
            replay, out = self.graphs[(b, c)]
            replay()
        else:
            out = self._run(b, c)
        self.col += 1
        for layer in layers:
            layer.advance()
        return out[:n]

    def _capture(self, b: int, c: int) -> bool:
        """Capture the step of bucket (b, c); False (and eager steps from now on) when that fails."""
        assert self.kernels.capture is not None
        try:
            if self._capturer is None:
                self._capturer = self.kernels.capture(self.device)
            self.graphs[(b, c)] = self._capturer(lambda: self._run(b, c))
        except Exception as e:  # noqa: BLE001 - any capture failure: run the step eagerly
            fall_back(CUDA_GRAPHS, reason(e), "eager steps")
            self.capture, self.graphs, self._capturer = False, {}, None
            return False
        self.captures += 1
        return True

    def _first_step(self, b: int, c: int) -> torch.Tensor:
        """The first step: flash-attn and the captured graph each checked against the eager SDPA
        step, which runs last (its writes are the ones the buffers keep) and gives the logits."""
        self.checked = True
        if self.attention == "flash_attn":
            try:
                assert self.kernels.flash_decode is not None
                self._flash = self.kernels.flash_decode()
                fast = self._run(b, c).clone()
            except Exception as e:  # noqa: BLE001 - any failure of the kernel: SDPA
                fall_back(FLASH_DECODE, reason(e), "SDPA")
                self.attention = "sdpa"
            else:
                self.attention = "sdpa"
                if check(FLASH_DECODE, fast, self._run(b, c), self.dtype, "SDPA"):
                    self.attention = "flash_attn"
        if self.capture and self._capture(b, c):
            replay, out = self.graphs[(b, c)]
            replay()
            if not check(CUDA_GRAPHS, out.clone(), self._run(b, c), self.dtype, "eager steps"):
                self.capture, self.graphs, self._capturer = False, {}, None
        attention, self.attention = self.attention, "sdpa"
        try:
            return self._run(b, c)
        finally:
            self.attention = attention

    def _run(self, b: int, c: int) -> torch.Tensor:
        ks, vs, mask = self._views(b, c)
        tokens, pos, leftpad = self._rows[:b], self._rows[b : 2 * b], self._rows[2 * b : 3 * b]
        col = self._col
        mask.index_fill_(1, col, True)
        amask = mask[:, None, None, :]
        flash = self.attention == "flash_attn"
        if flash:
            flash_attn_with_kvcache = typing.cast(FlashDecode, self._flash)
            seqlens = self._seqlens[:b]
            seqlens.copy_(col.expand(b) + 1)
            pad32 = leftpad.to(torch.int32)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ks[i].index_copy_(2, col, k)
            vs[i].index_copy_(2, col, v)
            if not flash:
                return functional.scaled_dot_product_attention(
                    q, ks[i], vs[i], attn_mask=amask, scale=self.fast.scaling
                )
            hkv, g, d = q.shape[1], q.shape[2], q.shape[3]
            o = flash_attn_with_kvcache(
                q.reshape(b, 1, hkv * g, d),  # head h uses kv head h // g, flash-attn's GQA order
                ks[i].transpose(1, 2),  # [b, c, Hkv, D] view of the [b, Hkv, c, D] buffer
                vs[i].transpose(1, 2),
                cache_seqlens=seqlens,
                cache_leftpad=pad32,
                softmax_scale=self.fast.scaling,
                causal=False,
            )
            return o.view(b, hkv, g, d)

        return self.fast.forward(tokens, pos, attend).float()
