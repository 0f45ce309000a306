"""The generator–trainer gap: dropout off in RL, the ``mismatch/`` metrics against reference
computations, and the rollout corrections (TIS / MIS) against the peers' formulas."""

from __future__ import annotations

import asyncio
import copy
import json
import math

import pytest
import torch

from relayrl.api.config import ActorConfig, InferenceConfig, ModelConfig, OptimizerConfig, TrainEngineConfig
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.api.workflow import concat_trajectories, trajectory_from_response
from relayrl.data.families import build_tiny_family
from relayrl.inference.local import LocalEngine
from relayrl.train.actor import PPOActor
from relayrl.train.engine import TorchTrainEngine

torch.set_num_threads(1)
MISMATCH_PANEL = "generator-trainer gap (mean |Δ logprob|)"  # relayrl.utils.plot.PANELS


def generate_batch(model, n: int = 6, max_new_tokens: int = 12, seed: int = 3, **gen: object) -> dict:
    """``n`` sampled completions of ``model`` by LocalEngine (fp32), as one trajectory batch with
    group ids and alternating rewards."""
    engine = LocalEngine(InferenceConfig(device="cpu", admit_window_ms=0, seed=seed), copy.deepcopy(model))
    engine.initialize()
    g = GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, **gen)

    async def go():
        reqs = [ModelRequest(rid=str(i), input_ids=[5 + i % 3, 9, 17, 33], gconfig=g) for i in range(n)]
        return await asyncio.gather(*[engine.agenerate(r) for r in reqs])

    try:
        resps = asyncio.run(go())
    finally:
        engine.destroy()
    batch = concat_trajectories([trajectory_from_response(r, float(i % 2)) for i, r in enumerate(resps)])
    batch["group_id"] = torch.arange(n) // 2
    return batch


def ppo_gap(model, batch: dict, dropout: bool, **actor: object) -> PPOActor:
    cfg = TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-4), mb_max_tokens=64, dropout=dropout)
    engine = TorchTrainEngine(cfg, ModelConfig(path="tiny"), model=copy.deepcopy(model), seed=0)
    engine.initialize()
    a = PPOActor(ActorConfig(adv_estimator="grpo", loss="ppo", **actor), engine)
    a.prepare(batch)
    a.ppo_update(batch)
    return a


def test_gpt2_dropout_off_trainer_logprobs_equal_the_generators():
    """GPT-2's config has dropout 0.1: with it on in the update forward (train.dropout=true, the old
    behaviour) the trainer's logprobs are far from the generator's; off (the RL default) they agree
    to 1e-5 in fp32, and mismatch/abs_diff_max says so."""
    model = build_tiny_family("gpt2", seed=1)
    assert model.config.resid_pdrop == 0.1
    batch = generate_batch(model)
    mask = batch["loss_mask"].bool()
    off = ppo_gap(model, dict(batch), dropout=False)
    gap = (off.trainer_logp - batch["logprobs"])[mask].abs()
    assert float(gap.max()) < 1e-5, float(gap.max())
    assert off.mismatch["abs_diff_max"] < 1e-5
    on = ppo_gap(model, dict(batch), dropout=True)
    assert on.mismatch["abs_diff_mean"] > 0.05, on.mismatch


@pytest.mark.parametrize("dropout", [False, True])
def test_critic_and_reference_run_without_dropout(tmp_path, dropout):
    """GPT-2 (dropout 0.1) with GAE (a critic) and a KL term (a reference model), as the trainer
    wires them: with train.dropout=false neither model has any dropout left and both score the same
    in train mode as in eval mode (the reference's logprobs are the generator's, to 1e-5); with
    train.dropout=true (the control) train mode is noisy, so the check can tell."""
    from relayrl.api.config import RunConfig, load_config
    from relayrl.data.models import build_tokenizer
    from relayrl.train.actor import prefix_values
    from relayrl.trainer import Trainer

    model = build_tiny_family("gpt2", seed=1)
    model.save_pretrained(tmp_path / "gpt2")
    build_tokenizer().save_pretrained(tmp_path / "gpt2")
    cfg = load_config(
        RunConfig,
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'gpt2'}",
            "actor.adv_estimator=gae",
            "actor.kl_coef=0.1",
            f"train.dropout={str(dropout).lower()}",
            "logging.tensorboard=false",
            "logging.progress=off",
        ],
    )
    trainer = Trainer(cfg)
    try:
        assert trainer.critic is not None and trainer.actor.ref_engine is not None
        batch = generate_batch(model)
        mask = batch["loss_mask"].bool()
        ref, critic = trainer.actor.ref_engine, trainer.critic.engine
        assert float(critic.forward(batch, post_fn=prefix_values).abs().max()) == 0.0  # a new head starts at 0
        with torch.no_grad():  # give the head weights, so dropout noise would show in the values
            critic.model.classifier.weight.normal_(generator=torch.Generator().manual_seed(0))
        scores = {}
        for mode in ("train", "eval", "train again"):
            for e in (ref, critic):
                e.train(mode != "eval")
            scores[mode] = (ref.forward(batch), critic.forward(batch, post_fn=prefix_values))
        for i, name in enumerate(("reference", "critic")):
            m = ref.model if i == 0 else critic.model
            drops = [x.p for x in m.modules() if isinstance(x, torch.nn.Dropout)]
            train_gap = float((scores["train"][i] - scores["eval"][i])[mask].abs().max())
            if dropout:
                assert any(p > 0 for p in drops) and train_gap > 1e-3, (name, train_gap)
            else:
                assert drops and all(p == 0 for p in drops), name
                assert m.config.resid_pdrop == m.config.attn_pdrop == m.config.embd_pdrop == 0.0, name
                assert train_gap < 1e-6, (name, train_gap)
                assert torch.equal(scores["train"][i], scores["train again"][i]), name
        if not dropout:
            assert float((scores["train"][0] - batch["logprobs"])[mask].abs().max()) < 1e-5
    finally:
        trainer.close()


@pytest.mark.parametrize("recompute", [False, True])
def test_the_gap_is_measured_at_the_weights_before_any_optimizer_step(recompute):
    """With several minibatches, later minibatches run their forward after an optimizer step: the
    gap must still come from the weights the generator had (1e-5 in fp32), whether the old
    logprobs are the generator's (recompute_logp=false) or the trainer's."""
    model = build_tiny_family("gpt2", seed=1)
    batch = generate_batch(model)
    a = ppo_gap(model, dict(batch), dropout=False, n_minibatches=3, recompute_logp=recompute)
    gap = (a.trainer_logp - batch["logprobs"])[batch["loss_mask"].bool()].abs()
    assert float(gap.max()) < 1e-5, float(gap.max())
    assert a.mismatch["abs_diff_max"] < 1e-5


# ---------------------------------------------------------------- mismatch/ metrics vs a reference


def reference_metrics(gen, train, mask, versions, version, truncated) -> dict[str, float]:
    """The metrics recomputed token by token in plain Python (float64)."""
    toks = []  # (d, position in completion, lag, truncated)
    for b in range(gen.shape[0]):
        k = 0
        for t in range(gen.shape[1]):
            if mask[b, t]:
                d = float(train[b, t]) - float(gen[b, t])
                toks.append((d, k, version - int(versions[b, t]), bool(truncated[b])))
                k += 1

    def stats(sel):
        ds = [x[0] for x in sel]
        return {
            "abs_diff_mean": sum(abs(d) for d in ds) / len(ds),
            "abs_diff_max": max(abs(d) for d in ds),
            "k3": sum(math.exp(d) - 1 - d for d in ds) / len(ds),
            "tokens": float(len(ds)),
        }

    out = stats(toks)
    for lo, hi in ((0, 16), (16, 64)):
        sel = [x for x in toks if lo <= x[1] < hi]
        if sel:
            out.update({f"pos_{lo}_{hi}/{k}": v for k, v in stats(sel).items()})
    for name, flag in (("length", True), ("stop", False)):
        sel = [x for x in toks if x[3] == flag]
        if sel:
            out.update({f"{name}/{k}": v for k, v in stats(sel).items()})
    for lag in sorted({x[2] for x in toks}):
        out.update({f"lag_{lag}/{k}": v for k, v in stats([x for x in toks if x[2] == lag]).items()})
    w = [math.exp(x[0]) for x in toks]
    out["ess"] = sum(w) ** 2 / (len(w) * sum(v * v for v in w))
    seq = []
    for b in range(gen.shape[0]):
        s = sum(float(train[b, t]) - float(gen[b, t]) for t in range(gen.shape[1]) if mask[b, t])
        if bool(mask[b].any()):
            seq.append(math.exp(s))
    out["ess_seq"] = sum(seq) ** 2 / (len(seq) * sum(v * v for v in seq))
    return out


def test_mismatch_metrics_match_a_reference_computation():
    from relayrl.train.mismatch import mismatch_metrics

    g = torch.Generator().manual_seed(0)
    B, L = 5, 40
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b, (s, n) in enumerate([(3, 30), (2, 10), (4, 36), (5, 1), (3, 20)]):
        mask[b, s : s + n] = True
    gen = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3
    train = gen + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.1
    versions = torch.randint(3, 6, (B, L), generator=g)
    truncated = torch.tensor([True, False, False, True, False])
    got = mismatch_metrics(gen, train, mask, versions, 5, truncated, expert_flips=(3.0, 12.0))
    want = reference_metrics(gen, train, mask, versions, 5, truncated)
    assert got.pop("expert_flip_frac") == 0.25
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


# ---------------------------------------------------------------- rollout corrections vs the peers' formulas


def packed_case(seed: int = 0):
    """A packed micro-batch with generator logprobs, trainer logprobs before the update (``old_logp``) a
    few tenths away, and the current policy's logits (requires grad)."""
    from relayrl.train.packing import pack

    g = torch.Generator().manual_seed(seed)
    B, L, V = 4, 14, 11
    ids = torch.randint(1, V, (B, L), generator=g)
    attn = torch.zeros(B, L, dtype=torch.bool)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b, (n, p) in enumerate([(14, 4), (9, 3), (12, 5), (7, 2)]):
        attn[b, :n], mask[b, p:n] = True, True
    gen = -torch.rand(B, L, generator=g) * 2 * mask
    old = gen + torch.randn(B, L, generator=g) * 0.4 * mask
    adv = torch.randn(B, 1, generator=g).expand(B, L) * mask
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": mask, "logprobs": gen, "old_logp": old}
    batch["advantages"], batch["rewards"] = adv.contiguous(), torch.zeros(B)
    packed = pack(batch)
    logits = torch.randn(int(attn.sum()), V, generator=g, dtype=torch.float32).requires_grad_()
    return batch, packed, logits


def padded_logp(logits, packed, batch):
    from relayrl.train.packing import token_logprobs, unpack

    B, L = batch["input_ids"].shape
    return unpack(token_logprobs(logits, packed), packed, B, L)


def reference_log_ratio(old, gen, mask, level):
    """``[B, L]`` log of the raw (unbounded) weight trainer / generator at ``level``."""
    diff = (old - gen) * mask
    if level == "token":
        return diff
    if level == "sequence":
        return diff.sum(-1, keepdim=True).expand_as(diff)
    return (diff.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).expand_as(diff)  # verl "geometric"


def reference_weights(old, gen, mask, peer, mode, level, low, high):
    """verl (compute_rollout_correction_weights / compute_rollout_rejection_mask) or TRL (vLLM
    importance sampling) weights on the padded batch, as their code states the formulas:
    ``(weights [B, L], normaliser mask [B, L])``."""
    log_w = reference_log_ratio(old, gen, mask, level)
    if peer == "verl":
        w = torch.exp(log_w.clamp(-20, 20))
        if mode == "truncate":  # TIS: w.clamp(max=threshold), response mask unchanged
            return w.clamp(max=high) * mask, mask.float()
        lo = 1.0 / high if low is None else low  # rejection sampling: response_mask * (lo <= w <= hi)
        keep = ((w >= lo) & (w <= high)).float()
        return w * keep * mask, mask * keep
    w = torch.exp(log_w)  # TRL
    if mode == "truncate":
        return torch.clamp(w, min=low, max=high) * mask, mask.float()
    bad = (w < (low if low is not None else -math.inf)) | (w > high)
    return w.masked_fill(bad, 0.0) * mask, mask.float()


def reference_loss(loss, logp, batch, w, norm_mask, eps=0.2):
    """The peer's per-token loss times the weight, token-mean over ``norm_mask`` (TRL dapo, verl token-mean)."""
    adv, old, m = batch["advantages"], batch["old_logp"], batch["loss_mask"].float()
    if loss in ("ppo", "decoupled_ppo"):  # decoupled: clipped against the proximal policy (= old_logp here)
        r = torch.exp(logp - old)
        per = torch.maximum(-adv * r, -adv * r.clamp(1 - eps, 1 + eps))
    elif loss == "reinforce":
        per = -logp * adv
    else:  # gspo: sequence ratio exp(mean log r) over the tokens left in the loss (verl's rejection
        # sampling edits the response mask the loss sees); the token's gradient; the actor's eps_clip, 0.2
        k = norm_mask * m
        s = ((logp - old) * k).sum(-1, keepdim=True) / k.sum(-1, keepdim=True).clamp(min=1.0)
        r = torch.exp(s.detach() + logp - logp.detach())
        per = torch.maximum(-adv * r, -adv * r.clamp(1 - eps, 1 + eps))
    return (per * w * m).sum() / (norm_mask * m).sum()


VARIANTS = [
    # (peer, mode, level, low, high, masked_in_norm)
    ("verl", "truncate", "token", None, 1.2, False),
    ("verl", "truncate", "sequence", None, 1.5, False),
    ("verl", "mask", "token", None, 1.3, False),
    ("verl", "mask", "sequence", None, 2.4, False),
    ("verl", "mask", "geometric", 0.9, 1.1, False),
    ("trl", "truncate", "token", 0.8, 1.2, True),
    ("trl", "truncate", "sequence", 0.5, 2.2, True),
    ("trl", "mask", "token", 0.7, 1.3, True),
    ("trl", "mask", "sequence", 0.1, 2.4, True),
]


@pytest.mark.parametrize("loss", ["ppo", "gspo", "reinforce", "decoupled_ppo"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(str(x) for x in v[:4]))
def test_rollout_correction_matches_the_peers_formulas(loss, variant):
    """actor.rollout_correction through the actor's real loss path (ppo, gspo, reinforce,
    decoupled_ppo) equals the peer's weights times the loss's per-token terms, values and gradients,
    to 1e-6. decoupled_ppo is verl's decoupled mode: the clip around the proximal policy (the
    trainer's logprobs before the update), the correction's weight in place of its own behaviour weight."""
    from relayrl.api.mismatch import RolloutCorrectionConfig
    from relayrl.train.actor import _StatsSink
    from relayrl.train.packing import pack

    peer, mode, level, low, high, in_norm = variant
    batch, packed, logits = packed_case()
    if loss == "decoupled_ppo":  # the trainer's logprobs before the update are the proximal policy
        batch["prox_logp"] = batch["old_logp"]
        packed = pack(batch)
    corr = RolloutCorrectionConfig(mode=mode, level=level, low=low, high=high, masked_in_norm=in_norm)
    actor = PPOActor(ActorConfig(loss=loss, rollout_correction=corr), engine=None)  # type: ignore[arg-type]
    got = actor._loss_fn(_StatsSink())(logits, packed)
    (g_got,) = torch.autograd.grad(got, logits)
    mask = batch["loss_mask"].float()
    w, norm = reference_weights(batch["old_logp"], batch["logprobs"], mask, peer, mode, level, low, high)
    # the bounds bite on some tokens and not on others, so the case tells bounded from unbounded weights
    raw = reference_log_ratio(batch["old_logp"], batch["logprobs"], mask, level).exp()[mask.bool()]
    lo = (1.0 / high if peer == "verl" and mode == "mask" else 0.0) if low is None else low
    bites = ((raw < lo) | (raw > high)).float().mean()
    assert 0 < float(bites) < 1, float(bites)
    bound = w[mask.bool()]
    if mode == "mask":  # outside the bounds: weight 0; inside: the raw weight
        assert torch.equal(bound == 0, (raw < lo) | (raw > high))
    else:  # truncated to the bounds: never outside them, and equal to the raw weight inside
        assert float(bound.max()) <= high + 1e-6 and float(bound.min()) >= lo - 1e-6
    inside = (raw >= lo) & (raw <= high)
    torch.testing.assert_close(bound[inside], raw[inside], rtol=1e-6, atol=0)
    want = reference_loss(loss, padded_logp(logits, packed, batch), batch, w, norm)
    (g_want,) = torch.autograd.grad(want, logits)
    assert float(got.detach()) == pytest.approx(float(want.detach()), abs=1e-6)
    assert torch.allclose(g_got, g_want, atol=1e-6)
    off = PPOActor(ActorConfig(loss=loss), engine=None)._loss_fn(_StatsSink())(logits, packed)  # type: ignore[arg-type]
    assert abs(float(off.detach()) - float(got.detach())) > 1e-4  # the correction changed the loss


def test_rollout_correction_config_is_range_checked():
    from relayrl.api.config import ConfigError, RunConfig, load_config

    with pytest.raises(ConfigError, match=r"actor.rollout_correction.high=0.5 is out of range"):
        load_config(RunConfig, None, ["actor.rollout_correction.high=0.5"])
    with pytest.raises(ConfigError, match=r"actor.rollout_correction.mode='tis' is not allowed"):
        load_config(RunConfig, None, ["actor.rollout_correction.mode=tis"])
    cfg = load_config(RunConfig, None, ["actor.rollout_correction.mode=mask", "actor.rollout_correction.low=0.5"])
    assert cfg.actor.rollout_correction.low == 0.5


def test_fp16_trains_with_loss_scaling_and_generates_in_fp16(tmp_path):
    """model.dtype=float16: the generator runs fp16 weights, the trainer fp32 master weights under fp16
    autocast with a dynamic loss scale; its gap to the generator is logged, drawn in curves.png's gap
    panel, and far below bf16's."""
    from relayrl.api.config import RunConfig, load_config
    from relayrl.trainer import Trainer
    from relayrl.utils.plot import figure

    gaps = {}
    for dtype in ("float16", "bfloat16"):
        cfg = load_config(
            RunConfig,
            None,
            [
                f"run_dir={tmp_path / dtype}",
                "total_steps=2",
                "rollout.batch_size=2",
                "rollout.group_size=2",
                "gconfig.max_new_tokens=8",
                "data.n_train=32",
                "train.optimizer.lr=1e-3",
                "actor.entropy_coef=0.01",
                "logging.tensorboard=false",
                "logging.progress=off",
                "logging.doctor_every=0",
                "eval.before_training=false",
                f"model.dtype={dtype}",
            ],
        )
        trainer = Trainer(cfg)
        before = {k: v.clone() for k, v in trainer.actor_engine.model.state_dict().items()}
        last = trainer.fit()
        gaps[dtype] = last["mismatch/abs_diff_mean"]
        # curves.png's gap panel draws mismatch/abs_diff_mean, step by step
        rows = [json.loads(x) for x in (tmp_path / dtype / "metrics.jsonl").read_text().splitlines()]
        ax = next(a for a in figure([tmp_path / dtype]).axes if a.get_title() == MISMATCH_PANEL)
        (line,) = ax.get_lines()
        assert list(line.get_xdata()) == [1, 2] == [r["step"] for r in rows]
        assert list(line.get_ydata()) == [r["mismatch/abs_diff_mean"] for r in rows]
        assert all(y > 0 for y in line.get_ydata()) and rows[-1]["mismatch/abs_diff_max"] > line.get_ydata()[-1]
        params = dict(trainer.actor_engine.model.named_parameters())
        if dtype == "float16":
            assert all(p.dtype == torch.float32 for p in params.values())  # master weights
            assert trainer.actor_engine.scaler is not None and last["actor/loss_scale"] > 0
            assert next(trainer.engine.model.parameters()).dtype == torch.float16  # the generator
            assert last["actor/skipped_steps"] == 0
            moved = [k for k, p in params.items() if not torch.equal(p.detach(), before[k].float())]
            assert moved  # it trained
        trainer.close()
    assert 0 < gaps["float16"] < gaps["bfloat16"] / 2, gaps


def test_moe_expert_flips_counted_against_the_recorded_routing():
    """Mixtral: the generator's recorded experts against the trainer's own top-k. As recorded (fp32,
    same weights) nothing flips; with every recorded choice moved and replay off, every one does."""
    model = build_tiny_family("mixtral", seed=1)
    batch = generate_batch(model)
    assert "routed_experts" in batch
    same = ppo_gap(model, dict(batch), dropout=False, replay_routing=False)
    assert same.mismatch["expert_flip_frac"] == 0.0
    moved = dict(batch)
    moved["routed_experts"] = torch.where(batch["routed_experts"] >= 0, (batch["routed_experts"] + 1) % 4, -1)
    flipped = ppo_gap(model, moved, dropout=False, replay_routing=False)
    assert flipped.mismatch["expert_flip_frac"] == 1.0
    assert flipped.mismatch["abs_diff_max"] < 1e-5  # not replayed: the trainer's logprobs are its own routing's
