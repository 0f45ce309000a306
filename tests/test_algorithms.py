"""Advantages, reward shaping and losses against plain-loop references, plus TRL's GRPO loss numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from relayrl.train import algorithms as A

torch.set_num_threads(1)
FIXTURE = Path(__file__).parent / "fixtures" / "trl_grpo_loss.json"


# ----------------------------------------------------------------------------- helpers


def rand_batch(seed: int, B: int = 6, L: int = 9, n_groups: int = 2):
    """Padded batch with prompt tokens (mask 0), completions of random length, right padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for i in range(B):
        p = int(torch.randint(1, 3, (1,), generator=g))
        n = int(torch.randint(1, L - p + 1, (1,), generator=g))
        mask[i, p : p + n] = True
    rewards = torch.randn(B, generator=g, dtype=torch.float64)
    group_id = torch.arange(B) % n_groups
    return rewards, mask, group_id, g


def pack_rows(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    flat = torch.tensor([x for r in rows for x in r], dtype=torch.float64)
    cu = torch.tensor([0] + [sum(len(r) for r in rows[: i + 1]) for i in range(len(rows))], dtype=torch.int32)
    return flat, cu


def random_packed(seed: int, n_seqs: int = 5, spread: float = 0.5):
    """Packed logp/old_logp/advantages/mask with a prompt token at each sequence start."""
    g = torch.Generator().manual_seed(seed)
    lens = [int(torch.randint(2, 8, (1,), generator=g)) for _ in range(n_seqs)]
    masks = [[0.0] + [float(torch.rand(1, generator=g) < 0.85) for _ in range(n - 1)] for n in lens]
    mask, cu = pack_rows(masks)
    T = len(mask)
    old = -torch.rand(T, generator=g, dtype=torch.float64) * 2 - 0.01
    logp = old + spread * torch.randn(T, generator=g, dtype=torch.float64)
    adv = torch.randn(T, generator=g, dtype=torch.float64)
    return logp, old, adv, mask.bool(), cu


def seqs(cu: torch.Tensor):
    return [(int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]


def ref_agg(values: list[float], mask: list[bool], cu, mode: str, norm_len: float = 0.0) -> float:
    if mode == "token-mean":
        tot, n = 0.0, 0
        for v, m in zip(values, mask, strict=True):
            if m:
                tot, n = tot + v, n + 1
        return tot / max(n, 1)
    per_seq = []
    for s, e in seqs(cu):
        tot, n = 0.0, 0
        for t in range(s, e):
            if mask[t]:
                tot, n = tot + values[t], n + 1
        per_seq.append(tot / max(n, 1) if mode == "seq-mean-token-mean" else tot)
    if mode == "seq-mean-token-sum-norm":
        return sum(per_seq) / (len(per_seq) * norm_len)
    return sum(per_seq) / len(per_seq)


def ref_ppo_token(ratio: float, a: float, lo: float, hi: float, c_clip: float | None) -> float:
    clipped = min(max(ratio, 1 - lo), 1 + hi)
    loss = max(-a * ratio, -a * clipped)
    if c_clip is not None and a < 0:
        loss = min(loss, -a * c_clip)
    return loss


# ----------------------------------------------------------------------------- registry


def test_registry_lookup_and_errors():
    assert set(A.ADVANTAGES) >= {"grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "remax", "gae"}
    assert set(A.LOSSES) >= {"ppo", "decoupled_ppo", "gspo", "reinforce"}
    assert A.get_advantage("grpo") is A.grpo_advantage
    with pytest.raises(ValueError, match="actor.adv_estimator='nope' is not registered"):
        A.get_advantage("nope")
    with pytest.raises(ValueError, match="actor.loss='ppx' is not registered; did you mean 'ppo'"):
        A.get_loss("ppx")
    with pytest.raises(ValueError, match=r"'ppo' is already registered \(by relayrl.train.algorithms.ppo_loss\)"):
        A.register_loss("ppo")(A.gspo_loss)
    assert A.register_loss("ppo")(A.ppo_loss) is A.ppo_loss  # the same function again: a re-import
    assert A.get_loss("ppo") is A.ppo_loss

    @A.register_advantage("_test_const")
    def const(rewards, loss_mask, **_):
        return loss_mask.double(), loss_mask.double()

    assert A.get_advantage("_test_const") is const
    del A.ADVANTAGES["_test_const"]


# ----------------------------------------------------------------------------- advantages


def ref_group_adv(rewards, group_id, mode: str, eps: float = 1e-6):
    out = []
    for i in range(len(rewards)):
        grp = [float(rewards[j]) for j in range(len(rewards)) if group_id[j] == group_id[i]]
        n = len(grp)
        if n == 1:
            out.append(0.0)
            continue
        mean = sum(grp) / n
        if mode == "rloo":
            others = [float(rewards[j]) for j in range(len(rewards)) if group_id[j] == group_id[i] and j != i]
            out.append(float(rewards[i]) - sum(others) / len(others))
            continue
        a = float(rewards[i]) - mean
        if mode == "grpo":
            std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (n - 1))
            a = a / (std + eps)
        out.append(a)
    return out


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_advantages_match_loops(name, seed):
    rewards, mask, group_id, _ = rand_batch(seed, B=9, n_groups=3)
    group_id = group_id * 7 + 100  # arbitrary, non-contiguous ids
    adv, ret = A.get_advantage(name)(rewards=rewards, loss_mask=mask, group_id=group_id)
    ref = ref_group_adv(rewards, group_id, name)
    for i in range(len(rewards)):
        for t in range(mask.shape[1]):
            assert adv[i, t].item() == pytest.approx(ref[i] if mask[i, t] else 0.0, abs=1e-9)
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_edge_cases(name):
    mask = torch.ones(5, 3, dtype=torch.bool)
    mask[:, 0] = False
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.3, 2.0])  # group 0 all equal; group 1 = a single row
    group_id = torch.tensor([0, 0, 0, 1, 2])
    adv, _ = A.get_advantage(name)(rewards=rewards, loss_mask=mask, group_id=group_id)
    assert torch.equal(adv, torch.zeros_like(adv))  # equal rewards and groups of one carry no signal
    adv, _ = A.get_advantage(name)(
        rewards=rewards, loss_mask=torch.zeros_like(mask), group_id=torch.zeros(5, dtype=torch.long)
    )
    assert torch.equal(adv, torch.zeros_like(adv))  # empty loss mask


def test_grpo_without_std_equals_dr_grpo():
    rewards, mask, gid, _ = rand_batch(3)
    a1, _ = A.grpo_advantage(rewards, mask, gid, adv_norm=False)
    a2, _ = A.dr_grpo_advantage(rewards, mask, gid)
    assert torch.equal(a1, a2)


def ref_returns(token_rewards, mask, gamma):
    B, L = token_rewards.shape
    out = [[0.0] * L for _ in range(B)]
    for i in range(B):
        steps = [t for t in range(L) if mask[i, t]]
        g = 0.0
        for t in reversed(steps):
            g = float(token_rewards[i, t]) + gamma * g
            out[i][t] = g
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_and_reinforce_pp_match_loops(gamma):
    rewards, mask, gid, g = rand_batch(4, B=5, L=8)
    mask[0, 4] = False  # a gap inside a completion (e.g. a tool output) is skipped
    kl = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.1 * mask
    token_rewards = A.last_token_rewards(rewards, mask) - kl
    for i in range(5):  # last_token_rewards puts the reward on the last generated token
        last = max(t for t in range(8) if mask[i, t])
        assert A.last_token_rewards(rewards, mask)[i, last] == rewards[i]
        assert A.last_token_rewards(rewards, mask)[i].sum() == rewards[i]
    ret_ref = ref_returns(token_rewards, mask, gamma)

    adv, ret = A.reinforce_advantage(rewards, mask, token_rewards=token_rewards, gamma=gamma, baseline=True)
    base = sum(float(token_rewards[i].sum()) for i in range(5)) / 5
    for i in range(5):
        for t in range(8):
            assert ret[i, t].item() == pytest.approx(ret_ref[i][t], abs=1e-9)
            assert adv[i, t].item() == pytest.approx(ret_ref[i][t] - base if mask[i, t] else 0.0, abs=1e-9)

    adv, ret = A.reinforce_pp_advantage(rewards, mask, token_rewards=token_rewards, gamma=gamma, adv_norm=True)
    vals = [ret_ref[i][t] for i in range(5) for t in range(8) if mask[i, t]]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    for i in range(5):
        for t in range(8):
            exp = (ret_ref[i][t] - mean) / (std + 1e-8) if mask[i, t] else 0.0
            assert adv[i, t].item() == pytest.approx(exp, abs=1e-7)


def test_remax_advantage():
    rewards, mask, gid, _ = rand_batch(5)
    base = torch.linspace(-1, 1, len(rewards), dtype=torch.float64)
    adv, _ = A.remax_advantage(rewards, mask, baseline_rewards=base)
    for i in range(len(rewards)):
        for t in range(mask.shape[1]):
            assert adv[i, t].item() == pytest.approx(float(rewards[i] - base[i]) if mask[i, t] else 0.0)
    with pytest.raises(ValueError, match="baseline_rewards"):
        A.remax_advantage(rewards, mask)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.95, 0.9), (0.5, 0.0)])
def test_gae_matches_loop(gamma, lam):
    rewards, mask, gid, g = rand_batch(6, B=4, L=9)
    mask[1, :] = False
    mask[1, 2:4] = True
    mask[1, 6:8] = True  # two generated spans separated by non-generated tokens
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    token_rewards = (
        A.last_token_rewards(rewards, mask) + 0.05 * torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    )
    adv, ret = A.gae_advantage(
        rewards, mask, values=values, token_rewards=token_rewards, gamma=gamma, lam=lam, adv_norm=False
    )
    white, ret_w = A.gae_advantage(rewards, mask, values=values, token_rewards=token_rewards, gamma=gamma, lam=lam)
    for i in range(4):
        steps = [t for t in range(9) if mask[i, t]]
        a = 0.0
        exp = {}
        for k in reversed(range(len(steps))):
            t = steps[k]
            v_next = float(values[i, steps[k + 1]]) if k + 1 < len(steps) else 0.0
            delta = float(token_rewards[i, t]) + gamma * v_next - float(values[i, t])
            a = delta + gamma * lam * a
            exp[t] = a
        for t in range(9):
            assert adv[i, t].item() == pytest.approx(exp.get(t, 0.0), abs=1e-9)
            assert ret[i, t].item() == pytest.approx(exp[t] + float(values[i, t]) if t in exp else 0.0, abs=1e-9)
    # whitened (the default): numpy over the loss tokens, unbiased variance; returns stay raw
    raw = np.array([adv[i, t].item() for i in range(4) for t in range(9) if mask[i, t]])
    mean, var = raw.mean(), raw.var(ddof=1)
    for i in range(4):
        for t in range(9):
            exp_w = (adv[i, t].item() - mean) / math.sqrt(var + 1e-6) if mask[i, t] else 0.0
            assert white[i, t].item() == pytest.approx(exp_w, abs=1e-9)
    assert torch.equal(ret_w, ret)
    w = white[mask]
    assert float(w.mean()) == pytest.approx(0.0, abs=1e-9) and float(w.std()) == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="values"):
        A.gae_advantage(rewards, mask)


# ----------------------------------------------------------------------------- shaping and KL


def test_shape_rewards_and_overlong_penalty():
    r = torch.tensor([0.5, 2.0, -3.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([10, 10, 10, 12, 14, 20])
    out = A.shape_rewards(
        r, scale=2.0, bias=0.5, clip=2.5, response_lengths=lengths, max_len=16, overlong_buffer=4, overlong_penalty=1.0
    )
    exp = []
    for x, n in zip(r.tolist(), lengths.tolist(), strict=True):
        y = min(max(2.0 * x + 0.5, -2.5), 2.5)
        expected_len = 16 - 4
        if n > expected_len:
            y += max(-(n - expected_len) / 4 * 1.0, -1.0)
        exp.append(y)
    assert out.tolist() == pytest.approx(exp)
    assert out[4].item() == pytest.approx(2.5 - 0.5)  # halfway through the buffer: half the penalty
    with pytest.raises(ValueError, match="max_len"):
        A.shape_rewards(r, overlong_buffer=4)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators(kind):
    logp, ref, _, mask, cu = random_packed(7)
    kl = A.kl_penalty(logp, ref, kind)
    for t in range(len(logp)):
        lr = float(logp[t] - ref[t])
        exp = {"k1": lr, "k2": 0.5 * lr * lr, "k3": math.exp(-lr) + lr - 1}[kind]
        assert kl[t].item() == pytest.approx(exp, abs=1e-9)
    loss = A.kl_loss(logp, ref, mask, cu, kind, "seq-mean-token-mean")
    assert loss.item() == pytest.approx(ref_agg(kl.tolist(), mask.tolist(), cu, "seq-mean-token-mean"))


# ----------------------------------------------------------------------------- aggregation and losses


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_loss_modes(mode):
    logp, _, _, mask, cu = random_packed(8)
    mask[int(cu[1]) : int(cu[2])] = False  # one sequence with an empty loss mask still counts as a sequence
    got = A.agg_loss(logp, mask, cu, mode, norm_len=7)
    assert got.item() == pytest.approx(ref_agg(logp.tolist(), mask.tolist(), cu, mode, 7))
    assert A.agg_loss(logp, torch.zeros_like(mask), cu, mode, norm_len=7).item() == 0.0
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        A.agg_loss(logp, mask, cu, "mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("spread", [0.05, 3.0])  # 3.0: ratios far outside the clip range
@pytest.mark.parametrize("c_clip", [None, 3.0])
def test_ppo_loss_matches_loop(mode, spread, c_clip):
    logp, old, adv, mask, cu = random_packed(9, n_seqs=6, spread=spread)
    logp.requires_grad_(True)
    lo, hi = 0.2, 0.28
    loss, stats = A.ppo_loss(
        logp, old, adv, mask, cu, eps_clip=lo, eps_clip_higher=hi, c_clip=c_clip, loss_agg_mode=mode
    )
    per_tok, clipped, ratios = [], 0, []
    for t in range(len(logp)):
        r = math.exp(float(logp[t].detach() - old[t]))
        per_tok.append(ref_ppo_token(r, float(adv[t]), lo, hi, c_clip))
        if mask[t]:
            a = float(adv[t])
            clipped += int(-a * min(max(r, 1 - lo), 1 + hi) > -a * r)
            ratios.append(r)
    assert loss.item() == pytest.approx(ref_agg(per_tok, mask.tolist(), cu, mode), rel=1e-9)
    assert stats["clip_frac"].item() == pytest.approx(clipped / len(ratios))
    assert stats["ratio_max"].item() == pytest.approx(max(ratios))
    assert stats["ratio_mean"].item() == pytest.approx(sum(ratios) / len(ratios))
    if spread > 1:
        assert stats["clip_frac"].item() > 0.3
    # finite-difference gradient check of one token that is not at a kink
    loss.backward()
    t = int(mask.nonzero()[0])
    h = 1e-6
    lp2 = logp.detach().clone()
    lp2[t] += h
    up = A.ppo_loss(lp2, old, adv, mask, cu, eps_clip=lo, eps_clip_higher=hi, c_clip=c_clip, loss_agg_mode=mode)[
        0
    ].item()
    assert logp.grad[t].item() == pytest.approx((up - loss.item()) / h, abs=1e-4)


def test_dual_clip_branch_bounds_negative_advantages():
    old = torch.zeros(4, dtype=torch.float64) - 1.0
    logp = old + torch.tensor([0.0, 3.0, 3.0, 0.1], dtype=torch.float64)  # ratio e^3 ~ 20 >> c_clip
    adv = torch.tensor([0.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([False, True, True, True])
    cu = torch.tensor([0, 4], dtype=torch.int32)
    loss, stats = A.ppo_loss(logp, old, adv, mask, cu, eps_clip=0.2, c_clip=3.0)
    # token1: A<0, -A*ratio = 20.1 capped at 3; token2: A>0 clipped at 1.2 -> -1.2; token3: ratio 1.105 -> 1.105
    assert loss.item() == pytest.approx((3.0 - 1.2 + math.exp(0.1)) / 3)
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 3)
    no_dual, _ = A.ppo_loss(logp, old, adv, mask, cu, eps_clip=0.2)
    assert no_dual.item() == pytest.approx((math.exp(3.0) - 1.2 + math.exp(0.1)) / 3)
    with pytest.raises(ValueError, match="c_clip"):
        A.ppo_loss(logp, old, adv, mask, cu, c_clip=0.5)


@pytest.mark.parametrize("cap", [None, 1.5])
def test_decoupled_ppo_matches_loop(cap):
    prox, behav, adv, mask, cu = random_packed(10, n_seqs=6, spread=0.6)
    g = torch.Generator().manual_seed(11)
    logp = (prox + 0.3 * torch.randn(len(prox), generator=g, dtype=torch.float64)).requires_grad_(True)
    loss, stats = A.decoupled_ppo_loss(
        logp, behav, adv, mask, cu, prox_logp=prox, eps_clip=0.2, behav_imp_weight_cap=cap
    )
    tot, n, capped = 0.0, 0, 0
    for t in range(len(logp)):
        if not mask[t]:
            continue
        n += 1
        w = math.exp(float(prox[t] - behav[t]))
        if cap is not None and w > cap:
            capped += 1
            continue  # masked: contributes 0 but stays in the denominator
        r = math.exp(float(logp[t].detach() - prox[t]))
        tot += w * ref_ppo_token(r, float(adv[t]), 0.2, 0.2, None)
    assert loss.item() == pytest.approx(tot / n, rel=1e-9)
    assert stats["behav_capped_frac"].item() == pytest.approx(capped / n)
    if cap is not None:
        assert capped > 0
        loss.backward()
        for t in range(len(logp)):
            if mask[t] and math.exp(float(prox[t] - behav[t])) > cap:
                assert logp.grad[t].item() == 0.0
    with pytest.raises(ValueError, match="prox_logp"):
        A.decoupled_ppo_loss(logp, behav, adv, mask, cu)


@pytest.mark.parametrize("floor", [None, 0.8])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("clip", ["mask", "truncate"])
def test_decoupled_ppo_behaviour_weight_modes_match_loop(level, clip, floor):
    """Token or sequence-level (geometric mean) behaviour weights, masked or truncated at the cap,
    masked below the floor."""
    prox, behav, adv, mask, cu = random_packed(12, n_seqs=6, spread=0.6)
    g = torch.Generator().manual_seed(12)
    logp = prox + 0.3 * torch.randn(len(prox), generator=g, dtype=torch.float64)
    cap = 1.3 if level == "token" else 1.08
    if floor is not None and level == "sequence":
        floor = 0.95
    loss, stats = A.decoupled_ppo_loss(
        logp,
        behav,
        adv,
        mask,
        cu,
        prox_logp=prox,
        eps_clip=0.2,
        behav_imp_weight_cap=cap,
        behav_imp_weight_floor=floor,
        behav_weight_level=level,
        behav_weight_clip=clip,
    )
    bounds = cu.tolist()
    tot, n, capped = 0.0, 0, 0
    for i in range(len(bounds) - 1):
        toks = [t for t in range(bounds[i], bounds[i + 1]) if mask[t]]
        seq_w = math.exp(sum(float(prox[t] - behav[t]) for t in toks) / max(1, len(toks)))
        for t in toks:
            n += 1
            w = seq_w if level == "sequence" else math.exp(float(prox[t] - behav[t]))
            if floor is not None and w < floor:
                capped += 1
                continue
            if w > cap:
                capped += 1
                if clip == "mask":
                    continue
                w = cap
            r = math.exp(float(logp[t] - prox[t]))
            tot += w * ref_ppo_token(r, float(adv[t]), 0.2, 0.2, None)
    assert 0 < capped < n
    assert loss.item() == pytest.approx(tot / n, rel=1e-9)
    assert stats["behav_capped_frac"].item() == pytest.approx(capped / n)
    with pytest.raises(ValueError, match="behav_weight_level"):
        A.decoupled_ppo_loss(logp, behav, adv, mask, cu, prox_logp=prox, behav_weight_level="seq")


def test_decoupled_equals_ppo_when_on_policy():
    logp, old, adv, mask, cu = random_packed(12)
    a, _ = A.decoupled_ppo_loss(logp, old, adv, mask, cu, prox_logp=old, behav_imp_weight_cap=5.0)
    b, _ = A.ppo_loss(logp, old, adv, mask, cu)
    assert a.item() == pytest.approx(b.item(), rel=1e-12)


@pytest.mark.parametrize("spread", [1e-4, 0.5])
def test_gspo_matches_loop(spread):
    logp, old, adv, mask, cu = random_packed(13, n_seqs=5, spread=spread)
    logp.requires_grad_(True)
    lo, hi = 3e-4, 4e-4
    loss, stats = A.gspo_loss(logp, old, adv, mask, cu, eps_clip=lo, eps_clip_higher=hi)
    per_tok = [0.0] * len(logp)
    grads = [0.0] * len(logp)
    n_seqs = len(cu) - 1
    for s, e in seqs(cu):
        toks = [t for t in range(s, e) if mask[t]]
        if not toks:
            continue
        s_ratio = math.exp(sum(float(logp[t].detach() - old[t]) for t in toks) / len(toks))
        for t in toks:
            a = float(adv[t])
            per_tok[t] = ref_ppo_token(s_ratio, a, lo, hi, None)
            unclipped = -a * s_ratio >= -a * min(max(s_ratio, 1 - lo), 1 + hi)
            grads[t] = (-a * s_ratio if unclipped else 0.0) / len(toks) / n_seqs
    assert loss.item() == pytest.approx(ref_agg(per_tok, mask.tolist(), cu, "seq-mean-token-mean"), rel=1e-9)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx(grads, abs=1e-9)
    if spread > 0.1:
        assert stats["clip_frac"].item() > 0.5


def test_reinforce_loss_is_seed_loss():
    logp, old, adv, mask, cu = random_packed(14)
    loss, _ = A.reinforce_loss(logp, old, adv, mask, cu)
    ref = sum(-float(logp[t]) * float(adv[t]) for t in range(len(logp)) if mask[t]) / int(mask.sum())
    assert loss.item() == pytest.approx(ref)


def test_value_loss_matches_loop():
    values, old, returns, mask, cu = random_packed(15, spread=0.5)
    loss, stats = A.value_loss(values, old, returns, mask, cu, value_clip=0.2)
    per_tok, clipped = [], 0
    for t in range(len(values)):
        v, o, r = float(values[t]), float(old[t]), float(returns[t])
        vc = o + min(max(v - o, -0.2), 0.2)
        per_tok.append(max((v - r) ** 2, (vc - r) ** 2))
        clipped += int(mask[t] and (vc - r) ** 2 > (v - r) ** 2)
    assert loss.item() == pytest.approx(0.5 * ref_agg(per_tok, mask.tolist(), cu, "token-mean"))
    assert stats["vf_clip_frac"].item() == pytest.approx(clipped / int(mask.sum()))


def test_entropy_bonus_and_empty_mask():
    ent, _, adv, mask, cu = random_packed(16)
    ent = ent.abs()
    assert A.entropy_bonus(ent, mask, cu).item() == pytest.approx(
        ref_agg(ent.tolist(), mask.tolist(), cu, "token-mean")
    )
    empty = torch.zeros_like(mask)
    for name in ("ppo", "gspo", "reinforce"):
        loss, stats = A.get_loss(name)(logp=ent, old_logp=ent, advantages=adv, loss_mask=empty, cu_seqlens=cu)
        assert loss.item() == 0.0 and math.isfinite(stats["approx_kl"].item())


# ----------------------------------------------------------------------------- TRL GRPOTrainer numbers


def _trl_cases():
    return {c["name"]: c for c in json.loads(FIXTURE.read_text())["cases"]}


def _pack_trl(case):
    """Each TRL row becomes one packed sequence: one prompt token (mask 0) + its completion."""
    mask_rows = case["completion_mask"]
    out = {}
    for key in ("logp", "old_logp", "ref_logp", "entropy", "grad_logp"):
        out[key] = pack_rows(
            [[0.0] + [v for v, m in zip(case[key][i], mask_rows[i], strict=True) if m] for i in range(len(mask_rows))]
        )[0]
    adv_rows = [[0.0] + [case["advantages"][i]] * sum(mask_rows[i]) for i in range(len(mask_rows))]
    out["advantages"], cu = pack_rows(adv_rows)
    out["loss_mask"] = pack_rows([[0.0] + [1.0] * sum(m) for m in mask_rows])[0].bool()
    return out, cu


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_matches_trl_grpo_trainer_loss(name):
    case = _trl_cases()[name]
    p, cu = _pack_trl(case)
    rewards = torch.tensor(case["rewards"], dtype=torch.float64)
    gid = torch.arange(len(rewards)) // case["num_generations"]
    ones = torch.ones(len(rewards), 1, dtype=torch.bool)
    adv_fn = A.dr_grpo_advantage if case["scale_rewards"] == "none" else A.grpo_advantage
    adv, _ = adv_fn(rewards=rewards, loss_mask=ones, group_id=gid, adv_eps=1e-4)
    # rel 1e-7: TRL's nanstd computes its Bessel factor count / (count - 1) in float32
    assert adv[:, 0].tolist() == pytest.approx(case["advantages"], rel=1e-7, abs=1e-12)

    logp = p["logp"].clone().requires_grad_(True)
    kw = dict(eps_clip=case["epsilon"], eps_clip_higher=case["epsilon_high"])
    if name == "grpo":
        loss, _ = A.ppo_loss(
            logp, p["old_logp"], p["advantages"], p["loss_mask"], cu, loss_agg_mode="seq-mean-token-mean", **kw
        )
        loss = loss + case["beta"] * A.kl_loss(logp, p["ref_logp"], p["loss_mask"], cu, "k3", "seq-mean-token-mean")
    elif name == "dr_grpo":
        loss, _ = A.ppo_loss(
            logp,
            p["old_logp"],
            p["advantages"],
            p["loss_mask"],
            cu,
            loss_agg_mode="seq-mean-token-sum-norm",
            loss_norm_len=case["max_completion_length"],
            **kw,
        )
    elif name == "dapo":
        loss, stats = A.ppo_loss(
            logp, p["old_logp"], p["advantages"], p["loss_mask"], cu, loss_agg_mode="token-mean", **kw
        )
        loss = loss - case["entropy_coef"] * A.entropy_bonus(p["entropy"], p["loss_mask"], cu)
        # TRL's region clip ratio only counts clipping that zeroes the gradient; ours counts the same tokens
        assert stats["clip_frac"].item() == pytest.approx(case["clip_ratio_region"])
    else:
        loss, _ = A.gspo_loss(
            logp, p["old_logp"], p["advantages"], p["loss_mask"], cu, loss_agg_mode="seq-mean-token-mean", **kw
        )
    assert loss.item() == pytest.approx(case["loss"], rel=1e-9, abs=1e-12)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx(p["grad_logp"].tolist(), abs=1e-10)
