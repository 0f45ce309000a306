"""RL math as pure, registered functions over tensors: advantages, reward shaping, losses.

Every algorithm of the GRPO/PPO family is a choice of one advantage estimator and one policy
loss (plus a few knobs), so each piece is a small function a researcher can read or replace::

    @register_advantage("my_adv")
    def my_adv(rewards, loss_mask, group_id, **_): ...

    @register_loss("my_loss")
    def my_loss(logp, old_logp, advantages, loss_mask, cu_seqlens, **_): ...

Advantage estimators work on the padded batch (``[B]`` sequence-level, ``[B, L]`` token-level)
and return ``(advantages [B, L], returns [B, L])``, zero outside ``loss_mask``. Losses work on
one *packed* micro-batch (1D token tensors laid end to end, ``cu_seqlens`` marking sequence
boundaries) and return ``(scalar loss, stats)``. Both take keyword arguments and ignore the
ones they do not use, so the actor can call any of them the same way.
"""

from __future__ import annotations

import torch

from relayrl.train.registry import (  # noqa: F401 (the registry is used, and documented, through this module)
    ADVANTAGES,
    LOSSES,
    AdvantageFn,
    Algorithm,
    PolicyLossFn,
    advantage_entry,
    get_advantage,
    get_loss,
    loss_entry,
    register_advantage,
    register_loss,
)

Tensor = torch.Tensor
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` where ``mask`` is set; 0 when nothing is."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def seq_ids(cu_seqlens: Tensor, n_tokens: int) -> Tensor:
    """Sequence index of every packed token ``[T]``; tokens past ``cu_seqlens[-1]`` get ``n_seqs``."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    if len(ids) < n_tokens:  # trailing padding of a packed micro-batch belongs to no sequence
        ids = torch.cat([ids, ids.new_full((n_tokens - len(ids),), len(lengths))])
    return ids


def seq_sums(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Per-sequence sums ``[n_seqs]`` of a packed ``[T]`` tensor (differentiable)."""
    n = len(cu_seqlens) - 1
    out = x.new_zeros(n + 1).index_add(0, seq_ids(cu_seqlens, x.shape[0]), x)
    return out[:n]


def seq_means(x: Tensor, mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Per-sequence means ``[n_seqs]`` of a packed ``[T]`` tensor over ``mask`` (0 for a sequence without one)."""
    m = mask.to(x.dtype)
    return seq_sums(x * m, cu_seqlens) / seq_sums(m, cu_seqlens).clamp(min=1.0)


def seq_to_tokens(per_seq: Tensor, cu_seqlens: Tensor, n_tokens: int) -> Tensor:
    """``[T]``: each packed token gets its sequence's value of ``per_seq [n_seqs]`` (trailing padding 0)."""
    return torch.cat([per_seq, per_seq.new_zeros(1)])[seq_ids(cu_seqlens, n_tokens)]


def agg_loss(
    values: Tensor, mask: Tensor, cu_seqlens: Tensor, mode: str = "token-mean", norm_len: float = 0.0
) -> Tensor:
    """Reduce packed per-token ``values`` to one number.

    - ``token-mean``: mean over all loss tokens (DAPO, TRL ``bnpo``/``dapo``).
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (GRPO).
    - ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.
    - ``seq-mean-token-sum-norm``: token sum / (n_seqs * ``norm_len``) (Dr.GRPO: a constant,
      length-independent normaliser, ``norm_len`` = max_new_tokens).

    The sequence modes count every sequence of the micro-batch, also those with no loss token.
    """
    if mode == "token-mean":
        return masked_mean(values, mask)
    n_seqs = max(len(cu_seqlens) - 1, 1)
    if mode == "seq-mean-token-mean":
        return seq_means(values, mask, cu_seqlens).sum() / n_seqs
    sums = seq_sums(values * mask.to(values.dtype), cu_seqlens)
    if mode == "seq-mean-token-sum":
        return sums.sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        if norm_len <= 0:
            raise ValueError(f"agg_loss mode {mode!r} needs norm_len > 0 (the max completion length), got {norm_len}")
        return sums.sum() / (n_seqs * norm_len)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {AGG_MODES}")


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1/k2/k3).

    k1 = log pi - log ref (unbiased, high variance); k2 = (log pi - log ref)^2 / 2;
    k3 = ref/pi - log(ref/pi) - 1 (unbiased, non-negative, low variance).
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        neg = (-log_ratio).clamp(-20.0, 20.0)
        return neg.exp() - neg - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; choose k1, k2 or k3")


# --------------------------------------------------------------------------------------
# Reward shaping (padded batch)
# --------------------------------------------------------------------------------------


def shape_rewards(
    rewards: Tensor,
    scale: float = 1.0,
    bias: float = 0.0,
    clip: float = 0.0,
    response_lengths: Tensor | None = None,
    max_len: int = 0,
    overlong_buffer: int = 0,
    overlong_penalty: float = 1.0,
) -> Tensor:
    """``clip(scale * r + bias)`` plus DAPO's soft overlong penalty.

    The penalty is 0 up to ``max_len - overlong_buffer`` tokens, then falls linearly to
    ``-overlong_penalty`` at ``max_len`` (and stays there beyond it).
    """
    out = rewards * scale + bias
    if clip > 0:
        out = out.clamp(-clip, clip)
    if overlong_buffer > 0:
        if response_lengths is None or max_len <= 0:
            raise ValueError("overlong penalty needs response_lengths and max_len > 0 (the generation limit)")
        exceed = (response_lengths.to(out.dtype) - (max_len - overlong_buffer)).clamp(0.0, overlong_buffer)
        out = out - exceed / overlong_buffer * overlong_penalty
    return out


def last_token_rewards(rewards: Tensor, loss_mask: Tensor) -> Tensor:
    """``[B, L]`` per-token rewards: each sequence's reward on its last generated token."""
    mask = loss_mask.bool()
    last = torch.where(mask, torch.arange(mask.shape[1], device=mask.device), -1).amax(1)
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    has = last >= 0
    out[has.nonzero().squeeze(1), last[has]] = rewards[has]
    return out


def discounted_returns(token_rewards: Tensor, loss_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over the generated tokens of each row (gaps skipped)."""
    mask = loss_mask.to(token_rewards.dtype)
    out = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        running = m * (token_rewards[:, t] + gamma * running) + (1 - m) * running
        out[:, t] = running * m
    return out


# --------------------------------------------------------------------------------------
# Advantage estimators: (advantages [B, L], returns [B, L])
# --------------------------------------------------------------------------------------


def _group_stats(rewards: Tensor, group_id: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row group mean, unbiased group std and group size."""
    if group_id is None:
        raise ValueError("group advantage estimators need the sequence-level batch key 'group_id' [B]")
    _, inv = torch.unique(group_id, return_inverse=True)
    n_groups = int(inv.max()) + 1 if len(inv) else 0
    r = rewards.to(torch.float64)
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add(0, inv, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add(0, inv, r) / count
    sq = torch.zeros_like(count).index_add(0, inv, (r - mean[inv]).square())
    std = (sq / (count - 1).clamp(min=1.0)).sqrt()
    return mean[inv].to(rewards.dtype), std[inv].to(rewards.dtype), count[inv]


def _outcome(adv: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """A sequence-level advantage ``[B]`` on every loss token ``[B, L]``: the advantages, and the returns."""
    out = adv.unsqueeze(1) * loss_mask.to(adv.dtype)
    return out, out


@register_advantage("grpo", needs_groups=True, reads=("adv_norm", "adv_eps"))
def grpo_advantage(
    rewards: Tensor, loss_mask: Tensor, group_id: Tensor, adv_norm: bool = True, adv_eps: float = 1e-6, **_: object
) -> tuple[Tensor, Tensor]:
    """GRPO: ``(r - group mean) / (group std + adv_eps)`` (std optional); a group of one gets 0."""
    mean, std, count = _group_stats(rewards, group_id)
    adv = rewards - mean
    if adv_norm:
        adv = adv / (std + adv_eps)
    return _outcome(torch.where(count > 1, adv, 0.0), loss_mask)


@register_advantage("dr_grpo", needs_groups=True)
def dr_grpo_advantage(rewards: Tensor, loss_mask: Tensor, group_id: Tensor, **_: object) -> tuple[Tensor, Tensor]:
    """Dr.GRPO: ``r - group mean`` (no std; the length normalisation is removed in the loss)."""
    return grpo_advantage(rewards, loss_mask, group_id, adv_norm=False)


@register_advantage("rloo", needs_groups=True)
def rloo_advantage(rewards: Tensor, loss_mask: Tensor, group_id: Tensor, **_: object) -> tuple[Tensor, Tensor]:
    """RLOO: ``r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean)``; a group of one gets 0."""
    mean, _std, count = _group_stats(rewards, group_id)
    adv = torch.where(count > 1, (rewards - mean) * count / (count - 1).clamp(min=1.0), 0.0).to(rewards.dtype)
    return _outcome(adv, loss_mask)


@register_advantage("reinforce", reads=("gamma", "baseline"))
def reinforce_advantage(
    rewards: Tensor,
    loss_mask: Tensor,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    baseline: bool = True,
    **_: object,
) -> tuple[Tensor, Tensor]:
    """REINFORCE: discounted return-to-go, minus the batch-mean reward as a baseline."""
    if token_rewards is None:
        token_rewards = last_token_rewards(rewards, loss_mask)
    returns = discounted_returns(token_rewards, loss_mask, gamma)
    adv = returns - token_rewards.sum(1).mean() if baseline else returns
    return adv * loss_mask.to(adv.dtype), returns


@register_advantage("reinforce_pp", reads=("gamma", "adv_norm", "adv_eps"))
def reinforce_pp_advantage(
    rewards: Tensor,
    loss_mask: Tensor,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    adv_norm: bool = True,
    adv_eps: float = 1e-8,
    **_: object,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: return-to-go of per-token rewards (KL penalties included), whitened over the batch.

    Whitening uses the mean and unbiased std over all generated tokens of the batch.
    """
    if token_rewards is None:
        token_rewards = last_token_rewards(rewards, loss_mask)
    returns = discounted_returns(token_rewards, loss_mask, gamma)
    adv, vals = returns, returns[loss_mask.bool()]
    if adv_norm and vals.numel() > 1:
        adv = (returns - vals.mean()) / (vals.std() + adv_eps)
    elif adv_norm and vals.numel():  # one token: centred only (no std)
        adv = returns - vals.mean()
    return adv * loss_mask.to(adv.dtype), returns


@register_advantage("remax")
def remax_advantage(
    rewards: Tensor, loss_mask: Tensor, baseline_rewards: Tensor | None = None, **_: object
) -> tuple[Tensor, Tensor]:
    """ReMax: reward minus the reward of the greedy completion of the same prompt.

    ``baseline_rewards [B]`` is set by the ReMax workflow.
    """
    if baseline_rewards is None:
        raise ValueError("remax needs the sequence-level batch key 'baseline_rewards' (set by the remax workflow)")
    return _outcome(rewards - baseline_rewards.to(rewards.dtype), loss_mask)


@register_advantage("gae", needs_critic=True, reads=("gamma", "lam", "adv_norm", "adv_eps"))
def gae_advantage(
    rewards: Tensor,
    loss_mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    adv_norm: bool = True,
    adv_eps: float = 1e-6,
    **_: object,
) -> tuple[Tensor, Tensor]:
    """GAE over the generated tokens of each row (non-generated tokens are skipped).

    ``values[t]`` is V of the state just before token ``t`` was generated; the state after the
    last token is terminal (value 0). ``returns = advantages + values`` (critic targets, from
    the raw advantages). With ``adv_norm`` the advantages are whitened over the batch's loss tokens,
    ``(A - mean) / sqrt(var + adv_eps)`` with the unbiased variance, as verl's and TRL's PPO do.
    """
    if values is None:
        raise ValueError("gae needs the token-level batch key 'values' (from a Critic)")
    if token_rewards is None:
        token_rewards = last_token_rewards(rewards, loss_mask)
    mask = loss_mask.to(values.dtype)
    adv = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    running = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = m * (delta + gamma * lam * running) + (1 - m) * running
        next_value = m * values[:, t] + (1 - m) * next_value
        adv[:, t] = running * m
    returns = (adv + values) * mask
    if adv_norm:
        sel = adv[loss_mask.bool()]
        if sel.numel() > 1:
            adv = (adv - sel.mean()) * torch.rsqrt(sel.var(unbiased=True) + adv_eps) * mask
    return adv, returns


# --------------------------------------------------------------------------------------
# Losses over a packed micro-batch: (loss, stats)
# --------------------------------------------------------------------------------------


def _ratio_stats(ratio: Tensor, log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    m = mask.bool()
    r = ratio.detach()[m]
    return {
        "approx_kl": masked_mean(-log_ratio.detach(), mask),
        "ratio_mean": r.mean() if r.numel() else r.new_zeros(()),
        "ratio_max": r.max() if r.numel() else r.new_zeros(()),
    }


def _clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_clip: float,
    eps_clip_higher: float | None,
    c_clip: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token ``-min(r A, clip(r) A)`` of ``r = exp(log_ratio)``, with dual clip ``min(., -c A)`` for
    ``A < 0``; the stats include the ratio's (``_ratio_stats``)."""
    ratio = log_ratio.exp()
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(loss1, loss2)
    stats = {"clip_frac": masked_mean((loss2 > loss1).float(), mask)}
    if c_clip is not None:
        if c_clip <= 1.0:
            raise ValueError(f"c_clip must be > 1, got {c_clip}")
        loss3 = -advantages * c_clip
        dual = (advantages < 0) & (loss > loss3)
        loss = torch.where(advantages < 0, torch.minimum(loss, loss3), loss)
        stats["dual_clip_frac"] = masked_mean(dual.float(), mask)
    return loss, {**stats, **_ratio_stats(ratio, log_ratio, mask)}


_CLIP = ("eps_clip", "eps_clip_higher", "c_clip")
_AGG = ("loss_agg_mode", "loss_norm_len")
_BEHAV = ("behav_imp_weight_cap", "behav_imp_weight_floor", "behav_weight_level", "behav_weight_clip")


@register_loss("ppo", reads=_CLIP + _AGG)
def ppo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    loss_agg_mode: str = "token-mean",
    loss_norm_len: float = 0.0,
    **_: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (with DAPO clip-higher and dual clip), ratio against ``old_logp``."""
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    per_token, stats = _clipped_surrogate(log_ratio, advantages, loss_mask, eps_clip, eps_clip_higher, c_clip)
    return agg_loss(per_token, loss_mask, cu_seqlens, loss_agg_mode, loss_norm_len), stats


@register_loss("decoupled_ppo", needs_prox_logp=True, reads=_CLIP + _BEHAV + _AGG)
def decoupled_ppo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    prox_logp: Tensor | None = None,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    behav_imp_weight_cap: float | None = None,
    behav_imp_weight_floor: float | None = None,
    behav_weight_level: str = "token",
    behav_weight_clip: str = "mask",
    loss_agg_mode: str = "token-mean",
    loss_norm_len: float = 0.0,
    **_: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (AReaL): clip against the proximal policy, reweight by pi_prox / pi_behav.

    ``old_logp`` is the behaviour policy (the generator's logprobs), ``prox_logp`` the trainer's
    recomputation before this update. The behaviour weight is per token (``behav_weight_level=
    "token"``, AReaL) or one per sequence, the geometric mean of its token weights (``"sequence"``,
    as GSPO's ratio). With one optimizer step per batch the proximal policy is the current one,
    so the clip never acts: only ``ppo`` (clipped against the behaviour policy) then bounds the
    update on stale data. Weights above ``behav_imp_weight_cap`` get weight 0 but still count in the
    normaliser (``behav_weight_clip="mask"``, AReaL) or are cut to the cap (``"truncate"``);
    weights below ``behav_imp_weight_floor`` are masked either way (a two-sided trust region
    around the behaviour policy, as verl's rollout correction).
    """
    if prox_logp is None:
        raise ValueError("decoupled_ppo needs prox_logp (the trainer's logprobs before the update)")
    if behav_weight_level not in ("token", "sequence") or behav_weight_clip not in ("mask", "truncate"):
        raise ValueError(
            f"behav_weight_level must be token|sequence and behav_weight_clip mask|truncate, got "
            f"{behav_weight_level!r}, {behav_weight_clip!r}"
        )
    log_ratio = (logp - prox_logp).clamp(-20.0, 20.0)
    per_token, stats = _clipped_surrogate(log_ratio, advantages, loss_mask, eps_clip, eps_clip_higher, c_clip)
    log_w = (prox_logp - old_logp).clamp(-20.0, 20.0)
    if behav_weight_level == "sequence":
        log_w = seq_to_tokens(seq_means(log_w, loss_mask, cu_seqlens), cu_seqlens, log_w.shape[0])
    behav_weight = log_w.exp()
    keep = loss_mask.bool()
    capped = torch.zeros_like(keep)
    if behav_imp_weight_cap is not None:
        capped = behav_weight > behav_imp_weight_cap
        if behav_weight_clip == "mask":
            keep = keep & ~capped
        else:
            behav_weight = behav_weight.clamp(max=behav_imp_weight_cap)
    if behav_imp_weight_floor is not None:
        floored = behav_weight < behav_imp_weight_floor
        capped, keep = capped | floored, keep & ~floored
    behav_weight = torch.where(keep, behav_weight, 0.0)
    loss = agg_loss(per_token * behav_weight, loss_mask, cu_seqlens, loss_agg_mode, loss_norm_len)
    stats["behav_capped_frac"] = masked_mean((loss_mask.bool() & capped).float(), loss_mask)
    stats["behav_weight_mean"] = masked_mean(behav_weight, keep)
    return loss, stats


@register_loss("gspo", reads=("eps_clip", "eps_clip_higher") + _AGG)
def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    eps_clip: float = 3e-4,
    eps_clip_higher: float | None = 4e-4,
    loss_agg_mode: str = "seq-mean-token-mean",
    loss_norm_len: float = 0.0,
    **_: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: one ratio per sequence, the geometric mean of its token ratios, clipped.

    ``s_i = exp(mean_t (logp - old_logp))``; token ``t`` uses ``sg[s_i] * pi_t / sg[pi_t]``
    (same value, gradient of the sequence-level objective, token-level advantages allowed).
    """
    seq_log_ratio = seq_to_tokens(seq_means(logp - old_logp, loss_mask, cu_seqlens), cu_seqlens, logp.shape[0])
    log_ratio = (seq_log_ratio.detach() + logp - logp.detach()).clamp(-20.0, 20.0)
    per_token, stats = _clipped_surrogate(log_ratio, advantages, loss_mask, eps_clip, eps_clip_higher, None)
    return agg_loss(per_token, loss_mask, cu_seqlens, loss_agg_mode, loss_norm_len), stats


@register_loss("reinforce", reads=_AGG)
def reinforce_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    loss_agg_mode: str = "token-mean",
    loss_norm_len: float = 0.0,
    **_: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE: ``-logp * advantage`` (recipes/remax_reinforce.py's loss, with rewards as the advantage)."""
    log_ratio = logp.detach() - old_logp
    return agg_loss(-logp * advantages, loss_mask, cu_seqlens, loss_agg_mode, loss_norm_len), _ratio_stats(
        log_ratio.exp(), log_ratio, loss_mask
    )


@register_loss("distill", needs_teacher=True, reads=_AGG)
def distill_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    distill_kl: Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    loss_norm_len: float = 0.0,
    **_: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """On-policy distillation alone: the per-token reverse KL to the teacher (``distill_kl``, computed
    by the actor with ``relayrl.train.distill.token_reverse_kl``), aggregated; the rewards and advantages are not used."""
    if distill_kl is None:
        raise ValueError("distill needs distill_kl (the actor computes it from the teacher's batch keys)")
    return agg_loss(distill_kl, loss_mask, cu_seqlens, loss_agg_mode, loss_norm_len), {}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    value_clip: float = 0.2,
    agg_mode: str = "token-mean",
    norm_len: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: ``0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2)``."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss1 = (values - returns).square()
    loss2 = (clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(loss1, loss2), loss_mask, cu_seqlens, agg_mode, norm_len)
    return loss, {
        "vf_clip_frac": masked_mean((loss2 > loss1).float(), loss_mask),
        "value_mean": masked_mean(values.detach(), loss_mask),
    }


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    loss_mask: Tensor,
    cu_seqlens: Tensor,
    kind: str = "k3",
    agg_mode: str = "token-mean",
    norm_len: float = 0.0,
) -> Tensor:
    """KL(pi || ref) as a loss term (GRPO's ``beta * KL``), aggregated like the policy loss."""
    return agg_loss(kl_penalty(logp, ref_logp, kind), loss_mask, cu_seqlens, agg_mode, norm_len)


def entropy_bonus(
    entropy: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, agg_mode: str = "token-mean", norm_len: float = 0.0
) -> Tensor:
    """Mean policy entropy on the loss tokens; the actor subtracts ``entropy_coef`` times it."""
    return agg_loss(entropy, loss_mask, cu_seqlens, agg_mode, norm_len)
