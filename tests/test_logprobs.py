"""The LM-head fast path (relayrl.train.lmhead): logprobs, entropies and gradients equal the
full-logits path's on every tiny architecture family, and it steps aside where it cannot apply."""

from __future__ import annotations

import pytest
import torch

from relayrl.api.config import ModelConfig, TrainEngineConfig
from relayrl.data.families import FAMILIES, build_tiny_family
from relayrl.train.engine import TorchTrainEngine
from relayrl.train.lmhead import TokenStats, token_stats_loss, wants_token_stats
from relayrl.train.packing import token_entropy, token_logprobs

# families whose logits are changed after lm_head (soft-capping): they keep full logits
FULL_LOGITS = {"gemma2"}


def engine_for(family: str) -> TorchTrainEngine:
    engine = TorchTrainEngine(TrainEngineConfig(), ModelConfig(path="tiny"), model=build_tiny_family(family, seed=3))
    engine.initialize()
    return engine


def packed_batch(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lens, prompts = [23, 9, 31, 16], [12, 5, 20, 3]
    width = max(lens)
    ids = torch.randint(3, 128, (len(lens), width), generator=g)
    att = torch.zeros(len(lens), width, dtype=torch.bool)
    loss = torch.zeros(len(lens), width, dtype=torch.bool)
    for i, (n, p) in enumerate(zip(lens, prompts, strict=True)):
        att[i, :n] = True
        loss[i, p:n] = True
    ids = ids.masked_fill(~att, 0)
    (packed, _), *_ = list(engine._micro_batches({"input_ids": ids, "attention_mask": att, "loss_mask": loss}))
    return engine._to_device(packed)


def grads(engine: TorchTrainEngine) -> list[torch.Tensor]:
    model = engine._require()
    out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = max(float(b.abs().max()), 1e-30)
    err = float((a - b).abs().max()) / scale
    assert err <= 1e-6, f"{what}: max error {err:.3g} relative to the largest entry"


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in FULL_LOGITS])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fast_head_equals_full_logits(family: str, temperature: float) -> None:
    torch.manual_seed(0)
    engine = engine_for(family)
    packed = packed_batch(engine)
    mask = packed["loss_mask"].bool().clone()
    mask[packed["cu_seqlens"][:-1].long()] = False
    assert engine._head_stats_ok(packed)
    w = torch.randn(mask.shape[0], generator=torch.Generator().manual_seed(1))

    def objective(logits) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lp = token_logprobs(logits, packed, temperature)
        ent = token_entropy(logits, packed, temperature)
        (torch.where(mask, lp * w, 0.0).sum() + torch.where(mask, ent * w.flip(0), 0.0).sum()).backward()
        return lp.detach(), ent.detach(), mask

    lp_ref, ent_ref, _ = objective(engine._logits(dict(packed)))
    g_ref = grads(engine)
    stats = engine._head_stats(dict(packed))
    assert isinstance(stats, TokenStats)
    lp, ent, _ = objective(stats)
    g = grads(engine)
    close(lp[mask], lp_ref[mask], "logprobs")
    close(ent[mask], ent_ref[mask], "entropies")
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all()
    names = [n for n, _ in engine._require().named_parameters()]
    for name, a, b in zip(names, g, g_ref, strict=True):
        close(a, b, f"grad of {name}")


def test_soft_capped_head_keeps_full_logits() -> None:
    engine = engine_for("gemma2")
    packed = packed_batch(engine)
    assert not engine._head_stats_ok(packed)
    got: list[object] = []

    @token_stats_loss
    def loss_fn(logits, p):
        got.append(logits)
        return token_logprobs(logits, p).sum()

    loss = loss_fn(engine._loss_input(loss_fn, packed), packed)
    assert isinstance(got[0], torch.Tensor) and torch.isfinite(loss)


def test_unmarked_loss_gets_logits_and_train_batch_matches() -> None:
    """A custom LossFn (unmarked) gets [T, V] logits; a marked one trains to the same gradients."""
    torch.manual_seed(0)
    engine = engine_for("llama")
    packed = packed_batch(engine)
    seen: list[object] = []

    def plain(logits, p):
        seen.append(logits)
        lp = token_logprobs(logits, p)
        return torch.where(p["loss_mask"].bool(), -lp, 0.0).sum()

    assert not wants_token_stats(plain)
    plain(engine._loss_input(plain, packed), packed).backward()
    g_ref = grads(engine)
    assert isinstance(seen[0], torch.Tensor) and seen[0].shape[0] == packed["input_ids"].shape[0]
    marked = token_stats_loss(lambda logits, p: plain(logits, p))
    marked(engine._loss_input(marked, packed), packed).backward()
    assert isinstance(seen[1], TokenStats)
    for a, b in zip(grads(engine), g_ref, strict=True):
        close(a, b, "grad")


def test_lora_and_value_heads_keep_full_logits() -> None:
    from relayrl.api.config import LoraConfig

    lora = TorchTrainEngine(
        TrainEngineConfig(),
        ModelConfig(path="tiny", lora=LoraConfig(rank=4)),
        model=build_tiny_family("llama", seed=3),
    )
    lora.initialize()
    assert not lora._head_stats_ok(packed_batch(lora))
    value = TorchTrainEngine(
        TrainEngineConfig(), ModelConfig(path="tiny"), model=build_tiny_family("llama"), head="value"
    )
    value.initialize()
    assert not value._head_stats_ok(packed_batch(value))
