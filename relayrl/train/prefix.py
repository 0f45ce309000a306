"""Shared-prefix ("tree") layout of a packed micro-batch: a prompt common to several rows is computed once.

A GRPO group's n samples repeat their prompt n times: with SmolLM2's chat prompts, 8 samples x 36
prompt tokens are ~82% of a group's tokens. :func:`shared_layout` lays such rows out as one tree
document: the shared prefix ``P[:-1]`` once, then for each row a segment ``[P[-1], completion...]``
whose tokens see the prefix and, causally, their own segment only. Position ids of a segment continue
from ``len(P) - 1``, so every token sees exactly what it sees in its own row and its hidden state is
the same (rounding aside); duplicating ``P[-1]`` keeps the next-token layout regular (a segment's
positions predict its own completion). ``SharedPrefix.index`` maps each token of the plain packed
layout to the shared position computing it, so ``hidden[index]`` is the plain layout's ``[T, H]``
hidden states, and the loss code downstream (``TokenStats``, ``loss_mask``, ``cu_seqlens``) sees the
same tensors; in backward the gather sums each prefix token's gradient over its rows.

Which rows share: rows are sorted by their tokens; adjacent rows' longest common prefixes give, for
any run of sorted rows, the prefix all of them share (the smallest adjacent one). A dynamic
programme splits the sorted rows into runs that save the most tokens (``(k - 1) * (shared - 1)``
for k rows), a run sharing fewer than ``min_shared`` tokens being no run. So a group shares its
whole prompt (and any identical completion start), groups with one system preamble are not merged
into one tree that shares only the preamble, and rows sharing only part of a prompt share that part.

Attention (``relayrl.train.packing.varlen_attention_forward`` with ``relayrl_tree=`` the layout): plain
documents (unshared rows and the prefixes) as before, then each tree's segments in one SDPA call on
``[n_segments, H, W, D]`` queries over the prefix's keys/values concatenated before the segment's own
(``[n_segments, H_kv, P + W, D]``) with a ``[W, P + W]`` boolean mask built from position ids (so
sliding windows and Gemma2's soft-capped scores apply as in the plain layout; GQA via ``enable_gqa``).
Its cost is ``n x W x (P + W)``; a tree-shaped mask over the whole tree document would be
``(P + n W)^2`` (``bench/tree_attention.py``: 1.9 vs 2.0 ms for 35 + 8 x 9 tokens, 335 vs 2,190 ms
for 200 + 8 x 500, forward + backward on CPU). No ``T x T`` mask is built.

Micro-batches (:func:`plan_micro_batches`) keep a tree's rows together and count the tokens the
shared layout computes against the budget.

Where it is used: ``TorchTrainEngine`` (``train.shared_prefix``, docs/benchmarks.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from relayrl.api.engine import TensorDict
from relayrl.train.packing import TREE_KWARG, document_attention, split_by_token_budget

MIN_SHARED = 16  # fewer shared tokens are not worth a tree (and rarely a prompt)
MAX_RUN = 256  # rows one tree may take (bounds the plan's O(rows x MAX_RUN) search)

Attend = Callable[..., torch.Tensor]


@dataclass
class _Tree:
    """One tree document: ``prefix`` tokens at ``start`` (a plain document too), then segments."""

    start: int
    prefix: int
    seg_starts: list[int]
    seg_lens: list[int]
    _idx: dict[torch.device, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def indices(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(query index ``[n, W]``, key index ``[n, P + W]``, real ``[n, W]``, q_pos ``[W]``, k_pos ``[P + W]``)."""
        if device not in self._idx:
            starts = torch.tensor(self.seg_starts, device=device)
            lens = torch.tensor(self.seg_lens, device=device)
            cols = torch.arange(int(lens.max()), device=device)
            q_idx = starts[:, None] + torch.minimum(cols[None, :], lens[:, None] - 1)  # padding repeats the last token
            pre = torch.arange(self.start, self.start + self.prefix, device=device).expand(len(starts), -1)
            k_idx = torch.cat([pre, q_idx], 1)
            own = torch.arange(self.prefix, device=device)
            q_pos = self.prefix + cols
            self._idx[device] = (q_idx, k_idx, cols[None, :] < lens[:, None], q_pos, torch.cat([own, q_pos]))
        return self._idx[device]


@dataclass
class SharedPrefix:
    """A micro-batch in the shared layout: ``input_ids``/``position_ids`` ``[T']``; ``index [T]``, the
    shared position of each token of the plain packed layout; plain causal ``docs`` (start, length): the
    unshared rows and the trees' prefixes; ``trees``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index: torch.Tensor
    docs: list[tuple[int, int]]
    trees: list[_Tree]

    @property
    def saved(self) -> int:
        """Tokens the shared layout does not compute."""
        return int(self.index.shape[0] - self.input_ids.shape[0])

    def to(self, device: torch.device) -> SharedPrefix:
        return SharedPrefix(
            self.input_ids.to(device), self.position_ids.to(device), self.index.to(device), self.docs, self.trees
        )

    def model_inputs(self) -> dict[str, object]:
        """Keyword arguments for ``model(**...)`` (attention ``relayrl_varlen``, which reads ``relayrl_tree``)."""
        return {
            "input_ids": self.input_ids.unsqueeze(0),
            "position_ids": self.position_ids.unsqueeze(0),
            TREE_KWARG: self,
            "use_cache": False,
        }

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attend: Attend) -> torch.Tensor:
        """``[1, H, T', D]`` queries, ``[1, H_kv, T', D]`` keys/values -> ``[H, T', D]``. ``attend(q, k, v,
        q_pos, k_pos)`` is causal attention by position (``relayrl.train.packing._causal_attention``)."""
        q, k, v = query[0], key[0], value[0]
        starts, lengths = zip(*self.docs, strict=True)
        positions, outs = document_attention(q, k, v, starts, lengths, attend)
        for tree in self.trees:
            q_idx, k_idx, real, q_pos, k_pos = tree.indices(q.device)
            o = attend(
                q[:, q_idx].transpose(0, 1), k[:, k_idx].transpose(0, 1), v[:, k_idx].transpose(0, 1), q_pos, k_pos
            )
            outs.append(o.transpose(0, 1)[:, real])
            positions.append(q_idx[real])
        return torch.cat(outs, 1)[:, torch.argsort(torch.cat(positions))]


def plan_runs(rows: list[list[int]], min_shared: int = MIN_SHARED) -> list[tuple[list[int], int]]:
    """Rows (token lists) -> ``(row indices, shared tokens)`` runs covering every row once; a run of one
    row shares nothing (0). Chosen to save the most tokens (see the module docstring)."""
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    # longest common prefixes of adjacent sorted rows (os.path.commonprefix compares lists element-wise)
    adj = [len(os.path.commonprefix([rows[a], rows[b]])) for a, b in zip(order[:-1], order[1:], strict=True)]
    n = len(order)
    best = [0] * (n + 1)  # best[j]: tokens saved on the first j sorted rows
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # (start of the last run, its shared tokens)
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1], (j - 1, 0)
        shared = 1 << 62
        for i in range(j - 2, max(j - 1 - MAX_RUN, 0) - 1, -1):  # the run i..j-1 shares min(adj[i..j-2])
            shared = min(shared, adj[i])
            if shared < min_shared:
                break
            gain = best[i] + (j - 1 - i) * (shared - 1)
            if gain > best[j]:
                best[j], cut[j] = gain, (i, shared)
    runs, j = [], n
    while j > 0:
        i, shared = cut[j]
        runs.append(([order[r] for r in range(i, j)], shared))
        j = i
    return runs[::-1]


def plan_micro_batches(
    ids: torch.Tensor, lengths: list[int], budget: int, min_shared: int = MIN_SHARED
) -> list[list[int]]:
    """Rows of a padded batch (``ids [B, L]``, real ``lengths``) in micro-batches of at most ``budget``
    *computed* tokens that keep each tree's rows together: the trees of the whole batch (a tree larger
    than the budget in chunks that each still share the prefix) and the plain rows, bin-packed by what
    they cost in the shared layout (``relayrl.train.packing.split_by_token_budget``)."""
    rows = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
    units: list[tuple[list[int], int]] = []  # (rows, tokens computed)
    for members, shared in plan_runs(rows, min_shared):
        p = max(shared - 1, 0)
        chunk: list[int] = []
        cost = p
        for r in members:
            if chunk and cost + lengths[r] - p > budget:
                units.append((chunk, cost))
                chunk, cost = [], p
            chunk.append(r)
            cost += lengths[r] - p
        units.append((chunk, cost))
    groups = split_by_token_budget([cost for _, cost in units], budget)
    return [sorted(r for u in g for r in units[u][0]) for g in groups]


def shared_layout(packed: TensorDict, min_shared: int = MIN_SHARED) -> SharedPrefix | None:
    """The shared layout of a packed micro-batch (on CPU), or None when no rows share ``min_shared`` tokens."""
    ids = packed["input_ids"].cpu()
    cu = packed["cu_seqlens"].long().cpu().tolist()
    rows = [ids[s:e].tolist() for s, e in zip(cu[:-1], cu[1:], strict=True)]
    runs = plan_runs(rows, min_shared)
    if all(shared == 0 for _, shared in runs):
        return None
    index = torch.empty(len(ids), dtype=torch.long)
    pieces: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    docs: list[tuple[int, int]] = []
    trees: list[_Tree] = []
    at = 0
    for members, shared in runs:
        # the prefix but P[-1], which goes into each segment; an unshared row is all prefix: a plain document
        first = cu[members[0]]
        p = shared - 1 if shared else cu[members[0] + 1] - first
        start = at
        pieces.append(ids[first : first + p])
        positions.append(torch.arange(p))
        docs.append((start, p))
        at += p
        seg_starts, seg_lens = [], []
        for r in members:
            n = cu[r + 1] - cu[r] - p
            pieces.append(ids[cu[r] + p : cu[r + 1]])
            positions.append(torch.arange(p, p + n))
            index[cu[r] : cu[r] + p] = torch.arange(start, start + p)
            index[cu[r] + p : cu[r + 1]] = torch.arange(at, at + n)
            seg_starts.append(at)
            seg_lens.append(n)
            at += n
        if shared:
            trees.append(_Tree(start, p, seg_starts, seg_lens))
    return SharedPrefix(torch.cat(pieces), torch.cat(positions), index, docs, trees)
