"""The LM head only where a loss needs it: logprobs and entropies at loss positions, chunked.

relayrl's generic training path hands a ``LossFn`` the ``[T, V]`` logits of every packed
position. For a 49k vocabulary most of that work and memory goes to prompt positions that
carry no loss (82% of a GRPO micro-batch on SmolLM2) and the ``[T, V]`` fp32 copies kept for
backward. :class:`TokenStats` instead holds the model body's final hidden states ``[T, H]``
and computes ``lm_head`` + fp32 log-softmax + the taken token's logprob + the entropy only at
the positions that predict a ``loss_mask`` token, ``chunk`` positions at a time, each chunk under
``torch.utils.checkpoint`` (recomputed in backward), so no ``[T, V]`` tensor is ever kept.

The seam: a loss that only needs per-token logprobs / entropies says so with
:func:`token_stats_loss` (the actor's built-in loss does, unless it distils). The engine then
passes it a :class:`TokenStats` where the logits would go; ``relayrl.train.packing``'s
``token_logprobs`` / ``token_entropy`` accept either. Every other loss (custom ``LossFn`` s,
distillation, value/reward heads) still gets full logits, and so does every loss where the fast
path would not give the same numbers or cannot run (``TorchTrainEngine._head_stats_ok``).

Values at positions outside the loss mask are 0 (the generic path computes them; no built-in
loss reads them).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.nn import functional
from torch.utils.checkpoint import checkpoint

from relayrl.api.engine import TensorDict

CHUNK = 512
TOKEN_STATS_ATTR = "relayrl_token_stats"
_F = TypeVar("_F", bound=Callable[..., torch.Tensor])


def token_stats_loss(fn: _F) -> _F:
    """Mark a ``LossFn`` that only calls ``token_logprobs`` / ``token_entropy`` on its logits
    argument (and reads them only where ``loss_mask`` is set): the engine may then pass a
    :class:`TokenStats` instead of ``[T, V]`` logits."""
    setattr(fn, TOKEN_STATS_ATTR, True)
    return fn


def wants_token_stats(fn: object) -> bool:
    return bool(getattr(fn, TOKEN_STATS_ATTR, False))


def loss_positions(packed: TensorDict) -> torch.Tensor:
    """Packed indices of the loss tokens that have a predecessor in their sequence (every generated one)."""
    mask = packed["loss_mask"].bool().clone()
    mask[packed["cu_seqlens"][:-1].long()] = False
    return mask.nonzero().squeeze(1)


def label_logprobs(lg: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[N]`` logprobs of ``labels [N]`` under fp32 logits ``[N, V]``: both paths' ``token_logprobs``."""
    return lg.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lg, -1)


def entropy(lg: torch.Tensor) -> torch.Tensor:
    """``[N]`` entropies of fp32 logits ``[N, V]``: both paths' ``token_entropy``."""
    logp = functional.log_softmax(lg, -1)
    return -(logp.exp() * logp).sum(-1)


def _head_chunk(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    lg = functional.linear(h, weight, bias).float()  # then / T as the generic path (packing._chunked) does
    if temperature != 1.0:
        lg = lg / temperature
    return label_logprobs(lg, labels), entropy(lg)


class TokenStats:
    """Lazy ``[T]`` token-aligned logprobs / entropies of a packed micro-batch at its loss tokens."""

    def __init__(self, hidden: torch.Tensor, head: torch.nn.Linear, packed: TensorDict, chunk: int = CHUNK) -> None:
        if hidden.dim() != 2:
            raise ValueError(f"hidden must be [T, H], got {tuple(hidden.shape)}")
        self.hidden, self.head, self.chunk = hidden, head, chunk
        ids = packed["input_ids"].to(hidden.device)
        self.n = ids.shape[0]
        self.targets = loss_positions(packed).to(hidden.device)  # token-aligned positions that get a value
        self.labels = ids[self.targets]
        self._cache: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}
        self._detached = False

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.head.out_features))

    def detach(self) -> TokenStats:
        out = copy.copy(self)  # shares the cache: one computation serves both
        out._detached = True
        return out

    def _compute(self, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if temperature not in self._cache:
            h = self.hidden[self.targets - 1]  # hidden state i predicts token i + 1
            w, b = self.head.weight, self.head.bias
            lps, ents = [], []
            for s in range(0, h.shape[0], self.chunk):
                args = (h[s : s + self.chunk], w, b, self.labels[s : s + self.chunk], temperature)
                if torch.is_grad_enabled():
                    lp, en = checkpoint(_head_chunk, *args, use_reentrant=False)
                else:
                    lp, en = _head_chunk(*args)
                lps.append(lp)
                ents.append(en)
            zero = self.hidden.new_zeros(self.n, dtype=torch.float32)
            if lps:
                logp = zero.index_put((self.targets,), torch.cat(lps))
                ent = zero.index_put((self.targets,), torch.cat(ents))
            else:
                logp, ent = zero, zero.clone()
            self._cache[temperature] = (logp, ent)
        logp, ent = self._cache[temperature]
        return (logp.detach(), ent.detach()) if self._detached else (logp, ent)

    def logprobs(self, temperature: float = 1.0) -> torch.Tensor:
        """``[T]``: log p(input_ids[i] | earlier tokens) at loss tokens, 0 elsewhere."""
        return self._compute(temperature)[0]

    def entropy(self, temperature: float = 1.0) -> torch.Tensor:
        """``[T]``: entropy of the distribution that predicted loss token i, 0 elsewhere."""
        return self._compute(temperature)[1]
