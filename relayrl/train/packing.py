"""Packing: padded batches -> one 1D sequence per micro-batch, and back.

A packed micro-batch lays its sequences end to end (no padding): ``input_ids [T]``,
``position_ids [T]`` restarting at 0 for every sequence, ``cu_seqlens [n+1]`` (int32,
boundaries), ``max_seqlen`` (0-d int64) and ``row_index [n]`` (rows of the padded batch).
Token-level keys of the padded batch (``[B, L, ...]``) become ``[T, ...]``; sequence-level
keys (``[B, ...]``) are kept for the selected rows (``[n, ...]``). ``attention_mask`` is
dropped (every packed token is real).

The model then runs on ``[1, T]`` with a per-document attention (``relayrl_varlen``,
registered with transformers' ``AttentionInterface``) or flash-attn's varlen kernel, so no
``T x T`` mask is ever built and no compute is spent on padding. Rows sharing a prompt can instead
compute it once (``relayrl.train.prefix``).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Sequence

import torch
from torch.nn import functional

from relayrl.api.engine import TensorDict
from relayrl.api.workflow import VISION_KEYS
from relayrl.train.lmhead import TokenStats, entropy, label_logprobs
from relayrl.utils.batching import length_groups

VARLEN_ATTN = "relayrl_varlen"
TREE_KWARG = "relayrl_tree"  # the model forward's keyword that carries a shared-prefix layout to the attention


# --------------------------------------------------------------------------------------
# pack / unpack
# --------------------------------------------------------------------------------------


def pack(batch: TensorDict, rows: Sequence[int] | None = None) -> TensorDict:
    """Pack ``rows`` (default: all) of a right-padded batch into one 1D sequence."""
    if "input_ids" not in batch or "attention_mask" not in batch:
        raise ValueError(f"pack needs 'input_ids' and 'attention_mask' in the batch, got keys {sorted(batch)}")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"batch['input_ids'] must be [B, L], got shape {tuple(ids.shape)}")
    shape = (ids.shape[0], ids.shape[1])
    idx = torch.arange(shape[0]) if rows is None else torch.as_tensor(list(rows), dtype=torch.long)
    if idx.numel() == 0:
        raise ValueError("pack needs at least one row")
    lengths = batch["attention_mask"].bool().sum(1).to("cpu")[idx]
    if bool((lengths == 0).any()):
        raise ValueError(f"row {int(idx[lengths == 0][0])} of the batch is empty (attention_mask all 0)")
    sel = batch["attention_mask"].bool()[idx.to(ids.device)]  # [n, L] real tokens of the rows
    out: TensorDict = {}
    for key, value in batch.items():
        if key == "attention_mask" or key in VISION_KEYS or not isinstance(value, torch.Tensor):
            continue
        if value.dim() >= 2 and tuple(value.shape[:2]) == shape:  # token-level
            out[key] = value[idx.to(value.device)][sel.to(value.device)]
        elif value.dim() >= 1 and value.shape[0] == shape[0]:
            out[key] = value[idx.to(value.device)]
        else:
            raise ValueError(
                f"batch[{key!r}] has shape {list(value.shape)}; expected [B, L, ...] or [B, ...] with B={shape[0]}"
            )
    cu = functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    starts = torch.repeat_interleave(cu[:-1].long(), lengths)
    out["position_ids"] = (torch.arange(int(cu[-1])) - starts).to(ids.device)
    out["cu_seqlens"] = cu.to(ids.device)
    out["max_seqlen"] = lengths.max().to(torch.int64)
    out["row_index"] = idx.to(ids.device)
    if "image_grid_thw" in batch:
        out.update(pack_vision(batch["pixel_values"], batch["image_grid_thw"], idx))
    return out


def pack_vision(pixel_values: torch.Tensor, grid: torch.Tensor, idx: torch.Tensor) -> TensorDict:
    """The images of rows ``idx`` laid end to end, as the model takes them: ``pixel_values [P, D]``,
    ``image_grid_thw [n_images, 3]`` (row order), and ``image_rows [n]``, the images of each row."""
    grid = grid[idx.to(grid.device)]
    counts = grid.prod(-1)  # [n, N] patches per image, 0 on padding
    per_row = counts.sum(1).tolist()
    pixels = pixel_values[idx.to(pixel_values.device)]
    return {
        "pixel_values": torch.cat([pixels[i, :n] for i, n in enumerate(per_row)]),
        "image_grid_thw": grid[counts > 0],
        "image_rows": (counts > 0).sum(1),
    }


def vision_tokens(batch: TensorDict) -> list[int]:
    """Patches the vision tower runs per row (0 without images): a row's share of a micro-batch's work."""
    if "image_grid_thw" not in batch:
        return [0] * batch["input_ids"].shape[0]
    return batch["image_grid_thw"].prod(-1).sum(1).tolist()


def unpack(values: torch.Tensor, packed: TensorDict, batch_size: int, seqlen: int, fill: float = 0.0) -> torch.Tensor:
    """Scatter packed token values ``[T, ...]`` back into a padded ``[B, L, ...]`` tensor."""
    cu = packed["cu_seqlens"].long().cpu()
    lengths = cu[1:] - cu[:-1]
    if values.shape[0] != int(cu[-1]):
        raise ValueError(f"unpack: values have {values.shape[0]} tokens, packed batch has {int(cu[-1])}")
    out = values.new_full((batch_size, seqlen, *values.shape[1:]), fill)
    rows = torch.repeat_interleave(packed["row_index"].cpu(), lengths)
    cols = packed["position_ids"].cpu()
    out[rows.to(values.device), cols.to(values.device)] = values
    return out


def segment_ids(packed: TensorDict) -> torch.Tensor:
    """``[T]`` index (0..n-1) of the sequence each packed token belongs to."""
    cu = packed["cu_seqlens"].long()
    return torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu[1:] - cu[:-1])


# --------------------------------------------------------------------------------------
# Micro-batches by token budget
# --------------------------------------------------------------------------------------


def split_by_token_budget(
    lengths: Sequence[int], budget: int, min_groups: int = 1, multiple_of: int = 1
) -> list[list[int]]:
    """Balanced bin packing of sequences into groups of at most ``budget`` tokens.

    Returns lists of indices into ``lengths`` (each sorted). The number of groups is the
    smallest ``k >= min_groups``, divisible by ``multiple_of``, for which a greedy
    longest-first assignment (each sequence to the currently lightest group) fits the
    budget; a sequence longer than the budget gets a group of its own. With a huge budget
    and ``min_groups = multiple_of = world_size`` this splits a batch across ranks with
    near-equal tokens. Groups may be empty only when there are fewer sequences than
    ``min_groups``.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1 token, got {budget}")
    if min_groups < 1 or multiple_of < 1:
        raise ValueError(f"min_groups and multiple_of must be >= 1, got {min_groups}, {multiple_of}")
    lens = [int(n) for n in lengths]
    if any(n < 0 for n in lens):
        raise ValueError(f"lengths must be >= 0, got {lens}")
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    n_long = sum(1 for n in lens if n > budget)
    k = max(min_groups, n_long + math.ceil(sum(n for n in lens if n <= budget) / budget), 1)
    while True:
        k = math.ceil(k / multiple_of) * multiple_of
        heap = [(0, g) for g in range(k)]  # (tokens, group)
        groups: list[list[int]] = [[] for _ in range(k)]
        for i in order:
            total, g = heapq.heappop(heap)
            if total + lens[i] > budget and total > 0:
                break  # k groups are too few
            groups[g].append(i)
            heapq.heappush(heap, (total + lens[i], g))
        else:
            return [sorted(g) for g in groups]
        k += 1


# --------------------------------------------------------------------------------------
# Token-aligned logprobs and entropy
# --------------------------------------------------------------------------------------


def shifted(per_pred: torch.Tensor, packed: TensorDict) -> torch.Tensor:
    """``per_pred[i]`` (``[T - 1, ...]``) is about token ``i+1``; returns ``[T, ...]`` token-aligned, 0 at
    sequence starts."""
    out = torch.cat([per_pred.new_zeros(1, *per_pred.shape[1:]), per_pred])
    out[packed["cu_seqlens"][:-1].long().to(out.device)] = 0.0
    return out


def _chunked(
    logits: torch.Tensor, n: int, temperature: float, chunk: int, fn: Callable[[torch.Tensor, int], torch.Tensor]
) -> torch.Tensor:
    """``[n]``: ``fn(fp32 logits / temperature, start)`` over the first ``n`` rows, ``chunk`` rows at a time,
    so no full ``[T, V]`` fp32 copy is materialised (differentiable)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    parts = []
    for s in range(0, n, chunk):
        lg = logits[s : min(s + chunk, n)].float()
        parts.append(fn(lg if temperature == 1.0 else lg / temperature, s))
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)


def token_logprobs(
    logits: torch.Tensor | TokenStats, packed: TensorDict, temperature: float = 1.0, chunk: int = 1024
) -> torch.Tensor:
    """``[T]``: value i = log p(input_ids[i] | earlier tokens of its sequence); 0 at each start; computed
    ``chunk`` tokens at a time (``_chunked``). Given a ``relayrl.train.lmhead.TokenStats`` (what a
    ``token_stats_loss`` receives), the values at loss tokens, 0 elsewhere."""
    if isinstance(logits, TokenStats):
        return logits.logprobs(temperature)
    ids = packed["input_ids"]
    if logits.dim() != 2 or logits.shape[0] != ids.shape[0]:
        raise ValueError(f"logits must be [T, V] with T={ids.shape[0]}, got {tuple(logits.shape)}")
    labels = ids[1:].to(logits.device)
    logp = _chunked(logits, len(labels), temperature, chunk, lambda lg, s: label_logprobs(lg, labels[s : s + len(lg)]))
    return shifted(logp, packed)


def token_entropy(
    logits: torch.Tensor | TokenStats, packed: TensorDict, temperature: float = 1.0, chunk: int = 1024
) -> torch.Tensor:
    """``[T]``: entropy of the distribution that predicted token i (0 at each start; a
    ``TokenStats``: at loss tokens, 0 elsewhere)."""
    if isinstance(logits, TokenStats):
        return logits.entropy(temperature)
    return shifted(_chunked(logits, logits.shape[0] - 1, temperature, chunk, lambda lg, _: entropy(lg)), packed)


# --------------------------------------------------------------------------------------
# Per-document (varlen) attention for transformers
# --------------------------------------------------------------------------------------


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed document (``cu_seq_lens_q`` in kwargs): ``query [1, H, T, D]``,
    ``key``/``value`` ``[1, H_kv, T, D]`` -> ``[1, T, H, D]``, like transformers' other attention functions.

    Documents of similar length run as one right-padded SDPA call with ``is_causal`` (``document_attention``):
    exact, as a real token never sees a padding key (they come after it), about ``sum(len_i^2)`` instead of
    ``T^2``, no mask allocated. ``sliding_window`` (Mistral, Gemma2/3: a token sees the last ``sliding_window``
    tokens, itself included) and ``softcap`` (Gemma2: ``tanh(scores / c) * c``) are honoured as transformers'
    eager attention does. ``relayrl_tree`` in kwargs (a ``relayrl.train.prefix.SharedPrefix``): the tokens
    are in the shared-prefix layout, which runs its own documents and trees.
    """
    if attention_mask is not None and query.shape[0] != 1:
        raise ValueError("relayrl_varlen attention expects packed input ([1, T]) without an attention mask")
    gqa = query.shape[1] != key.shape[1]
    drop = dropout if module.training else 0.0
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):  # e.g. a vision tower: one image, no mask
        out = functional.scaled_dot_product_attention(query, key, value, dropout_p=drop, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    attend = functools.partial(_causal_attention, drop=drop, scale=scaling, gqa=gqa, window=window, softcap=softcap)  # type: ignore[arg-type]

    tree = kwargs.get(TREE_KWARG)  # a shared-prefix layout (relayrl.train.prefix.SharedPrefix) lays out the tokens
    if tree is not None:
        return tree.attention(query, key, value, attend).transpose(0, 1).unsqueeze(0).contiguous(), None  # type: ignore[attr-defined]
    cu = kwargs.get("cu_seq_lens_q")
    bounds = [] if cu is None else (cu.tolist() if isinstance(cu, torch.Tensor) else list(cu))  # type: ignore[call-overload]
    if len(bounds) <= 2:
        return attend(query, key, value).transpose(1, 2).contiguous(), None
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    positions, outs = document_attention(query[0], key[0], value[0], bounds[:-1], lengths, attend)
    out = torch.cat(outs, 1)[:, torch.argsort(torch.cat(positions))]  # back to packed order: [H, T, D]
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts: Sequence[int],
    lengths: Sequence[int],
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Causal attention within each document ``[start, start + length)`` of ``[H, T, D]`` tensors,
    documents of similar length batched (right-padded, the padding repeating the last token).
    Returns the packed positions of the outputs and the outputs ``[H, tokens, D]``, per batch."""
    positions, outs = [], []
    for group in length_groups(list(lengths)):
        first = torch.tensor([starts[i] for i in group], device=q.device)
        lens = torch.tensor([lengths[i] for i in group], device=q.device)
        cols = torch.arange(int(lens.max()), device=q.device)
        idx = first[:, None] + torch.minimum(cols[None, :], lens[:, None] - 1)  # [n, W]
        o = attend(q[:, idx].transpose(0, 1), k[:, idx].transpose(0, 1), v[:, idx].transpose(0, 1))  # [n, H, W, D]
        real = cols[None, :] < lens[:, None]
        outs.append(o.transpose(0, 1)[:, real])  # [H, tokens of the group, D]
        positions.append(idx[real])
    return positions, outs


def _causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    *,
    drop: float,
    scale: float | None,
    gqa: bool,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Causal attention of ``[n, H, W, D]`` queries over ``[n, H_kv, W', D]`` keys/values, with an
    optional sliding window and logit soft-cap (then an explicit mask / the eager formula).

    Causal means by position: query i sees key j where ``k_pos[j] <= q_pos[i]`` (and, with a
    window, ``k_pos[j] > q_pos[i] - window``); ``q_pos``/``k_pos`` (``[W]``, ``[W']``) default to
    ``0..W-1`` for both (square). A shared-prefix segment passes its prefix's keys before its own."""
    if q_pos is None and not window and not softcap:
        return functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=drop, scale=scale, enable_gqa=gqa
        )
    if q_pos is None or k_pos is None:
        q_pos = k_pos = torch.arange(q.shape[2], device=q.device)
    rows, cols = q_pos[:, None], k_pos[None, :]
    allowed = cols <= rows
    if window:
        allowed = allowed & (cols > rows - int(window))
    if not softcap:
        return functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=drop, scale=scale, enable_gqa=gqa
        )
    if gqa:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")).float(), dim=-1).to(q.dtype)
    return torch.matmul(functional.dropout(probs, p=drop), v)


def register_varlen_attention() -> str:
    """Register ``relayrl_varlen`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTN, varlen_attention_forward)
    return VARLEN_ATTN


def flash_varlen_impl(device: torch.device) -> str | None:
    """transformers' name for flash-attn's varlen kernel where it can run (CUDA, flash-attn installed),
    else None: the seam tests replace to put a failing kernel in its place on CPU."""
    return "flash_attention_2" if device.type == "cuda" and flash_attn_available() else None


def flash_attn_available() -> bool:
    """flash-attn installed and a CUDA device present."""
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attn_impl(attn_impl: str, device: torch.device) -> str:
    """ModelConfig.attn_impl -> a transformers attention implementation name."""
    if attn_impl in ("flash", "auto"):
        flash = flash_varlen_impl(device)
        if flash is not None:
            return flash  # checked against relayrl_varlen at first use (train/fastpath.py)
        if attn_impl == "flash":
            raise RuntimeError("model.attn_impl='flash' needs flash-attn and a CUDA device; use 'varlen' or 'auto'")
    if attn_impl == "sdpa":
        return "sdpa"
    return register_varlen_attention()


def model_inputs(packed: TensorDict) -> dict[str, object]:
    """Keyword arguments for ``model(**...)`` on a packed micro-batch (``use_cache=False``).

    ``cu_seq_lens_*``/``max_length_*`` are the names transformers forwards to attention
    functions (flash-attn's varlen path reads them too); ``position_ids`` restart per document.
    """
    cu = packed["cu_seqlens"]
    max_len = int(packed["max_seqlen"])
    return {
        "input_ids": packed["input_ids"].unsqueeze(0),
        "position_ids": packed["position_ids"].unsqueeze(0),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
        "use_cache": False,
    }
