"""The running batch of LocalEngine: its left-padded KV slab, prefill, merge, trim, decode step.

A mixin over ``LocalEngine``'s batch state (``state.EngineState``: ``_rows``, ``_alive``, ``_cache``,
``_mask``, ``_pos``, ``_logits``), kept apart from the request lifecycle and control in ``engine.py``.
Row ``i`` holds its tokens at the right end of the cache; ``_mask`` marks real columns and ``_pos`` is
each row's next position (passed explicitly: prompts of any length keep theirs). Columns that no
remaining row uses are trimmed when rows leave.

Prefill computes what requests admitted together share once: identical inputs (a GRPO group's samples)
one row for all, and the tokens every input starts with (a system prompt, a chat template's header:
24 of SmolLM2's 36-46-token chat prompts) one forward for all rows, ``inference.shared_prefix_min``.
"""

from __future__ import annotations

import os

import torch
from torch.nn import functional
from transformers import DynamicCache

from relayrl.inference.local.decode import SlabLayer, cat_left_padded, slab_layers
from relayrl.inference.local.seq import Prefilled, Seq
from relayrl.inference.local.state import EngineState
from relayrl.inference.local.vision import vision_prefill


class SlabBatch(EngineState):
    """Prefill, merge, trim and decode the running batch (mixed into ``LocalEngine``)."""

    def _reset_batch(self) -> None:
        """An empty running batch (finished rows stay in ``_rows``, not ``_alive``, until it is compacted)."""
        self._rows, self._alive, self._cache, self._params = [], [], None, None
        self._static_stale = True
        self._route = None
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._mask_bool = self._mask.bool()
        self._pos = torch.zeros(0, dtype=torch.long, device=self.device)

    def _merge(self, parts: list[Prefilled], new: list[Seq]) -> None:
        """Stack the running batch and the prefilled ``parts`` (rows ``new``) into one slab."""
        n_old = len(self._rows)
        if n_old:
            assert self._cache is not None
            old_kv = [(layer.keys, layer.values) for layer in slab_layers(self._cache)]  # views of the written columns
            parts.insert(0, (old_kv, self._mask, self._logits))
        kv, mask, logits = parts[0]
        for p_kv, p_mask, p_logits in parts[1:]:  # stack the left-padded batches by rows
            width = max(mask.shape[1], p_mask.shape[1])
            kv = [
                (cat_left_padded(k, pk, width), cat_left_padded(v, pv, width))
                for (k, v), (pk, pv) in zip(kv, p_kv, strict=True)
            ]
            mask, logits = cat_left_padded(mask, p_mask, width), torch.cat([logits, p_logits])
        self._cache = DynamicCache()
        self._cache.layers = [SlabLayer(k, v) for k, v in kv]
        self._rows, self._mask, self._logits = self._rows + new, mask, logits
        self._alive, self._params = self._alive + [True] * len(new), None
        deltas = torch.tensor([s.rope_delta for s in new], device=self.device)  # M-RoPE shift (0 for text)
        self._pos = torch.cat([self._pos[:n_old], mask[n_old:].sum(1) + deltas])
        self._mask_bool = self._mask.bool()
        self._static_stale = True

    def _prefill_or_fail(self, seqs: list[Seq]) -> list[tuple[Prefilled, list[Seq]]]:
        """Prefill ``seqs``; if that fails (out of memory), retry them one by one and fail only
        the requests that still cannot be prefilled, with an error naming the limit."""
        try:
            return [(self._prefill(seqs), seqs)]
        except Exception as e:  # noqa: BLE001 - handed to the requests' futures
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if len(seqs) > 1:
                return [done for s in seqs for done in self._prefill_or_fail([s])]
            n = len(seqs[0].prompt) + len(seqs[0].out)
            oom = isinstance(e, torch.OutOfMemoryError)
            what = "ran out of memory" if oom else f"failed ({type(e).__name__}: {e})"
            seqs[0].on_done(
                RuntimeError(
                    f"prefill of {n} tokens on {self.device} {what}; KV cache capacity {self.kv_capacity} tokens "
                    f"({self.kv_capacity_by}){': ' + str(e) if oom else ''}"
                )
            )
            return []

    def _prefill(self, seqs: list[Seq]) -> Prefilled:
        """One left-padded forward over ``seqs``: per-layer (keys, values), mask [n, L], last logits [n, V].

        Identical inputs (the samples of one GRPO group share their prompt) are computed once
        and their rows copied, which divides the prefill work by the group size."""
        first: dict[tuple[object, ...], int] = {}  # input -> its unique row (the same tokens with other images differ)
        rows = [first.setdefault((s.vision_key, *s.prompt, *s.out), len(first)) for s in seqs]
        reps = [seqs[rows.index(r)] for r in range(len(first))]
        inputs = [r.prompt + r.out for r in reps]
        if any(s.vision is not None for s in reps):  # vision-language: M-RoPE positions, image features
            assert self.model is not None
            visions = [r.vision for r in reps]
            kv, mask, logits, deltas = vision_prefill(self.model, inputs, visions, self.device, self._keep_arg)
            for s, row in zip(seqs, rows, strict=True):
                s.rope_delta = deltas[row]
        else:
            kv, mask, logits = self._prefill_unique(inputs)
        if self._router is not None:  # MoE: the experts of every token run, prompt (and earlier output) included
            ids = self._router.take().view(len(first), mask.shape[1], *self._router_shape).cpu()
            for s, r in zip(seqs, rows, strict=True):
                s.routes = [ids[r, mask.shape[1] - len(s.prompt) - len(s.out) :].clone()]
        self.counters["prefills"] += 1
        self.counters["prefill_rows"] += len(seqs)
        self.counters["prefill_unique"] += len(first)
        if len(first) == len(seqs):
            return kv, mask, logits
        idx = torch.tensor(rows, device=self.device)
        return [(k[idx], v[idx]) for k, v in kv], mask[idx], logits[idx]

    def _prefill_unique(self, inputs: list[list[int]]) -> Prefilled:
        shared = self._shared_prefix(inputs)
        if shared:
            return self._prefill_shared(inputs, shared)
        length = max(len(x) for x in inputs)
        ids = torch.tensor([[0] * (length - len(x)) + x for x in inputs], device=self.device)
        mask = torch.tensor([[0] * (length - len(x)) + [1] * len(x) for x in inputs], device=self.device)
        pos = (mask.cumsum(1) - 1).clamp_(min=0)
        cache = DynamicCache()  # full layers even for sliding-window models: the decode masks apply the window
        out = self.model(  # type: ignore[misc]
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            **self._keep_arg,
        )
        return [(layer.keys, layer.values) for layer in slab_layers(cache)], mask, out.logits[:, -1].float()

    def _shared_prefix(self, inputs: list[list[int]]) -> int:
        """How many leading tokens all ``inputs`` share that ``_prefill_shared`` computes once: 0 when
        fewer than ``inference.shared_prefix_min``, for a single input, and for models without the lean
        decode step (``FastDecoder``: Llama, Qwen2, Qwen3, windowless Mistral), where the split forward
        might not be the same computation (sliding windows count cache columns, MoE routing records,
        vision models' M-RoPE positions). Every row keeps at least its last token."""
        least = self.config.shared_prefix_min
        if least <= 0 or len(inputs) < 2 or self._fast is None:
            return 0
        n = min(len(os.path.commonprefix(inputs)), min(len(x) for x in inputs) - 1)
        return n if n >= least else 0

    def _prefill_shared(self, inputs: list[list[int]], p: int) -> Prefilled:
        """``_prefill_unique`` with the first ``p`` tokens (the same in every input) computed once.

        The prefix's keys/values, copied to every row, are the cache the left-padded tails are computed
        against (positions from ``p``; the tails' padding sits between prefix and tail, masked). Each
        row's columns are then moved right-aligned, padding first: the layout the rest of the engine keeps."""
        n, dev = len(inputs), self.device
        assert self.model is not None
        cache = DynamicCache()
        head = torch.tensor([inputs[0][:p]], device=dev)
        self.model(input_ids=head, past_key_values=cache, use_cache=True, **self._keep_arg)  # its logits unused
        prefix = [(layer.keys, layer.values) for layer in slab_layers(cache)]
        tails = [x[p:] for x in inputs]
        width = max(len(t) for t in tails)
        ids = torch.tensor([[0] * (width - len(t)) + t for t in tails], device=dev)
        tail_mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in tails], device=dev)
        cache = DynamicCache()
        for i, (k, v) in enumerate(prefix):
            cache.update(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1), i)  # copied: the tails append to it
        out = self.model(
            input_ids=ids,
            attention_mask=torch.cat([torch.ones_like(tail_mask[:, :1]).expand(n, p), tail_mask], 1),
            position_ids=p + (tail_mask.cumsum(1) - 1).clamp_(min=0),
            past_key_values=cache,
            use_cache=True,
            **self._keep_arg,
        )
        # row i's columns: prefix [0, p), its padding [p, p + pad), its tail after; right-aligned: padding
        # (any finite columns: masked), then the prefix, then the tail, which keeps its columns
        pad = (width - tail_mask.sum(1))[:, None]
        col = torch.arange(p + width, device=dev)[None]
        src = torch.where(col < pad, p + col, torch.where(col < pad + p, col - pad, col))
        mask = (col >= pad).long()
        kv = []
        for layer in slab_layers(cache):
            k, v = layer.keys, layer.values
            idx = src[:, None, :, None].expand(n, k.shape[1], p + width, k.shape[3])
            kv.append((k.gather(2, idx), v.gather(2, idx)))
        self.counters["prefill_shared_tokens"] += p * (n - 1)
        return kv, mask, out.logits[:, -1].float()

    def _select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` and trim cache columns no remaining row uses."""
        lengths = [len(self._rows[i].prompt) + len(self._rows[i].out) - 1 for i in keep]  # cached tokens per row
        self._rows, self._alive, self._params = [self._rows[i] for i in keep], [True] * len(keep), None
        if not keep:
            self._reset_batch()
            return
        idx = torch.tensor(keep, device=self.device)
        start = self._mask.shape[1] - max(lengths)  # rows are right-aligned: known on the host, no sync
        self._mask = self._mask[idx, start:]
        self._mask_bool = self._mask.bool()
        self._pos = self._pos[idx]
        assert self._cache is not None
        self._cache.layers = [
            SlabLayer(layer.keys[idx, :, start:], layer.values[idx, :, start:]) for layer in slab_layers(self._cache)
        ]
        self._static_stale = True

    def _decode(self, tokens: torch.Tensor) -> None:
        """One forward step: every running row consumes its newest token."""
        assert self._cache is not None
        if self._static is not None and (self._static_stale or not self._static.has_room(len(self._rows))):
            self._cache.layers = self._static.load(slab_layers(self._cache), self._mask_bool, self._pos)  # type: ignore[assignment]
            self._static_stale = False
        self._mask = functional.pad(self._mask, (0, 1), value=1)
        self._mask_bool = functional.pad(self._mask_bool, (0, 1), value=True)
        self.counters["kv_peak"] = max(self.counters["kv_peak"], self._mask.shape[0] * self._mask.shape[1])
        if self._static is not None:
            logits = self._static.step(tokens, self._pos, slab_layers(self._cache))
        elif self._fast is not None:
            logits = self._fast(tokens, self._pos, self._mask_bool, slab_layers(self._cache))
        else:
            attn: torch.Tensor | dict[str, torch.Tensor] = self._mask
            if self._mask_dict:  # a ready 4D mask skips transformers' per-step mask building
                attn = {"full_attention": self._mask_bool[:, None, None, :]}
            logits = self.model(  # type: ignore[misc]
                input_ids=tokens[:, None],
                attention_mask=attn,
                position_ids=self._pos[:, None],
                past_key_values=self._cache,
                use_cache=True,
                **self._keep_arg,
            ).logits[:, -1]
        self._pos = self._pos + 1
        self._logits = logits.float()
        if self._router is not None:  # the experts of each row's newest token, copied with the next sampled ids
            self._route = self._router.take()
