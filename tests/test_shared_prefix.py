"""Shared-prefix training (relayrl.train.prefix, issue #37): rows sharing a prompt compute it once, and
logprobs, entropies, logits and every parameter's gradient equal the plain packed layout's on every
tiny architecture family; the switch and the fallbacks keep the plain layout."""

from __future__ import annotations

import pytest
import torch

from relayrl.api.config import LoraConfig, ModelConfig, TrainEngineConfig
from relayrl.data.families import FAMILIES, build_tiny_family
from relayrl.train.engine import TorchTrainEngine
from relayrl.train.lmhead import TokenStats, token_stats_loss
from relayrl.train.packing import (
    TREE_KWARG,
    model_inputs,
    pack,
    register_varlen_attention,
    segment_ids,
    token_entropy,
    token_logprobs,
)
from relayrl.train.prefix import MIN_SHARED, plan_micro_batches, plan_runs, shared_layout

MOE = {"mixtral", "qwen3_moe"}  # the engine keeps the plain layout (routing replay, load-balancing loss)
FULL_LOGITS = {"gemma2"}  # soft-capped logits: no LM-head fast path, so no shared training loss


def rows_batch() -> dict[str, torch.Tensor]:
    """Two groups with varying completion lengths (prompts of 20 and 27 tokens), a row sharing only 18
    tokens of the first prompt, two singletons, one completion of one token; loss on completions."""
    g = torch.Generator().manual_seed(0)
    p1, p2 = torch.randint(3, 128, (20,), generator=g), torch.randint(3, 128, (27,), generator=g)
    rows = [(p1, n) for n in (5, 9, 1, 14)] + [(p2, n) for n in (3, 11, 6)]
    rows += [
        (p1[:18], 7),
        (torch.randint(3, 128, (22,), generator=g), 6),
        (torch.randint(3, 128, (9,), generator=g), 4),
    ]
    order = [8, 0, 4, 1, 9, 5, 2, 7, 6, 3]  # groups interleaved in the batch
    width = max(len(p) + n for p, n in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    att = torch.zeros(len(rows), width, dtype=torch.bool)
    loss = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, j in enumerate(order):
        p, n = rows[j]
        ids[i, : len(p) + n] = torch.cat([p, torch.randint(3, 128, (n,), generator=g)])
        att[i, : len(p) + n] = True
        loss[i, len(p) : len(p) + n] = True
    return {"input_ids": ids, "attention_mask": att, "loss_mask": loss}


def engine_for(family: str, model_config: ModelConfig | None = None, **config: object) -> TorchTrainEngine:
    model = build_tiny_family(family, seed=3)
    mc = model_config or ModelConfig(path="tiny")
    engine = TorchTrainEngine(TrainEngineConfig(**config), mc, model=model)  # type: ignore[arg-type]
    engine.initialize()
    return engine


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = max(float(b.abs().max()), 1e-30)
    err = float((a - b).abs().max()) / scale
    assert err <= 1e-6, f"{what}: max error {err:.3g} relative to the largest entry"


def close_grads(model: torch.nn.Module, g: list[torch.Tensor], g_ref: list[torch.Tensor]) -> None:
    """Every parameter's gradient within 1e-6 of the whole gradient's norm. (Per tensor, fp32 rounding
    alone is more: the plain layout's own k_proj.bias gradient is 2.3e-6 (norm) from float64's on qwen2,
    the shared one's 2.2e-6, 1e-6 apart; an off-by-one position or mask is off by 1e-2 and more.)"""
    total = float(torch.cat([x.double().flatten() for x in g_ref]).norm())
    for (name, _), a, b in zip(model.named_parameters(), g, g_ref, strict=True):
        err = float((a - b).double().norm()) / total
        assert err <= 1e-6, f"grad {name}: error {err:.3g} relative to the gradient's norm"


def test_rows_sharing_a_prompt_form_one_tree_and_the_rest_stay_plain() -> None:
    packed = pack(rows_batch())
    layout = shared_layout(packed)
    assert layout is not None
    # p1's four rows and the row sharing 18 of its tokens: one tree of 17 prefix tokens (4 x 17 saved
    # beats 3 x 19 and a plain row); p2's three rows: a tree of 26; the two singletons plain
    trees = sorted((t.prefix, sorted(t.seg_lens)) for t in layout.trees)
    assert trees == [(17, [4, 8, 8, 12, 17]), (26, [4, 7, 12])]
    assert sorted(n for _, n in layout.docs) == [13, 17, 26, 28]  # the plain rows and the two prefixes
    assert layout.saved == 4 * 17 + 2 * 26 == int(packed["input_ids"].numel()) - int(layout.input_ids.numel())
    # every plain-layout token is computed at a shared position holding the same token id
    assert torch.equal(layout.input_ids[layout.index], packed["input_ids"])
    # segments continue the prefix's positions: the plain layout's position of each token
    assert torch.equal(layout.position_ids[layout.index], packed["position_ids"])


def test_plan_prefers_each_prompt_over_a_common_preamble() -> None:
    pre = list(range(3, 23))  # 20 tokens every row starts with (a system prompt)
    a, b = pre + [50] * 15, pre + [60] * 15
    rows = [a + [1], a + [2], a + [3], b + [1], b + [2], b + [3]]
    runs = sorted((sorted(r), s) for r, s in plan_runs(rows))
    assert runs == [([0, 1, 2], 35), ([3, 4, 5], 35)]  # 2 x 2 x 34 saved, not 5 x 19 by one tree
    assert plan_runs([a + [1], b + [2]]) == [([0, 1], 20)]  # only the preamble in common
    short = [list(range(MIN_SHARED - 1)) + [5], list(range(MIN_SHARED - 1)) + [6]]
    assert all(s == 0 for _, s in plan_runs(short))  # fewer than MIN_SHARED: no tree
    assert shared_layout(pack({"input_ids": torch.tensor(short), "attention_mask": torch.ones(2, 16)})) is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shared_layout_gives_the_plain_logits_and_gradients_on_every_family(family: str) -> None:
    """The model alone (MoE and soft-capped families included): logits at every position, and every
    parameter's gradient of weighted logprobs and entropies at the loss tokens, equal the plain packed
    layout's."""
    torch.manual_seed(0)
    model = build_tiny_family(family, seed=3).float()
    model.set_attn_implementation(register_varlen_attention())
    packed = pack(rows_batch())
    layout = shared_layout(packed)
    assert layout is not None
    mask = packed["loss_mask"].bool()
    w = torch.randn(mask.shape[0], generator=torch.Generator().manual_seed(1))

    def run(inputs: dict[str, object]) -> torch.Tensor:
        logits = model(**inputs).logits[0]
        lp, ent = token_logprobs(logits, packed), token_entropy(logits, packed)
        (torch.where(mask, lp * w, 0.0).sum() + torch.where(mask, ent * w.flip(0), 0.0).sum()).backward()
        return logits.detach()

    ref = run(model_inputs(packed))
    g_ref = grads(model)
    out = run({**layout.model_inputs(), "logits_to_keep": layout.index})
    close(out, ref, "logits")
    close_grads(model, grads(model), g_ref)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in MOE | FULL_LOGITS])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_trains_on_the_shared_layout_with_the_plain_numbers(family: str, temperature: float) -> None:
    """The training loss's inputs (TokenStats logprobs and entropies at loss tokens) and every parameter's
    gradient, with train.shared_prefix auto against off."""
    engine = engine_for(family)
    (packed, _), *_ = list(engine._micro_batches(rows_batch()))
    mask = packed["loss_mask"].bool().clone()
    mask[packed["cu_seqlens"][:-1].long()] = False
    w = torch.randn(mask.shape[0], generator=torch.Generator().manual_seed(1))

    def objective() -> tuple[torch.Tensor, torch.Tensor]:
        stats = engine._head_stats(dict(packed))
        assert isinstance(stats, TokenStats)
        lp, ent = token_logprobs(stats, packed, temperature), token_entropy(stats, packed, temperature)
        (torch.where(mask, lp * w, 0.0).sum() + torch.where(mask, ent * w.flip(0), 0.0).sum()).backward()
        return lp.detach(), ent.detach()

    assert engine._shared_layout(packed) is not None
    lp, ent = objective()
    g = grads(engine._require())
    engine.config.shared_prefix = "off"
    assert engine._shared_layout(packed) is None
    lp_ref, ent_ref = objective()
    g_ref = grads(engine._require())
    close(lp, lp_ref, "logprobs")
    close(ent, ent_ref, "entropies")
    assert bool((lp[mask] != 0).all())
    close_grads(engine._require(), g, g_ref)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_no_grad_forward_uses_the_shared_layout_with_the_same_logprobs(family: str) -> None:
    engine = engine_for(family)
    calls: list[bool] = []
    model = engine._require()
    model.register_forward_pre_hook(lambda _m, _a, kw: calls.append(TREE_KWARG in kw), with_kwargs=True)
    batch = rows_batch()
    shared = engine.forward(batch, temperature=0.7)
    engine.config.shared_prefix = "off"
    plain = engine.forward(batch, temperature=0.7)
    assert calls == [True, False]
    close(shared, plain, "forward logprobs")
    assert bool((shared[batch["attention_mask"]].ne(0)).sum() > 100)


def test_micro_batches_keep_a_trees_rows_together_within_the_computed_token_budget() -> None:
    batch = rows_batch()
    lengths = batch["attention_mask"].sum(1).tolist()
    groups = plan_micro_batches(batch["input_ids"], lengths, budget=80)
    assert sorted(r for g in groups for r in g) == list(range(10))
    for g in groups:
        layout = shared_layout(pack(batch, g))
        assert (sum(lengths[r] for r in g) if layout is None else int(layout.input_ids.numel())) <= 80
    by_row = {r: i for i, g in enumerate(groups) for r in g}
    # the 27-token prompt's rows (batch rows 2, 5, 8) cost 26 + 4 + 12 + 7 = 49: one micro-batch
    assert by_row[2] == by_row[5] == by_row[8]
    # p1's five rows cost 17 + 4 + 8 + 8 + 12 + 17 = 66: together too
    assert len({by_row[r] for r in (1, 3, 6, 7, 9)}) == 1
    big = plan_micro_batches(batch["input_ids"], lengths, budget=40)  # a tree past the budget: chunks, each sharing
    assert all(sum(lengths[r] for r in g) <= 40 or shared_layout(pack(batch, g)) is not None for g in big)


@pytest.mark.parametrize(("mb_max_tokens", "checkpointing"), [(8192, False), (80, False), (8192, True)])
def test_train_batch_and_forward_equal_with_the_switch_off(mb_max_tokens: int, checkpointing: bool) -> None:
    """One update's loss and grad norm, and forward's logprobs, with train.shared_prefix auto and off; with
    micro-batches that split the plain plan's groups, and under activation checkpointing (the layout goes
    through the recomputed forward)."""
    out, logp = {}, {}
    for mode in ("auto", "off"):
        torch.manual_seed(0)
        mc = ModelConfig(path="tiny", gradient_checkpointing=checkpointing)
        engine = engine_for("qwen2", mc, shared_prefix=mode, mb_max_tokens=mb_max_tokens)
        batch = {**rows_batch(), "adv": torch.linspace(-1, 1, 10)}  # a sequence-level key

        @token_stats_loss
        def loss_fn(logits: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
            lp = token_logprobs(logits, packed)
            mask = packed["loss_mask"].bool()
            return -torch.where(mask, lp * packed["adv"][segment_ids(packed)], 0.0).sum() / mask.sum()

        logp[mode] = engine.forward(batch)
        out[mode] = engine.train_batch(batch, loss_fn, lambda p: float(p["loss_mask"].sum()))
    assert out["auto"]["loss"] == pytest.approx(out["off"]["loss"], rel=1e-6)
    assert out["auto"]["grad_norm"] == pytest.approx(out["off"]["grad_norm"], rel=1e-6)
    close(logp["auto"], logp["off"], "forward logprobs")
    if mb_max_tokens == 80:  # the trees' rows together: fewer micro-batches than the plain plan's
        assert out["auto"]["n_mbs"] < out["off"]["n_mbs"]


def test_fallbacks_keep_the_plain_layout() -> None:
    batch = rows_batch()
    engine = engine_for("llama")
    (packed, _), *_ = list(engine._micro_batches(batch))
    assert engine._shared_layout(packed) is not None
    calls: list[bool] = []
    engine._require().register_forward_pre_hook(lambda _m, _a, kw: calls.append(TREE_KWARG in kw), with_kwargs=True)
    engine._loss_input(lambda logits, p: logits.sum(), dict(packed))  # an unmarked loss gets [T, V] logits, plain
    assert calls == [False]
    engine.head = "value"  # value / reward heads
    assert engine._shared_layout(packed) is None
    for family in MOE:  # routing replay and the load-balancing loss count plain tokens
        assert engine_for(family)._shared_layout(packed) is None
    sdpa = engine_for("llama")
    sdpa._checked.tested_attn = "sdpa"  # an attention that cannot read the layout
    assert sdpa._shared_layout(packed) is None
    images = dict(packed, image_grid_thw=torch.ones(1, 3, dtype=torch.long))
    assert engine_for("llama")._shared_layout(images) is None
    lora = engine_for("llama", ModelConfig(path="tiny", lora=LoraConfig(rank=4)))  # a LoRA-wrapped model and head
    assert lora._shared_layout(packed) is None
