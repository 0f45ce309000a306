"""LoRA on the train engine (one process): only adapters train, the reference is the base with
adapters off, merged weights reach a real LocalEngine, checkpoints are peft adapters that peft
loads and that resume exactly, and bad input fails at start-up with a clear message."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig

from relayrl.api.config import InferenceConfig, LoraConfig, ModelConfig, OptimizerConfig, TrainEngineConfig
from relayrl.api.io import SaveLoadMeta
from relayrl.data.families import FAMILIES, build_tiny_family
from relayrl.data.models import load_model
from relayrl.train.engine import TorchTrainEngine
from relayrl.train.lora import apply_lora, lora_layers, merged_state_dict
from relayrl.train.reference import AdapterOffReference
from tests.test_packing import make_batch
from tests.test_train_engine import LENGTHS, n_loss_tokens, pg_loss

RANK = 8


def lora_engine(model, rank=RANK, target_modules=(), budget=64, dropout=0.0, alpha=16.0, **opt) -> TorchTrainEngine:
    opt.setdefault("lr", 1e-2)
    cfg = TrainEngineConfig(mb_max_tokens=budget, optimizer=OptimizerConfig(**opt), total_steps=10)
    lora = LoraConfig(rank=rank, alpha=alpha, dropout=dropout, target_modules=list(target_modules))
    eng = TorchTrainEngine(cfg, ModelConfig(lora=lora), model=copy.deepcopy(model), seed=0)
    eng.initialize()
    return eng


@torch.no_grad()
def model_logp(model, batch) -> torch.Tensor:
    """``[B, L]`` logprobs of ``model``, one unpadded row at a time (independent of packing)."""
    out = torch.zeros(batch["input_ids"].shape)
    for i, n in enumerate(batch["attention_mask"].sum(1).tolist()):
        ids = batch["input_ids"][i : i + 1, :n]
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        out[i, 1:n] = logp.gather(-1, ids[0, 1:, None]).squeeze(-1).float()
    return out


def test_only_adapters_train_and_the_reference_is_the_base(tiny_model):
    eng = lora_engine(tiny_model)
    names = [n for n, p in eng.model.named_parameters() if p.requires_grad]
    # every linear projection of every decoder layer, A and B: 7 projections x 4 layers x 2
    assert len(names) == 7 * 4 * 2 and all(".lora_A." in n or ".lora_B." in n for n in names)
    opt_params = [p for g in eng.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in opt_params} == {id(p) for p in eng.model.parameters() if p.requires_grad}
    base_before = {n: p.detach().clone() for n, p in eng.model.named_parameters() if not p.requires_grad}

    batch = make_batch(LENGTHS, seed=1)
    expected = model_logp(tiny_model, batch)
    start = eng.forward(batch)  # B = 0: the adapted model computes what the base does
    assert (start - expected).abs().max() <= 1e-5
    for _ in range(2):
        eng.train_batch(make_batch(LENGTHS, seed=2), pg_loss, n_loss_tokens)
    for n, p in eng.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[n]), n  # the base is frozen
    trained = eng.forward(batch)
    assert (trained - expected).abs().max() > 1e-3  # the adapters moved the policy

    ref = AdapterOffReference(eng)
    ref.initialize()
    assert ref.model is eng.model  # one model in memory
    assert (ref.forward(batch) - expected).abs().max() <= 1e-5
    assert torch.equal(eng.forward(batch), trained)  # the adapters are back on after the reference pass


def test_merged_weights_reach_a_local_engine_and_leave_the_base_alone(tiny_model, tokenizer):
    from relayrl.inference.local import LocalEngine

    eng = lora_engine(tiny_model)
    eng.train_batch(make_batch(LENGTHS, seed=2), pg_loss, n_loss_tokens)
    eng.set_version(4)
    base_before = {n: p.detach().clone() for n, p in eng.model.named_parameters() if not p.requires_grad}
    # independent reference: peft's own merge on a copy of the trained model
    merged_by_peft = copy.deepcopy(eng.model).merge_and_unload().state_dict()
    local = LocalEngine(InferenceConfig(), model=copy.deepcopy(tiny_model), tokenizer=tokenizer)
    local.initialize()
    try:
        eng.update_weights(local)
        assert local.get_version() == 4
        theirs = local.model.state_dict()
        assert set(theirs) == set(merged_by_peft)
        for k, v in merged_by_peft.items():
            assert torch.allclose(theirs[k], v, atol=1e-6, rtol=0), k
        changed = [k for k in theirs if not torch.equal(theirs[k], tiny_model.state_dict()[k])]
        assert len(changed) == 7 * 4  # exactly the adapted projections differ from the base
        batch = make_batch(LENGTHS[:3], seed=3)
        assert (model_logp(local.model, batch) - eng.forward(batch)).abs().max() <= 1e-4
    finally:
        local.destroy()
    for n, p in eng.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[n]), n


def test_checkpoint_is_a_peft_adapter_and_resumes_exactly(tiny_model, tmp_path):
    b1, b2 = make_batch(LENGTHS, seed=1), make_batch(LENGTHS, seed=2)
    kw = dict(lr_schedule="cosine", warmup_steps=1)
    a = lora_engine(tiny_model, **kw)
    a.train_batch(b1, pg_loss, n_loss_tokens)
    a.set_version(7)
    ckpt = tmp_path / "ckpt"
    a.save(SaveLoadMeta(str(ckpt), with_optim=True))
    assert (ckpt / "adapter_config.json").is_file() and (ckpt / "adapter_model.safetensors").is_file()
    assert not list(ckpt.glob("model*.safetensors"))  # the adapter only, not the base
    s_a = a.train_batch(b2, pg_loss, n_loss_tokens)

    b = lora_engine(tiny_model, **kw)  # fresh adapters
    b.load(SaveLoadMeta(str(ckpt), with_optim=True))
    assert b.get_version() == 7 and b.get_lr() == s_a["lr"]
    s_b = b.train_batch(b2, pg_loss, n_loss_tokens)
    assert s_a == s_b
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))

    # peft loads it on the base and reproduces the trainer's logprobs at the checkpoint
    c = lora_engine(tiny_model)
    c.load(SaveLoadMeta(str(ckpt)))
    peft_model = PeftModel.from_pretrained(copy.deepcopy(tiny_model), str(ckpt)).eval()
    assert (model_logp(peft_model, b1) - c.forward(b1)).abs().max() <= 1e-5
    # and model.lora.adapter_path merges it into the base wherever a model is loaded (eval, serve)
    merged = load_model(ModelConfig(path="tiny", lora=LoraConfig(adapter_path=str(ckpt))), seed=0)
    assert type(merged) is type(tiny_model)
    assert (model_logp(merged, b1) - c.forward(b1)).abs().max() <= 1e-4
    assert (model_logp(tiny_model, b1) - c.forward(b1)).abs().max() > 1e-2  # the adapter's effect, not the base


def test_alpha_scales_the_adapters_update(tiny_model):
    """The merged update is (alpha / rank) * B @ A: doubling alpha doubles every weight's change."""
    batch = make_batch(LENGTHS, seed=2)
    engines = [lora_engine(tiny_model, alpha=alpha) for alpha in (16.0, 32.0)]
    for eng in engines:
        eng.train_batch(batch, pg_loss, n_loss_tokens)
        with torch.no_grad():  # the same adapters in both (Adam's step does not scale with alpha)
            for p, q in zip(eng.model.parameters(), engines[0].model.parameters(), strict=True):
                p.copy_(q)
    base = tiny_model.state_dict()
    deltas = [
        {k: v - base[k] for k, v in merged_state_dict(dict(e.model.state_dict()), lora_layers(e.model)).items()}
        for e in engines
    ]
    changed = [k for k in base if deltas[0][k].abs().max() > 0]
    assert len(changed) == 7 * 4
    for k in changed:
        torch.testing.assert_close(deltas[1][k], 2 * deltas[0][k], atol=1e-6, rtol=1e-4)


def test_dropout_acts_on_the_adapters_in_training_mode_only(tiny_model):
    eng = lora_engine(tiny_model, dropout=0.5)
    eng.train_batch(make_batch(LENGTHS, seed=2), pg_loss, n_loss_tokens)  # B != 0 from here on
    batch = make_batch(LENGTHS[:2], seed=3)
    eng.train(True)
    assert not torch.equal(eng.forward(batch), eng.forward(batch))  # dropout on the adapters' input
    eng.eval()
    assert torch.equal(eng.forward(batch), eng.forward(batch))


def test_target_modules_are_checked_at_start_up(tiny_model):
    eng = lora_engine(tiny_model, target_modules=["q_proj", "v_proj"])
    assert len([p for p in eng.model.parameters() if p.requires_grad]) == 2 * 4 * 2
    with pytest.raises(ValueError) as e:
        lora_engine(tiny_model, target_modules=["q_proj", "qkv"])
    msg = str(e.value)
    assert "model.lora.target_modules: 'qkv' matches no linear module" in msg
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in msg
    assert "\n" not in msg


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_wraps_and_merges_as_peft_does(family):
    """Default targets on each family; the on-the-fly merge (GPT-2's transposed Conv1D included)
    equals peft's own ``merge_and_unload`` once B is non-zero."""
    model = build_tiny_family(family)
    wrapped = apply_lora(copy.deepcopy(model), LoraConfig(rank=4, alpha=8.0))
    with torch.no_grad():
        for n, p in wrapped.named_parameters():
            if ".lora_B." in n:
                p.normal_(0.0, 0.1)
    merged = merged_state_dict(dict(wrapped.state_dict()), lora_layers(wrapped))
    expected = copy.deepcopy(wrapped).merge_and_unload().state_dict()
    assert set(merged) == set(expected) == set(model.state_dict())
    for k, v in expected.items():
        assert torch.allclose(merged[k], v, atol=1e-6, rtol=0), k
    assert sum(not torch.equal(merged[k], v) for k, v in model.state_dict().items()) == len(lora_layers(wrapped))


def test_a_model_with_nothing_to_adapt_is_refused():
    class NoLinear(torch.nn.Module):  # e.g. a family whose projections are fused parameters only
        config = AutoConfig.for_model("llama", vocab_size=8, hidden_size=8, num_attention_heads=2)

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 8)

    with pytest.raises(ValueError, match=r"^model.lora.rank > 0: model family 'llama' has no linear module"):
        apply_lora(NoLinear(), LoraConfig(rank=4))
