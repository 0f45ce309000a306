"""Batched sampling with exact logprobs, reproducible independently of batch composition.

Every row of a decode batch carries its own knobs (temperature, top-k, top-p, greedy) and its
own random stream: the uniform number used to draw token ``t`` of a request is a hash of
``(request key, t)``, so a seeded engine samples the same tokens for the same requests no
matter which other requests share the batch or when they joined. Tokens are drawn by
inverse-CDF over the sampling distribution.

The logprob returned for a token is ``log softmax(logits / T)`` at that token, renormalised
over the top-k / top-p set only when those filters are on (greedy: ``T = 1``, no filter).
Tokens banned by ``min_new_tokens`` are removed from the draw but the logprob is not
renormalised for them, so it stays the policy's logprob a trainer recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from relayrl.api.io import GenerationConfig
    from relayrl.inference.local.seq import Seq

_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32) on int64 tensors holding values < 2**32."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def uniform(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Deterministic uniforms in (0, 1), float64 [B], one per (key, counter) pair."""
    h = _hash32(_hash32(keys ^ (keys >> 32)) ^ _hash32(counters + 0x9E3779B9))
    return (h.double() + 0.5) / 4294967296.0


@dataclass
class RowParams:
    """Per-row sampling knobs of a batch, as tensors of length B."""

    temperature: torch.Tensor  # float32 [B]; 1.0 for greedy rows
    top_k: torch.Tensor  # int64 [B]; 0 = off
    top_p: torch.Tensor  # float32 [B]; 1.0 = off
    greedy: torch.Tensor  # bool [B]
    keys: torch.Tensor  # int64 [B]; random stream of each row
    counters: torch.Tensor  # int64 [B]; index of the token being drawn
    any_filter: bool = False
    any_greedy: bool = False
    all_temp_one: bool = True

    @classmethod
    def of(cls, seqs: list[Seq], device: torch.device | str | None = None) -> RowParams:
        """The knobs of ``seqs``' rows (greedy rows as temperature 1, no filter); counters at their outputs."""
        greedy = [s.g.greedy for s in seqs]
        temps = [1.0 if s.g.greedy else s.g.temperature for s in seqs]
        top_k = [0 if s.g.greedy else s.g.top_k for s in seqs]
        top_p = [1.0 if s.g.greedy else s.g.top_p for s in seqs]
        return cls(
            temperature=torch.tensor(temps, device=device),
            top_k=torch.tensor(top_k, device=device),
            top_p=torch.tensor(top_p, device=device),
            greedy=torch.tensor(greedy, device=device),
            keys=torch.tensor([s.key for s in seqs], device=device),
            counters=torch.tensor([len(s.out) for s in seqs], device=device),
            any_filter=any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p),
            any_greedy=any(greedy),
            all_temp_one=all(t == 1.0 for t in temps),
        )


def filtered_logprobs(logits: torch.Tensor, p: RowParams) -> torch.Tensor:
    """log of the distribution each row samples from: softmax(logits / T), then top-k/top-p."""
    logits = logits.float()
    if not p.all_temp_one:
        logits = logits / p.temperature[:, None]
    if p.any_filter:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(p.top_k > 0, p.top_k, vocab)[:, None]
        drop = ranks >= k
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop |= mass_before >= p.top_p[:, None]
        drop_orig = torch.zeros_like(drop).scatter(-1, order, drop)
        logits = logits.masked_fill(drop_orig, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def penalized(logits: torch.Tensor, seqs: list[Seq], rows: list[int]) -> torch.Tensor:
    """OpenAI's frequency / presence penalties (as vLLM applies them: over the output tokens so far,
    before temperature): ``logit[t] -= frequency * count(t) + presence * (count(t) > 0)`` for
    ``rows`` (``seqs[j]`` is row ``rows[j]``, with ``.out`` and ``.g``). Returns a new tensor."""
    out = logits.float().clone()
    for r, seq in zip(rows, seqs, strict=True):
        counts = torch.bincount(
            torch.tensor(seq.out, dtype=torch.long, device=logits.device), minlength=logits.shape[-1]
        ).float()
        out[r] -= seq.g.frequency_penalty * counts[: logits.shape[-1]] + seq.g.presence_penalty * (counts > 0).float()
    return out


def top_logprobs(logits: torch.Tensor, output: list[int], g: GenerationConfig, k: int) -> list[list[tuple[int, float]]]:
    """OpenAI's ``top_logprobs`` from the logits that produced each of ``output`` ([T, V]): the ``k``
    most likely tokens under the distribution sampled (penalties, temperature, top-k/top-p), per position."""
    from relayrl.inference.local.seq import Seq

    rows = [Seq(prompt=[], g=g, key=0, on_done=lambda r: None, out=list(output[:i])) for i in range(len(output))]
    logits = penalized(logits, rows, list(range(len(rows)))) if g.frequency_penalty or g.presence_penalty else logits
    logp = filtered_logprobs(logits.cpu(), RowParams.of(rows))
    vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return [[(int(j), float(v)) for v, j in zip(vr, ir, strict=True)] for vr, ir in zip(vals, idx, strict=True)]


def sample(logits: torch.Tensor, p: RowParams, banned: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns (tokens int64 [B], logprobs float32 [B]).

    ``banned`` (bool [B, V]) removes tokens from the draw (min_new_tokens) without changing
    the reported logprobs.
    """
    logp = filtered_logprobs(logits, p)
    draw = logp if banned is None else logp.masked_fill(banned, float("-inf"))
    probs = torch.exp(draw.double())
    cdf = torch.cumsum(probs, dim=-1)
    u = uniform(p.keys, p.counters) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    if p.any_greedy:
        tokens = torch.where(p.greedy, draw.argmax(dim=-1), tokens)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
