"""The generator–trainer gap: dropout off for RL, the per-step ``mismatch/`` metrics, and the
rollout corrections (truncated / masked importance sampling) any policy loss can use.

The generator's logprob of a sampled token and the trainer's recomputation of it at the same
weights should agree; where they do not (dtype, kernels, dropout, MoE routing, stale weights)
the policy gradient is silently biased. ``mismatch_metrics`` measures the gap every step;
``correction_weights`` computes the importance weights pi_trainer / pi_generator that
truncated (TIS) or masked (MIS, IcePop-style) importance sampling applies to the loss.
docs/mismatch.md says which to pick.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from relayrl.api.mismatch import RolloutCorrectionConfig
from relayrl.train.algorithms import seq_sums, seq_to_tokens

# completion-position buckets (token index within the generated part): [lo, hi)
POSITION_BUCKETS = ((0, 16), (16, 64), (64, 256), (256, 1024), (1024, 1 << 30))
LOG_BOUND = 20.0  # log-ratios are clamped to +-20 before exponentiating (exp(20) ~ 4.9e8)


def disable_dropout(model: nn.Module) -> int:
    """Turn every dropout of ``model`` off (also float ``*dropout*`` attributes attention passes to SDPA, and
    config fields read at forward time); returns how many non-zero values it changed. RL needs the trainer
    to score tokens exactly as the generator sampled them: dropout in the update is noise in every ratio."""
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            changed += module.p != 0
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float) and not isinstance(value, bool):
                changed += value != 0
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)  # a Hugging Face config: the text config is its own or a nested one
    for cfg in [] if config is None else [config, config.get_text_config()]:
        for name, value in list(vars(cfg).items()):
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
                changed += value != 0
                setattr(cfg, name, 0.0)
    return int(changed)


def _gap_stats(diff: torch.Tensor) -> dict[str, float]:
    """Mean / max |Δ logprob| and k3 KL(generator || trainer) of the selected log-ratios."""
    k3 = diff.exp() - 1 - diff
    return {
        "abs_diff_mean": float(diff.abs().mean()),
        "abs_diff_max": float(diff.abs().max()),
        "k3": float(k3.mean()),
        "tokens": float(diff.numel()),
    }


def mismatch_metrics(
    gen_logp: torch.Tensor,
    train_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    versions: torch.Tensor | None = None,
    version: int = 0,
    truncated: torch.Tensor | None = None,
    expert_flips: Sequence[float] | None = None,
) -> dict[str, float]:
    """The ``mismatch/`` metrics of one batch (``[B, L]`` padded tensors, loss tokens only).

    ``d = train_logp - gen_logp`` (log pi_trainer / pi_generator of each sampled token):
    ``abs_diff_mean`` / ``abs_diff_max`` of ``|d|``; ``k3`` = mean of ``exp(d) - 1 - d``, an
    unbiased, non-negative estimate of KL(generator || trainer) from the generator's samples;
    the same three per completion-position bucket (``pos_<lo>_<hi>/``), per stop reason
    (``stop/``, ``length/``: the sequence-level ``truncated`` key), per version lag (``lag_<k>/``,
    trainer version minus the token's); ``ess`` = (Σw)² / (n Σw²) of the token weights
    ``w = exp(d)`` and ``ess_seq`` of the sequence weights ``exp(Σ_t d)`` (1 = no mismatch,
    1/n = one sample carries all the weight); ``expert_flip_frac`` = share of recorded
    (token, MoE layer) routings where the trainer's own top-k differs from the generator's."""
    mask = loss_mask.bool()
    if not bool(mask.any()):
        return {}
    d = (train_logp.double() - gen_logp.double()).clamp(-LOG_BOUND, LOG_BOUND)
    out = _gap_stats(d[mask])

    def add(name: str, sel: torch.Tensor) -> None:
        if bool(sel.any()):
            out.update({f"{name}/{k}": v for k, v in _gap_stats(d[sel]).items()})

    pos = mask.long().cumsum(1) - 1  # [B, L] index of each loss token among its row's loss tokens
    for lo, hi in POSITION_BUCKETS:
        add(f"pos_{lo}_{hi}", mask & (pos >= lo) & (pos < hi))
    if truncated is not None:
        rows = truncated.bool().view(-1, 1).expand_as(mask)
        add("length", mask & rows)
        add("stop", mask & ~rows)
    if versions is not None:
        lag = version - versions.long()
        for k in sorted(set(lag[mask].tolist())):
            add(f"lag_{k}", mask & (lag == k))
    w = d[mask].exp()
    out["ess"] = float(w.sum().square() / (w.numel() * w.square().sum()))
    ws = (d * mask).sum(1)[mask.any(1)].clamp(-LOG_BOUND, LOG_BOUND).exp()
    out["ess_seq"] = float(ws.sum().square() / (ws.numel() * ws.square().sum()))
    if expert_flips is not None and expert_flips[1] > 0:
        out["expert_flip_frac"] = expert_flips[0] / expert_flips[1]
    return out


def correction_weights(
    trainer_logp: torch.Tensor,
    gen_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    corr: RolloutCorrectionConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T], keep [T])`` of one packed micro-batch: the rollout correction's
    importance weight ``w = pi_trainer / pi_generator`` of each token (detached), per token,
    per sequence (``corr.level="sequence"``: the product of its tokens' ratios, verl / TRL) or the
    sequence's geometric mean (``"geometric"``). ``corr.mode="truncate"`` (TIS) clamps ``w`` to
    ``[low, high]`` (no lower bound when ``low`` is None); ``"mask"`` (MIS / IcePop) sets ``w = 0``
    and ``keep = False`` where ``w`` is outside ``[low, high]`` (``low`` None: ``1 / high``)."""
    m = loss_mask.to(torch.float64)
    log_w = (trainer_logp.detach().double() - gen_logp.double()) * m
    if corr.level in ("sequence", "geometric"):
        per_seq = seq_sums(log_w, cu_seqlens)
        if corr.level == "geometric":
            per_seq = per_seq / seq_sums(m, cu_seqlens).clamp(min=1.0)
        log_w = seq_to_tokens(per_seq, cu_seqlens, log_w.shape[0])
    elif corr.level != "token":
        raise ValueError(f"rollout correction level must be token|sequence|geometric, got {corr.level!r}")
    w = log_w.clamp(-LOG_BOUND, LOG_BOUND).exp()
    keep = loss_mask.bool()
    if corr.mode == "truncate":
        w = w.clamp(min=corr.low, max=corr.high)
    elif corr.mode == "mask":
        lo = 1.0 / corr.high if corr.low is None else corr.low
        inside = (w >= lo) & (w <= corr.high)
        keep = keep & inside
        w = torch.where(inside, w, 0.0)
    else:
        raise ValueError(f"rollout correction mode must be truncate|mask, got {corr.mode!r}")
    return torch.where(loss_mask.bool(), w, 0.0).to(trainer_logp.dtype), keep
