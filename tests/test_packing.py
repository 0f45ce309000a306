"""Packing, token-budget micro-batches, token-aligned logprobs/entropy and varlen attention."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.train.packing import (
    flash_attn_available,
    model_inputs,
    pack,
    register_varlen_attention,
    segment_ids,
    split_by_token_budget,
    token_entropy,
    token_logprobs,
    unpack,
)


def make_batch(lengths: list[int], seed: int = 0, vocab: int = 90) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bsz, seqlen = len(lengths), max(lengths) + 2
    ids = torch.randint(3, vocab, (bsz, seqlen), generator=g)
    attn = torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]
    ids[~attn] = 0
    loss = attn.clone()
    loss[:, :3] = False
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss,
        "advantages": torch.randn(bsz, seqlen, generator=g) * attn,
        "rewards": torch.arange(bsz, dtype=torch.float32),
        "group_id": torch.arange(bsz) // 2,
    }


def test_pack_layout_and_unpack_roundtrip():
    b = make_batch([4, 7, 2, 5])
    p = pack(b, [3, 1])
    assert p["cu_seqlens"].tolist() == [0, 5, 12] and p["cu_seqlens"].dtype == torch.int32
    assert int(p["max_seqlen"]) == 7
    assert p["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    assert p["input_ids"].tolist() == b["input_ids"][3, :5].tolist() + b["input_ids"][1, :7].tolist()
    assert p["rewards"].tolist() == [3.0, 1.0] and p["group_id"].tolist() == [1, 0]
    assert p["row_index"].tolist() == [3, 1] and "attention_mask" not in p
    assert segment_ids(p).tolist() == [0] * 5 + [1] * 7
    back = unpack(p["advantages"], p, 4, b["input_ids"].shape[1])
    assert torch.equal(back[[3, 1]], b["advantages"][[3, 1]]) and back[[0, 2]].abs().sum() == 0


def test_pack_errors_name_the_problem():
    b = make_batch([3, 4])
    with pytest.raises(ValueError, match="bad"):
        pack({**b, "bad": torch.zeros(5)})
    with pytest.raises(ValueError, match="attention_mask"):
        pack({"input_ids": b["input_ids"]})


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(64, 600), st.integers(1, 4), st.integers(1, 3)
)
def test_split_by_token_budget_properties(lengths, budget, min_groups, multiple_of):
    groups = split_by_token_budget(lengths, budget, min_groups=min_groups, multiple_of=multiple_of)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert len(groups) >= min_groups and len(groups) % multiple_of == 0
    for g in groups:
        tokens = sum(lengths[i] for i in g)
        assert tokens <= budget or len(g) == 1  # only an over-long sequence may exceed, alone
    # never more groups than a simple first-fit needs (+ the rounding to multiple_of)
    ff: list[int] = []
    for n in sorted(lengths, reverse=True):
        for j, t in enumerate(ff):
            if t + n <= budget:
                ff[j] += n
                break
        else:
            ff.append(n)
    assert len(groups) <= max(len(ff), min_groups) + multiple_of - 1 + 1


def test_split_balances_tokens_across_ranks():
    lengths = [512, 20, 300, 35, 64, 128, 40, 256, 80, 25, 400, 60]
    groups = split_by_token_budget(lengths, budget=10**9, min_groups=2, multiple_of=2)
    sums = [sum(lengths[i] for i in g) for g in groups]
    assert len(groups) == 2 and abs(sums[0] - sums[1]) <= 20


def ref_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Plain loop: token t's logprob from the logits at t-1."""
    out = torch.zeros(ids.shape[0])
    for t in range(1, ids.shape[0]):
        probs = torch.softmax(logits[t - 1].double() / temperature, -1)
        out[t] = float(torch.log(probs[ids[t]]))
    return out


def ref_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    out = torch.zeros(logits.shape[0])
    for t in range(1, logits.shape[0]):
        probs = torch.softmax(logits[t - 1].double() / temperature, -1)
        out[t] = float(-(probs * probs.log()).sum())
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy_match_plain_loop(temperature):
    torch.manual_seed(0)
    b = make_batch([5, 9, 3])
    p = pack(b)
    logits = torch.randn(p["input_ids"].shape[0], 96)
    lp = token_logprobs(logits, p, temperature, chunk=4)
    ent = token_entropy(logits, p, temperature, chunk=4)
    cu = p["cu_seqlens"].tolist()
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        torch.testing.assert_close(
            lp[s:e], ref_logprobs(logits[s:e], p["input_ids"][s:e], temperature), atol=1e-5, rtol=0
        )
        torch.testing.assert_close(ent[s:e], ref_entropy(logits[s:e], temperature), atol=1e-5, rtol=0)
    assert lp[cu[:-1]].abs().sum() == 0 and ent[cu[:-1]].abs().sum() == 0
    # differentiable
    logits.requires_grad_(True)
    token_logprobs(logits, p, temperature).sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


# mixed lengths (mostly one document per padded group), and many similar ones (groups of up to 8)
LENGTH_MIXES = [[7, 31, 2, 18, 1], [10, 12, 11, 10, 13, 12, 9, 12, 30, 28]]


@pytest.mark.parametrize("lengths", LENGTH_MIXES)
@pytest.mark.parametrize("impl", ["varlen", "sdpa"])
def test_packed_forward_equals_separate(tiny_model, impl, lengths):
    name = register_varlen_attention() if impl == "varlen" else "sdpa"
    model = copy.deepcopy(tiny_model)
    model.set_attn_implementation(name)
    b = make_batch(lengths, seed=1)
    p = pack(b)
    with torch.no_grad():
        packed = model(**model_inputs(p)).logits[0]
        separate = torch.cat(
            [tiny_model(input_ids=b["input_ids"][i : i + 1, :n]).logits[0] for i, n in enumerate(lengths)]
        )
    assert (packed - separate).abs().max() <= 1e-5


@pytest.mark.parametrize("lengths", [[6, 13, 9], LENGTH_MIXES[1]])
def test_varlen_gradients_equal_separate(tiny_model, lengths):
    model = copy.deepcopy(tiny_model)
    model.set_attn_implementation(register_varlen_attention())
    ref = copy.deepcopy(tiny_model)
    b = make_batch(lengths, seed=2)
    model(**model_inputs(pack(b))).logits.pow(2).sum().backward()
    sum(ref(input_ids=b["input_ids"][i : i + 1, :n]).logits.pow(2).sum() for i, n in enumerate(lengths)).backward()
    for a, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert (a.grad - r.grad).abs().max() <= 1e-5 * max(1.0, float(r.grad.abs().max()))


@pytest.mark.skipif(not flash_attn_available(), reason="flash-attn and a CUDA device are not available")
def test_flash_varlen_equals_separate(tiny_model):
    model = copy.deepcopy(tiny_model).cuda().to(torch.bfloat16)
    model.set_attn_implementation("flash_attention_2")
    lengths = [7, 31, 18]
    b = make_batch(lengths, seed=1)
    p = {k: v.cuda() for k, v in pack(b).items()}
    with torch.no_grad():
        packed = model(**model_inputs(p)).logits[0].float()
        separate = torch.cat(
            [model(input_ids=b["input_ids"][i : i + 1, :n].cuda()).logits[0].float() for i, n in enumerate(lengths)]
        )
    assert (packed - separate).abs().max() <= 5e-2  # bf16
