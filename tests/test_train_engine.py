"""TorchTrainEngine on one process: micro-batch gradients, forward, LR, NaN guard, checkpoints,
heads and weight sync into a real LocalEngine."""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from relayrl.api.config import InferenceConfig, ModelConfig, OptimizerConfig, TrainEngineConfig
from relayrl.api.io import SaveLoadMeta
from relayrl.train.engine import NonFiniteError, TorchTrainEngine, lr_factor
from relayrl.train.packing import token_logprobs
from tests.test_packing import make_batch, ref_logprobs

LENGTHS = [20, 37, 9, 50, 33, 16]


def make_engine(model, budget=100_000, head="lm", trainable=True, gc=False, **opt) -> TorchTrainEngine:
    opt.setdefault("lr", 1e-3)
    cfg = TrainEngineConfig(mb_max_tokens=budget, optimizer=OptimizerConfig(**opt), total_steps=10)
    eng = TorchTrainEngine(
        cfg, ModelConfig(gradient_checkpointing=gc), model=copy.deepcopy(model), head=head, trainable=trainable
    )
    eng.initialize()
    return eng


def pg_loss(logits, packed):
    """Token-mean policy-gradient loss (what PPO reduces to on-policy)."""
    mask = packed["loss_mask"].float()
    return -(token_logprobs(logits, packed) * packed["advantages"] * mask).sum() / mask.sum()


def n_loss_tokens(packed) -> float:
    return float(packed["loss_mask"].sum())


def grads(eng):
    return [p.grad.clone() for p in eng.model.parameters()]


def test_micro_batch_gradient_equals_full_batch(tiny_model):
    batch = make_batch(LENGTHS)
    full, split = make_engine(tiny_model, grad_clip=0.0), make_engine(tiny_model, budget=64, grad_clip=0.0)
    s_full = full.train_batch(batch, pg_loss, n_loss_tokens)
    s_split = split.train_batch(batch, pg_loss, n_loss_tokens)
    assert s_full["n_mbs"] == 1 and s_split["n_mbs"] >= 3
    assert abs(s_full["loss"] - s_split["loss"]) <= 1e-6
    for a, b in zip(grads(full), grads(split), strict=True):
        assert (a - b).abs().max() <= 1e-6
    # and both equal the plain padded-batch gradient computed by hand
    ref = copy.deepcopy(tiny_model).train()
    logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["loss_mask"][:, 1:].float()
    (-(lp * batch["advantages"][:, 1:] * mask).sum() / mask.sum()).backward()
    for a, p in zip(grads(split), ref.parameters(), strict=True):
        assert (a - p.grad).abs().max() <= 1e-5


def test_gradient_checkpointing_same_gradient(tiny_model):
    batch = make_batch(LENGTHS[:3])
    a, b = make_engine(tiny_model, grad_clip=0.0), make_engine(tiny_model, grad_clip=0.0, gc=True)
    a.train_batch(batch, pg_loss, n_loss_tokens)
    b.train_batch(batch, pg_loss, n_loss_tokens)
    for ga, gb in zip(grads(a), grads(b), strict=True):
        assert (ga - gb).abs().max() <= 1e-6


def test_forward_logprobs_match_separate_runs(tiny_model):
    batch = make_batch(LENGTHS, seed=3)
    eng = make_engine(tiny_model, budget=64, trainable=False)
    assert eng.optimizer is None
    for temp in (1.0, 0.6):
        out = eng.forward(batch, temperature=temp)
        assert out.shape == batch["input_ids"].shape
        for i, n in enumerate(LENGTHS):
            with torch.no_grad():
                logits = tiny_model(input_ids=batch["input_ids"][i : i + 1, :n]).logits[0]
            torch.testing.assert_close(
                out[i, :n], ref_logprobs(logits, batch["input_ids"][i, :n], temp), atol=1e-5, rtol=0
            )
            assert out[i, n:].abs().sum() == 0
    with pytest.raises(RuntimeError, match="frozen"):
        eng.train_batch(batch, pg_loss, n_loss_tokens)


def test_eval_batch_is_weighted_loss(tiny_model):
    batch = make_batch(LENGTHS)
    eng = make_engine(tiny_model, budget=64)
    value = eng.eval_batch(batch, pg_loss, n_loss_tokens)
    stats = make_engine(tiny_model).train_batch(batch, pg_loss, n_loss_tokens)
    assert abs(value - stats["loss"]) <= 1e-6


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_schedules(tiny_model, schedule):
    opt = OptimizerConfig(lr=1e-3, lr_schedule=schedule, warmup_steps=2, min_lr_ratio=0.1)
    expected = {
        "constant": [0.5, 1, 1, 1, 1, 1],
        "linear": [0.5, 1, 1 - 0.9 * 1 / 8, 1 - 0.9 * 2 / 8, 1 - 0.9 * 3 / 8, 1 - 0.9 * 4 / 8],
        "cosine": [0.5, 1] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(1, 5)],
    }[schedule]
    assert [lr_factor(s, opt, 10) for s in range(6)] == pytest.approx(expected)
    assert lr_factor(50, opt, 10) == pytest.approx(1.0 if schedule == "constant" else 0.1)
    # train_batch steps the schedule itself: each step reports the rate it trained at
    eng = make_engine(tiny_model, lr=1e-3, lr_schedule=schedule, warmup_steps=2, min_lr_ratio=0.1)
    batch = make_batch(LENGTHS[:2])
    seen = [eng.train_batch(batch, pg_loss, n_loss_tokens)["lr"] for _ in range(6)]
    assert seen == pytest.approx([1e-3 * f for f in expected])
    assert eng.get_lr() == pytest.approx(1e-3 * lr_factor(6, opt, 10))


def test_nan_guard_skips_and_then_stops(tiny_model):
    batch = make_batch(LENGTHS[:3])
    eng = make_engine(tiny_model)
    eng.config.max_nan_skips = 3  # (the default is 5)
    eng.train_batch(batch, pg_loss, n_loss_tokens)
    params = [p.detach().clone() for p in eng.model.parameters()]
    opt_state = copy.deepcopy(eng.optimizer.state_dict())

    def nan_loss(logits, packed):
        return pg_loss(logits, packed) * float("nan")

    for _ in range(3):
        assert eng.train_batch(batch, nan_loss, n_loss_tokens)["skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(params, eng.model.parameters(), strict=True))
    state = eng.optimizer.state_dict()["state"]
    assert all(torch.equal(state[k]["exp_avg"], opt_state["state"][k]["exp_avg"]) for k in state)
    assert all(float(state[k]["step"]) == 1 for k in state)
    with pytest.raises(NonFiniteError, match="max_nan_skips=3"):
        eng.train_batch(batch, nan_loss, n_loss_tokens)
    # a finite step resets the count
    eng2 = make_engine(tiny_model)
    eng2.train_batch(batch, nan_loss, n_loss_tokens)
    assert eng2.train_batch(batch, pg_loss, n_loss_tokens)["skipped"] == 0.0 and eng2._nan_skips == 0


def test_save_load_resume_is_exact_and_hf_reloadable(tiny_model, tmp_path):
    b1, b2 = make_batch(LENGTHS, seed=1), make_batch(LENGTHS, seed=2)
    kw = dict(budget=64, lr_schedule="cosine", warmup_steps=1)
    a = make_engine(tiny_model, **kw)
    a.train_batch(b1, pg_loss, n_loss_tokens)
    a.set_version(7)
    a.save(SaveLoadMeta(str(tmp_path / "ckpt"), with_optim=True))
    s_a = a.train_batch(b2, pg_loss, n_loss_tokens)

    b = make_engine(tiny_model, **kw)  # fresh engine, untrained weights
    b.load(SaveLoadMeta(str(tmp_path / "ckpt"), with_optim=True))
    assert b.get_version() == 7 and b.get_lr() == s_a["lr"]  # the schedule resumes where it was saved
    s_b = b.train_batch(b2, pg_loss, n_loss_tokens)
    assert s_a == s_b
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"))
    ids = b1["input_ids"][:1, :20]
    c = make_engine(tiny_model)
    c.load(SaveLoadMeta(str(tmp_path / "ckpt")))
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, c.model(input_ids=ids).logits)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-vl"])
def test_load_takes_checkpoints_saved_in_the_hub_format(preset, tmp_path):
    """transformers saves MoE experts one by one and Qwen2-VL's tower as ``visual.*`` (not the model's
    fused / ``model.visual.*`` parameters): a resume loads them back, every tensor equal."""
    a = TorchTrainEngine(TrainEngineConfig(), ModelConfig(path=preset), seed=1)
    a.initialize()
    a.save(SaveLoadMeta(str(tmp_path / "ckpt")))
    b = TorchTrainEngine(TrainEngineConfig(), ModelConfig(path=preset), seed=2)
    b.initialize()
    want, before = a.model.state_dict(), dict(b.model.state_dict())
    assert any(not torch.equal(want[k], before[k]) for k in want)  # two seeds: different weights
    b.load(SaveLoadMeta(str(tmp_path / "ckpt")))
    got = b.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_update_weights_into_local_engine(tiny_model, tokenizer):
    from relayrl.inference.local import LocalEngine

    eng = make_engine(tiny_model)
    eng.train_batch(make_batch(LENGTHS[:3]), pg_loss, n_loss_tokens)
    eng.set_version(3)
    local = LocalEngine(InferenceConfig(), model=copy.deepcopy(tiny_model), tokenizer=tokenizer)
    local.initialize()
    try:
        eng.update_weights(local)
        assert local.get_version() == 3
        theirs = local.model.state_dict()
        for k, v in eng.model.state_dict().items():
            assert torch.equal(theirs[k].cpu(), v), k
        # the engine got copies: training further does not change the generator's weights
        before = theirs["model.norm.weight"].clone()
        eng.train_batch(make_batch(LENGTHS[:3], seed=5), pg_loss, n_loss_tokens)
        assert torch.equal(local.model.state_dict()["model.norm.weight"], before)
    finally:
        local.destroy()


def test_value_head_trains_and_reloads(tiny_model, tmp_path):
    batch = make_batch(LENGTHS[:4])
    batch["returns"] = torch.full_like(batch["advantages"], 0.5)
    critic = make_engine(tiny_model, head="value", lr=1e-2)
    v0 = critic.forward(batch)
    assert v0.shape == batch["input_ids"].shape and v0.abs().max() == 0  # zero-initialised head

    def mse(logits, packed):
        mask = packed["loss_mask"].float()
        return ((logits[:, 0].float() - packed["returns"]) ** 2 * mask).sum() / mask.sum()

    losses = [critic.train_batch(batch, mse, n_loss_tokens)["loss"] for _ in range(8)]
    assert losses[0] == pytest.approx(0.25) and losses[-1] < 0.6 * losses[0]
    critic.save(SaveLoadMeta(str(tmp_path / "critic")))
    hf = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"))
    with torch.no_grad():
        ref = hf(input_ids=batch["input_ids"][:1, :20]).logits[0, :, 0]
    torch.testing.assert_close(critic.forward(batch)[0, :20], ref, atol=1e-5, rtol=0)


def test_reward_head_scores_last_token_and_is_a_reward_fn(tiny_model):
    rm = make_engine(tiny_model, head="reward", trainable=False)
    torch.nn.init.normal_(rm.model.score.weight, std=0.1)
    batch = make_batch([5, 12, 8])
    scores = rm.score(batch)
    for i, n in enumerate([5, 12, 8]):
        with torch.no_grad():
            ref = rm.model(input_ids=batch["input_ids"][i : i + 1, :n]).logits[0, -1, 0]
        assert abs(float(scores[i]) - float(ref)) <= 1e-5
    fn = rm.as_reward_fn(max_batch=2)
    ids = [batch["input_ids"][i, :n].tolist() for i, n in enumerate([5, 12, 8])]

    async def together() -> list[float]:  # three episodes scoring in the same event-loop turn
        return await asyncio.gather(*(fn(None, prompt_ids=s[:3], completion_ids=s[3:]) for s in ids))

    got = asyncio.run(together())
    assert fn.batches == 2  # one forward per max_batch calls, not one per call
    assert max(abs(g - float(s)) for g, s in zip(got, scores, strict=True)) <= 1e-5
    assert asyncio.run(fn(None, prompt_ids=ids[1][:4], completion_ids=ids[1][4:])) == pytest.approx(got[1], abs=1e-6)
    with pytest.raises(ValueError, match="prompt_ids \\+ completion_ids is empty"):
        asyncio.run(fn(None, prompt_ids=[], completion_ids=[]))
