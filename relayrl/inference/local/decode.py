"""KV-cache storage and a lean decode step for LocalEngine.

``SlabLayer`` keeps one layer's keys/values in a preallocated buffer that a decode step
writes one column of (transformers' ``DynamicLayer`` re-concatenates the whole cache every
step). ``FastDecoder`` runs one decode step of a Llama/Qwen2-style model with plain tensor
ops over the model's own weights (fused qkv and gate/up matrices, one attention call per
layer): on small CPUs the per-step Python overhead of the generic forward dominates, and
this is what lets a shrinking batch pay off. Qwen3 (per-head q/k RMSNorm) and Mistral without a
sliding window take it too; other architectures use the generic forward.

On CPU in fp32 the step's matrices are kept in oneDNN's packed layout (``torch.ops.mkldnn``, what
inductor's weight freezing uses): a decode step multiplies a few rows by every weight, where
oneDNN's prepacked kernel ran 1.2-1.8x the flops of the default ``linear`` on SmolLM2's shapes
(2.5x for the 49k-vocab LM head at 8 rows; one thread, AVX-512). Packing copies the weights once per
weight update (~260 MB more for SmolLM2-135M in fp32: the LM head and the o/down projections;
the fused qkv and gate/up matrices were copies already). It is checked at each packing against
the plain product and falls back (one warning, ``relayrl.utils.failsafe``) if it raises or differs.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

import torch
from torch.nn import functional
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from relayrl.utils import failsafe
from relayrl.utils.failsafe import check, fall_back, reason

_FAST_TYPES = ("qwen2", "llama", "qwen3", "mistral")
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # functional.linear's signature
PACKED = "oneDNN packed weights (CPU decode)"


class SlabLayer(DynamicLayer):
    """One layer's KV in a ``[B, H, capacity, D]`` buffer; ``keys``/``values`` view the used part."""

    keys: torch.Tensor  # always set (DynamicLayer allows None before the first update)
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, reserve: int = 64) -> None:
        self._over(with_room(keys, reserve), with_room(values, reserve), keys.shape[2])

    def _over(self, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int) -> None:
        DynamicLayer.__init__(self)
        self.dtype, self.device, self.is_initialized = kbuf.dtype, kbuf.device, True
        self._kbuf, self._vbuf, self.length = kbuf, vbuf, 0
        self.advance(length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[2]
        if end > self._kbuf.shape[2]:  # grow geometrically
            self._kbuf = with_room(self._kbuf[:, :, : self.length], max(64, end))
            self._vbuf = with_room(self._vbuf[:, :, : self.length], max(64, end))
        self._kbuf[:, :, self.length : end] = key_states
        self._vbuf[:, :, self.length : end] = value_states
        self.advance(key_states.shape[2])
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    @classmethod
    def over(cls, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int) -> SlabLayer:
        """A layer whose first ``length`` columns of ``kbuf``/``vbuf`` are its cache (no copy): the
        static decode step's buffers, which it writes itself (``advance`` then counts the column)."""
        layer = cls.__new__(cls)
        layer._over(kbuf, vbuf, length)
        return layer

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more columns as written (by ``update``, or by the static decode step)."""
        self.length += n
        self.keys, self.values = self._kbuf[:, :, : self.length], self._vbuf[:, :, : self.length]


def with_room(x: torch.Tensor, extra: int) -> torch.Tensor:
    """A copy of ``x`` [B, H, L, D] in a buffer with ``extra`` free columns after it."""
    buf = x.new_empty(x.shape[0], x.shape[1], x.shape[2] + extra, x.shape[3])
    buf[:, :, : x.shape[2]] = x
    return buf


def cat_left_padded(a: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    """Stack two left-padded batches (mask [B, L] or KV [B, H, L, D]) by rows at ``width`` columns."""
    if a.dim() == 2:
        return torch.cat([functional.pad(a, (width - a.shape[1], 0)), functional.pad(b, (width - b.shape[1], 0))])
    return torch.cat(
        [functional.pad(a, (0, 0, width - a.shape[2], 0)), functional.pad(b, (0, 0, width - b.shape[2], 0))]
    )


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return functional.rms_norm(x, w.shape, w, eps)  # one fused op
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``functional.linear`` for a weight ``pack`` returned."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def pack(w: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """``w`` [out, in] in oneDNN's layout for ``packed_linear`` (``rows``: the batch it is tuned for)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode steps on ``device`` in ``dtype`` use packed weights: CPU in fp32 (the dtype
    measured; bf16 is fast only where the CPU has bf16 instructions), oneDNN built in, and the path
    has not fallen back in this process."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and PACKED not in failsafe.FALLBACKS
    )


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class FastDecoder:
    """One decode step of a Llama/Qwen2/Qwen3/Mistral model (fp32/bf16, full attention, SiLU MLP)."""

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        cfg = model.config
        return (
            cfg.model_type in _FAST_TYPES
            and getattr(cfg, "hidden_act", "silu") == "silu"
            and not getattr(cfg, "use_sliding_window", False)
            and (cfg.model_type != "mistral" or getattr(cfg, "sliding_window", None) is None)
            and all(t == "full_attention" for t in (getattr(cfg, "layer_types", None) or ["full_attention"]))
            and not getattr(cfg, "pretraining_tp", 1) > 1
        )

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.refresh()

    def refresh(self) -> None:
        """Re-read (and re-fuse, re-pack) the weights; call after loading new weights."""
        m = self.model.model
        self.eps = float(self.model.config.rms_norm_eps)
        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    None if biases[0] is None else torch.cat(biases),
                    a.o_proj.weight,
                    a.o_proj.bias,
                    layer.post_attention_layernorm.weight,
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]),
                    mlp.down_proj.weight,
                    mlp.down_proj.bias,
                    getattr(getattr(a, "q_norm", None), "weight", None),
                    getattr(getattr(a, "k_norm", None), "weight", None),
                )
            )
        attn = m.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.n_kv = self.model.config.num_key_value_heads
        self.n_q = self.model.config.num_attention_heads
        head = self.model.lm_head
        self.linear: Linear = functional.linear
        self.head: tuple[torch.Tensor, torch.Tensor | None] | None = None  # None: the model's own lm_head
        weight = m.norm.weight
        if type(head) is torch.nn.Linear and packs(weight.device, weight.dtype):
            self._pack(head.weight, head.bias)

    def _pack(self, head_w: torch.Tensor, head_b: torch.Tensor | None) -> None:
        """Every matrix of the step in oneDNN's layout, checked once against the plain product."""
        try:
            probe = torch.randn(3, head_w.shape[1], generator=torch.Generator().manual_seed(0)).to(head_w.dtype)
            head = (pack(head_w), head_b)
            fast = packed_linear(probe, *head)
        except Exception as e:  # noqa: BLE001 - any failure of the packed kernel: the plain one
            fall_back(PACKED, reason(e), "functional.linear")
            return
        if not check(PACKED, fast, functional.linear(probe, head_w, head_b), head_w.dtype, "functional.linear"):
            return
        self.layers = [
            (w_in, pack(w_qkv), b_qkv, pack(w_o), b_o, w_post, pack(w_gu), b_gu, pack(w_d), b_d, w_qn, w_kn)
            for w_in, w_qkv, b_qkv, w_o, b_o, w_post, w_gu, b_gu, w_d, b_d, w_qn, w_kn in self.layers
        ]
        self.head, self.linear = head, packed_linear

    def __call__(
        self, tokens: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: list[SlabLayer]
    ) -> torch.Tensor:
        """Logits [B, V] for ``tokens`` [B] at positions ``pos`` [B]; ``mask`` [B, L+1] bool."""
        amask = mask[:, None, None, :]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = cache[i].update(k, v)
            return functional.scaled_dot_product_attention(q, keys, values, attn_mask=amask, scale=self.scaling)

        return self.forward(tokens, pos, attend)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        """One step; ``attend(layer, q [B, Hkv, G, D], k [B, Hkv, 1, D], v)`` stores k/v in the
        layer's cache and returns the attention output [B, Hkv, G, D] (where the KV lives is its call)."""
        m, b, d = self.model.model, tokens.shape[0], self.head_dim
        x = m.embed_tokens(tokens)
        cos, sin = m.rotary_emb(x[:, None], pos[:, None])  # [B, 1, D]
        nq, nkv, linear = self.n_q * d, self.n_kv * d, self.linear
        for i, (w_in, w_qkv, b_qkv, w_o, b_o, w_post, w_gu, b_gu, w_d, b_d, w_qn, w_kn) in enumerate(self.layers):
            qkv = linear(_rms(x, w_in, self.eps), w_qkv, b_qkv)
            heads = qkv[:, : nq + nkv].view(b, self.n_q + self.n_kv, d)
            if w_qn is not None and w_kn is not None:  # Qwen3: RMSNorm over each head's q and k before the rotation
                heads = torch.cat(
                    [_rms(heads[:, : self.n_q], w_qn, self.eps), _rms(heads[:, self.n_q :], w_kn, self.eps)], 1
                )
            qk = _rope(heads, cos, sin)  # q and k heads at once
            # the query heads of one kv group attend together: [B, Hkv, G, D] against [B, Hkv, L, D]
            q = qk[:, : self.n_q].reshape(b, self.n_kv, -1, d)
            o = attend(i, q, qk[:, self.n_q :, None], qkv[:, nq + nkv :].view(b, self.n_kv, 1, d))
            x = x + linear(o.reshape(b, -1), w_o, b_o)
            gate, up = linear(_rms(x, w_post, self.eps), w_gu, b_gu).chunk(2, dim=-1)
            x = x + linear(functional.silu(gate) * up, w_d, b_d)
        x = _rms(x, m.norm.weight, self.eps)
        head = self.model.lm_head
        if self.head is None or head._forward_hooks or head._forward_pre_hooks:  # hooks see the module's call
            return head(x)
        return linear(x, *self.head)


def slab_layers(cache: DynamicCache) -> list[SlabLayer]:
    """The layers of a cache LocalEngine built: only ``SlabLayer``s (transformers types
    ``Cache.layers`` more widely)."""
    return typing.cast(list[SlabLayer], cache.layers)
