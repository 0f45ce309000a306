"""PPOActor / Critic / ReinforceActor on a real TorchTrainEngine with the tiny model."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from relayrl.api.config import ActorConfig, ModelConfig, OptimizerConfig, RunConfig, TrainEngineConfig, load_config
from relayrl.train import algorithms as A
from relayrl.train.actor import Critic, PPOActor, minibatches
from relayrl.train.engine import TorchTrainEngine

torch.set_num_threads(1)
RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "algorithms"


def make_engine(model, lr: float = 2e-4, head: str = "lm", trainable: bool = True) -> TorchTrainEngine:
    cfg = TrainEngineConfig(optimizer=OptimizerConfig(lr=lr, grad_clip=1.0), mb_max_tokens=64)
    eng = TorchTrainEngine(cfg, ModelConfig(path="tiny"), model=copy.deepcopy(model), head=head, trainable=trainable)
    eng.initialize()
    return eng


def make_batch(
    engine: TorchTrainEngine, tokenizer, B: int = 8, seed: int = 0, group_size: int = 4
) -> dict[str, torch.Tensor]:
    """Prompts + random completions; behaviour logprobs from the engine itself (on-policy)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [tokenizer.encode(f"<|user|>{i}+{i}=<|assistant|>") for i in range(B // group_size)]
    rows, masks = [], []
    for i in range(B):
        p = prompts[i // group_size]
        n = int(torch.randint(3, 9, (1,), generator=g))
        comp = torch.randint(10, 40, (n,), generator=g).tolist()
        rows.append(p + comp)
        masks.append([0] * len(p) + [1] * n)
    L = max(map(len, rows))
    ids = torch.zeros(B, L, dtype=torch.int64)
    attn = torch.zeros(B, L, dtype=torch.bool)
    loss = torch.zeros(B, L, dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = True
        loss[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}
    batch["logprobs"] = engine.forward(batch) * loss
    batch["versions"] = torch.where(loss, engine.get_version(), -1)
    batch["rewards"] = torch.randn(B, generator=g).round(decimals=1)
    batch["group_id"] = torch.arange(B) // group_size
    return batch


def seq_logp(engine, batch) -> torch.Tensor:
    return (engine.forward(batch) * batch["loss_mask"]).sum(1)


def test_compute_logp_matches_plain_forward(tiny_model, tokenizer):
    eng = make_engine(tiny_model)
    batch = make_batch(eng, tokenizer)
    actor = PPOActor(ActorConfig(temperature=0.7), eng)
    got = actor.compute_logp(batch)
    with torch.no_grad():
        logits = tiny_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits / 0.7
    lp = torch.log_softmax(logits.double(), -1)
    for i in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][i].sum())
        for t in range(1, n):
            assert got[i, t].item() == pytest.approx(lp[i, t - 1, batch["input_ids"][i, t]].item(), abs=2e-4)
        assert got[i, 0].item() == 0.0


def test_compute_advantages_shaping_and_masking(tiny_model, tokenizer):
    eng = make_engine(tiny_model)
    batch = make_batch(eng, tokenizer)
    batch["truncated"] = torch.tensor([False, True] + [False] * 6)
    lengths = batch["loss_mask"].sum(1)
    cfg = ActorConfig(
        reward_scale=2.0, reward_bias=0.5, reward_clip=1.5, overlong_buffer=4, overlong_max_len=8, mask_truncated=True
    )
    PPOActor(cfg, eng).compute_advantages(batch)
    assert not batch["loss_mask"][1].any() and batch["loss_mask"][0].any()
    shaped = []
    for r, n in zip(batch["rewards"].tolist(), lengths.tolist(), strict=True):
        x = min(max(2 * r + 0.5, -1.5), 1.5)
        shaped.append(x - max(0, n - 4) / 4)
    for i in range(8):
        grp = shaped[(i // 4) * 4 : (i // 4) * 4 + 4]
        mean = sum(grp) / 4
        std = (sum((x - mean) ** 2 for x in grp) / 3) ** 0.5
        exp = (shaped[i] - mean) / (std + 1e-6)
        for t in range(batch["input_ids"].shape[1]):
            want = exp if batch["loss_mask"][i, t] else 0.0
            assert batch["advantages"][i, t].item() == pytest.approx(want, abs=1e-5)
    del batch["truncated"]
    with pytest.raises(ValueError, match="truncated"):
        PPOActor(cfg, eng).compute_advantages(batch)
    with pytest.raises(ValueError, match="group_id"):
        PPOActor(ActorConfig(), eng).compute_advantages({k: v for k, v in batch.items() if k != "group_id"})
    with pytest.raises(ValueError, match="loss_norm_len"):
        PPOActor(ActorConfig(loss_agg_mode="seq-mean-token-sum-norm"), eng)


def _direction_check(before, after, adv_seq):
    moved = after - before
    assert float((moved * adv_seq).sum()) > 0
    # shared weights drag single sequences around, but moves and advantages are clearly correlated
    corr = torch.corrcoef(torch.stack([moved.double(), adv_seq.double()]))[0, 1]
    assert corr > 0.5, (moved.tolist(), adv_seq.tolist())


@pytest.mark.parametrize(
    "loss,agg", [("ppo", "token-mean"), ("gspo", "seq-mean-token-mean"), ("reinforce", "seq-mean-token-sum")]
)
def test_ppo_update_moves_logp_in_advantage_direction(tiny_model, tokenizer, loss, agg):
    eng = make_engine(tiny_model)
    batch = make_batch(eng, tokenizer, seed=1)
    kw = {"eps_clip": 3e-3, "eps_clip_higher": 4e-3} if loss == "gspo" else {}
    cfg = ActorConfig(loss=loss, loss_agg_mode=agg, n_minibatches=2, ppo_epochs=2, **kw)
    actor = PPOActor(cfg, eng)
    actor.prepare(batch)
    adv_seq = batch["advantages"].sum(1)
    before = seq_logp(eng, batch)
    ppo_loss_before = eng.eval_batch(batch, actor._loss_fn(_Sink()), actor.loss_weight)
    stats = actor.ppo_update(batch)
    assert len(stats) == 4 and all(s["skipped"] == 0.0 for s in stats)
    keys = ["approx_kl", "ratio_mean", "ratio_max", "entropy", "policy_loss", "loss", "grad_norm", "staleness_max"]
    for key in keys + (["clip_frac"] if loss != "reinforce" else []):
        assert key in stats[0], key
    assert stats[0]["approx_kl"] == pytest.approx(0.0, abs=1e-4)  # first step: still on-policy
    assert stats[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert stats[0]["staleness_max"] == 0.0  # every loss token from the current version
    _direction_check(before, seq_logp(eng, batch), adv_seq)
    if loss != "reinforce":  # the surrogate (ratio against the fixed old policy) went down
        assert eng.eval_batch(batch, actor._loss_fn(_Sink()), actor.loss_weight) < ppo_loss_before


class _Sink:
    def add(self, stats, weight):
        pass


def test_behaviour_kl_stat_is_k3_over_loss_tokens(tiny_model, tokenizer):
    """actor/behav_kl = mean over loss tokens of exp(r) - 1 - r, r = log pi_theta - log pi_behaviour."""
    eng = make_engine(tiny_model)
    batch = make_batch(eng, tokenizer, seed=4)
    policy = batch["logprobs"].clone()  # the engine's own logprobs (make_batch is on-policy)
    shift = torch.randn(policy.shape, generator=torch.Generator().manual_seed(0)) * 0.3
    batch["logprobs"] = (policy + shift) * batch["loss_mask"]  # a behaviour policy that differs
    actor = PPOActor(ActorConfig(), eng)
    actor.prepare(batch)
    stats = actor.ppo_update(batch)[0]
    total, n = 0.0, 0
    for i in range(policy.shape[0]):
        for j in range(policy.shape[1]):
            if batch["loss_mask"][i, j]:
                r = float(policy[i, j]) - float(batch["logprobs"][i, j])
                total, n = total + math.exp(r) - 1 - r, n + 1
    assert stats["behav_kl"] == pytest.approx(total / n, rel=1e-4) and stats["behav_kl"] > 0.01


def test_decoupled_ppo_with_stale_behaviour_policy(tiny_model, tokenizer):
    eng = make_engine(tiny_model)
    batch = make_batch(eng, tokenizer, seed=2)
    g = torch.Generator().manual_seed(0)
    # behaviour tokens came from older versions whose logprobs differ from the current policy
    batch["logprobs"] = (batch["logprobs"] - 0.8 * torch.rand(batch["logprobs"].shape, generator=g)) * batch[
        "loss_mask"
    ]
    eng.set_version(3)
    batch["versions"] = torch.where(batch["loss_mask"], torch.randint(1, 4, batch["versions"].shape, generator=g), -1)
    cfg = ActorConfig(
        loss="decoupled_ppo", behav_imp_weight_cap=1.5, reuse_update_logp=False
    )  # keep prox_logp to check
    actor = PPOActor(cfg, eng)
    actor.prepare(batch)
    lag = 3 - batch["versions"][batch["loss_mask"]]
    stats = actor.ppo_update(batch)
    s = stats[0]
    assert s["staleness_mean"] == pytest.approx(float(lag.double().mean()))
    assert s["staleness_max"] == float(lag.max())
    w = (batch["prox_logp"] - batch["logprobs"]).exp()[batch["loss_mask"]]
    assert s["behav_capped_frac"] == pytest.approx(float((w > 1.5).float().mean()), abs=1e-5)
    assert 0 < s["behav_capped_frac"] < 1
    assert PPOActor(dataclasses.replace(cfg, recompute_logp=False), eng).recomputes_logp(batch)  # its proximal policy


def test_kl_to_reference_and_kl_in_reward(tiny_model, tokenizer):
    eng = make_engine(tiny_model)
    ref = make_engine(tiny_model, trainable=False)
    batch = make_batch(eng, tokenizer, seed=3)
    actor = PPOActor(ActorConfig(kl_coef=0.1, n_minibatches=1, reuse_update_logp=False), eng, ref_engine=ref)
    actor.prepare(batch)
    m = batch["loss_mask"]
    assert torch.allclose(batch["ref_logp"][m], batch["old_logp"][m], atol=1e-5)
    s1 = actor.ppo_update(batch)[0]
    assert s1["kl_loss"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first step
    s2 = actor.ppo_update(batch)[0]
    assert s2["kl_loss"] > 1e-6
    # KL as reward: per-token penalties enter the returns of REINFORCE++
    batch2 = make_batch(eng, tokenizer, seed=3)
    cfg = ActorConfig(adv_estimator="reinforce_pp", kl_coef=0.5, kl_in_reward=True, kl_estimator="k1")
    PPOActor(cfg, eng, ref_engine=ref).prepare(batch2)
    kl = (batch2["old_logp"] - batch2["ref_logp"]) * batch2["loss_mask"]
    # plainly: the return of a loss token = the sequence reward (paid at its last loss token) minus
    # 0.5 * KL summed over this and every later loss token of the sequence (gamma 1)
    mask = batch2["loss_mask"]
    for i in range(mask.shape[0]):
        idx = [j for j in range(mask.shape[1]) if mask[i, j]]
        for n, j in enumerate(idx):
            expected = float(batch2["rewards"][i]) - 0.5 * sum(float(kl[i, k]) for k in idx[n:])
            assert float(batch2["returns"][i, j]) == pytest.approx(expected, abs=1e-5), (i, j)
    assert float(kl.abs().sum()) > 0


def test_critic_gae_and_value_update(tiny_model, tokenizer):
    eng = make_engine(tiny_model)
    critic = Critic(
        ActorConfig(value_clip=10.0, ppo_epochs=1, n_minibatches=1), make_engine(tiny_model, lr=1e-4, head="value")
    )
    batch = make_batch(eng, tokenizer, seed=4)
    actor = PPOActor(ActorConfig(adv_estimator="gae", gamma=0.99, lam=0.95), eng)
    with pytest.raises(ValueError, match="Critic"):
        actor.prepare(dict(batch))
    actor.prepare(batch, critic)
    v = batch["values"]
    assert torch.equal(v[:, 0], torch.zeros(8))  # value of token 0 = V(empty prefix) is not defined: 0
    adv, ret = A.gae_advantage(batch["rewards"].double(), batch["loss_mask"], values=v.double(), gamma=0.99, lam=0.95)
    assert torch.allclose(batch["advantages"].double(), adv, atol=1e-6)
    # actor.adv_norm (default on) whitens GAE over the loss tokens; off, the raw advantages are used
    m = batch["loss_mask"].bool()
    assert float(batch["advantages"][m].mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(batch["advantages"][m].std()) == pytest.approx(1.0, abs=1e-4)
    raw = PPOActor(ActorConfig(adv_estimator="gae", gamma=0.99, lam=0.95, adv_norm=False), eng).compute_advantages(
        dict(batch)
    )
    raw_ref, _ = A.gae_advantage(
        batch["rewards"].double(), batch["loss_mask"], values=v.double(), gamma=0.99, lam=0.95, adv_norm=False
    )
    assert torch.allclose(raw["advantages"].double(), raw_ref, atol=1e-6)
    assert not torch.allclose(raw["advantages"], batch["advantages"], atol=1e-3)
    assert torch.allclose(raw["returns"], batch["returns"])  # critic targets come from the raw advantages

    def value_err():
        vals = critic.compute_values(batch)
        return float((((vals - batch["returns"]) ** 2) * batch["loss_mask"]).sum() / batch["loss_mask"].sum())

    errs = [value_err()]
    for _ in range(4):  # the score head starts at 0, so the first steps only move the head: slow but steady
        stats = critic.update(batch)
        errs.append(value_err())
    assert "critic/vf_clip_frac" in stats[0] and "critic/loss" in stats[0]
    assert all(b < a for a, b in zip(errs[:-1], errs[1:], strict=True)) and errs[-1] < 0.95 * errs[0]
    actor.ppo_update(batch)


def _remax_reinforce_recipe():
    """recipes/remax_reinforce.py as a module (its REINFORCE actor is user code, not relayrl's)."""
    path = RECIPES.parent / "remax_reinforce.py"
    spec = importlib.util.spec_from_file_location("remax_reinforce", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reinforce_actor_two_class_pattern(tiny_model, tokenizer):
    eng = make_engine(tiny_model)
    batch = make_batch(eng, tokenizer, seed=5)
    batch["rewards"] = batch["rewards"] - batch["rewards"].mean()
    # the seed's loss equals the registered reinforce loss with the reward as advantage
    adv = batch["rewards"][:, None] * batch["loss_mask"]
    cfg = ActorConfig(loss="reinforce", adv_estimator="reinforce", baseline=False)
    actor = PPOActor(cfg, eng)
    actor.compute_advantages(batch)
    assert torch.allclose(batch["advantages"], adv.float())
    batch["old_logp"] = batch["logprobs"]
    recipe = _remax_reinforce_recipe()  # the user-written REINFORCE actor lives in its recipe
    reinforce_loss_fn, ReinforceActor, TorchReinforceActor = (
        recipe.reinforce_loss_fn,
        recipe.ReinforceActor,
        recipe.TorchReinforceActor,
    )

    a = eng.eval_batch(batch, reinforce_loss_fn, lambda x: float(x["loss_mask"].count_nonzero()))
    b = eng.eval_batch(batch, actor._loss_fn(_Sink()), actor.loss_weight)
    assert a == pytest.approx(b, rel=1e-5)

    before = seq_logp(eng, batch)
    stats = [ReinforceActor(eng).train_reinforce(batch) for _ in range(3)]
    assert stats[-1]["loss"] < stats[0]["loss"]
    _direction_check(before, seq_logp(eng, batch), batch["rewards"])

    # the backend binding: an engine class that also speaks train_reinforce
    bound = TorchReinforceActor(eng.config, ModelConfig(path="tiny"), model=copy.deepcopy(tiny_model))
    bound.initialize()
    assert bound.train_reinforce(batch)["skipped"] == 0.0


def test_minibatches_partition_rows():
    batch = {"input_ids": torch.arange(10)[:, None], "rewards": torch.arange(10.0), "scalar": torch.tensor(1.0)}
    mbs = list(minibatches(batch, 3, torch.Generator().manual_seed(0)))
    assert len(mbs) == 3 and sorted(torch.cat([m["rewards"] for m in mbs]).tolist()) == list(range(10))
    assert all(torch.equal(m["input_ids"][:, 0].float(), m["rewards"]) for m in mbs)
    assert len(list(minibatches(batch, 20, torch.Generator()))) == 10


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_recipes_load_and_build_an_actor(path, tiny_model):
    cfg = load_config(RunConfig, path)
    assert cfg.actor.adv_estimator in A.ADVANTAGES and cfg.actor.loss in A.LOSSES
    PPOActor(cfg.actor, None)  # type: ignore[arg-type]  # config-level checks only


def test_all_recipes_present():
    names = {p.stem for p in RECIPES.glob("*.yaml")}
    assert names >= {"grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "ppo_critic", "remax", "decoupled_ppo"}


@pytest.mark.parametrize("loss", ["ppo", "decoupled_ppo"])
def test_one_step_update_reuses_its_own_forward_for_old_logprobs(tiny_model, tokenizer, loss):
    """With one epoch of one minibatch the logprobs before the update are those of the update's
    own forward: skipping the recompute pass gives the same update (and no recompute happens)."""
    batch = make_batch(make_engine(tiny_model), tokenizer, seed=5)
    results = []
    for reuse in (True, False):
        eng, b = make_engine(tiny_model), {k: v.clone() for k, v in batch.items()}
        actor = PPOActor(ActorConfig(loss=loss, reuse_update_logp=reuse, recompute_logp=True), eng)
        assert actor.logp_from_update is reuse
        actor.prepare(b)
        stats = actor.ppo_update(b)[0]
        assert ("prox_logp" in b or "old_logp" in b) is not reuse  # reuse: no recompute pass ran
        results.append((stats, {k: v.clone() for k, v in eng.model.state_dict().items()}))
    (s_reuse, w_reuse), (s_recompute, w_recompute) = results
    assert s_reuse["loss"] == pytest.approx(s_recompute["loss"], abs=1e-6)
    assert s_reuse["approx_kl"] == pytest.approx(0.0, abs=1e-7)  # the ratio is exactly 1 at the only step
    for k in w_reuse:
        assert (w_reuse[k] - w_recompute[k]).abs().max() <= 1e-6, k
    assert not PPOActor(ActorConfig(ppo_epochs=2, recompute_logp=True), make_engine(tiny_model)).logp_from_update
    assert not PPOActor(
        ActorConfig(kl_coef=0.1, kl_in_reward=True, recompute_logp=True), make_engine(tiny_model)
    ).logp_from_update


def test_ppo_clips_against_the_behaviour_policy_by_default(tiny_model, tokenizer):
    """Default ``recompute_logp=false``: the ratio's old policy is the one that generated the tokens,
    so on a stale batch (the policy moved since) the clip acts as a trust region around it. With
    ``recompute_logp=true`` the old policy is the current one: ratio 1, nothing clipped, however stale."""
    gen = make_engine(tiny_model)
    batch = make_batch(gen, tokenizer, seed=6)  # generated by these weights
    stale = make_engine(tiny_model, lr=5e-3)
    defaults = PPOActor(ActorConfig(), stale)
    assert defaults.recomputes_logp(batch) and defaults.logp_from_update  # on-policy: the update's own forward
    moved = PPOActor(ActorConfig(recompute_logp=True), stale)
    for _ in range(3):  # the trainer moves on: the batch is now 3 versions behind
        moved.prepare(batch)
        moved.ppo_update(batch)
        batch.pop("old_logp", None)
    stale.set_version(3)
    batch.pop("advantages", None)
    assert not defaults.recomputes_logp(batch)
    b = dict(batch)
    defaults.prepare(b)
    assert torch.equal(b["old_logp"], b["logprobs"])  # the generator's, not recomputed
    s = defaults.ppo_update(b)[0]
    assert s["approx_kl"] > 1e-3 and s["clip_frac"] > 0.05
    b = dict(batch)
    recompute = PPOActor(ActorConfig(recompute_logp=True), stale)
    recompute.prepare(b)
    s = recompute.ppo_update(b)[0]
    assert s["approx_kl"] == pytest.approx(0.0, abs=1e-7) and s["clip_frac"] == 0.0


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_a_ready_made_value_model_keeps_its_head(family):
    """A token-classification model given to a value engine is used as is (its trained head kept), whatever
    the family names the head (``score``; GPT-2's ``classifier`` was taken for an LM and re-headed at 0)."""
    from transformers import AutoModelForTokenClassification

    from relayrl.data.families import build_tiny_family

    cfg = copy.deepcopy(build_tiny_family(family, seed=0).config)
    cfg.num_labels, cfg.architectures = 1, None
    torch.manual_seed(0)
    critic = AutoModelForTokenClassification.from_config(cfg)
    eng = TorchTrainEngine(TrainEngineConfig(), ModelConfig(path="tiny"), model=critic, head="value")
    eng.initialize()
    head = getattr(eng.model, "score", None) or eng.model.classifier
    assert eng.model is critic and float(head.weight.abs().sum()) > 0
