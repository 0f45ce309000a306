"""Vision-language training: trajectories with images, packed with text, in TorchTrainEngine.

The reference is each episode alone through the Hugging Face model (which computes its own
M-RoPE positions from ``mm_token_type_ids``), teacher-forced, padded batch of one.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from relayrl.api.config import ModelConfig, TrainEngineConfig
from relayrl.api.workflow import TrajectoryError, concat_trajectories, validate_trajectory
from relayrl.data.models import build_tiny_vl_model, build_vl_tokenizer
from relayrl.data.vision import build_image_processor, encode_prompt
from relayrl.train.engine import TorchTrainEngine
from relayrl.train.packing import pack, split_by_token_budget, vision_tokens
from tests.test_vision import squares


def episode(vp, completion, reward=1.0):
    n, m = len(vp.input_ids), len(completion)
    traj = {
        "input_ids": torch.tensor([vp.input_ids + completion]),
        "attention_mask": torch.ones(1, n + m, dtype=torch.bool),
        "loss_mask": torch.tensor([[0] * n + [1] * m], dtype=torch.bool),
        "logprobs": torch.tensor([[0.0] * n + [-1.0] * m]),
        "versions": torch.tensor([[-1] * n + [0] * m]),
        "rewards": torch.tensor([reward]),
    }
    if vp.vision is not None:
        traj["pixel_values"] = vp.vision.pixel_values[None]
        traj["image_grid_thw"] = vp.vision.image_grid_thw[None]
    return traj


class TextOnly:
    def __init__(self, ids):
        self.input_ids, self.vision = ids, None


@pytest.fixture(scope="module")
def episodes():
    tok, proc = build_vl_tokenizer(), build_image_processor()
    g = torch.Generator().manual_seed(0)
    vps = [
        encode_prompt(tok, proc, [{"role": "user", "content": "count"}], [squares(2, (56, 56), 1)]),
        encode_prompt(tok, proc, [{"role": "user", "content": "how many?"}], [squares(3, (112, 56), 2)]),
        encode_prompt(tok, proc, [{"role": "user", "content": "both"}], [squares(1, (28, 56), 3), squares(2)]),
    ]
    vps.append(TextOnly(tok("<|user|>text only<|assistant|>")["input_ids"]))
    comps = [torch.randint(5, 100, (int(n),), generator=g).tolist() for n in (7, 3, 11, 5)]
    return vps, comps


def reference_logprobs(model, vp, completion):
    ids = torch.tensor([vp.input_ids + completion])
    kwargs = {}
    if vp.vision is not None:
        kwargs = {
            "pixel_values": vp.vision.pixel_values,
            "image_grid_thw": vp.vision.image_grid_thw,
            "mm_token_type_ids": (ids == model.config.image_token_id).int(),
        }
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits[0].float()
    logp = F.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), logp])


def test_concat_pads_vision_keys_and_validates(episodes):
    vps, comps = episodes
    trajs = [episode(vp, c) for vp, c in zip(vps[:3], comps[:3], strict=True)]
    batch = concat_trajectories(trajs)
    validate_trajectory(batch)
    grids = [vp.vision.image_grid_thw for vp in vps[:3]]
    assert batch["image_grid_thw"].shape == (3, 2, 3) and batch["pixel_values"].shape[:2] == (3, 32)
    assert torch.equal(batch["image_grid_thw"][0], torch.cat([grids[0], torch.zeros(1, 3, dtype=torch.long)]))
    assert vision_tokens(batch) == [int(g.prod(-1).sum()) for g in grids] == [16, 32, 24]
    packed = pack(batch, [2, 0])  # rows in the asked order: their images too
    assert torch.equal(packed["image_grid_thw"], torch.cat([grids[2], grids[0]]))
    assert torch.equal(packed["pixel_values"], torch.cat([vps[2].vision.pixel_values, vps[0].vision.pixel_values]))
    assert packed["image_rows"].tolist() == [2, 1]
    bad = dict(batch, image_grid_thw=batch["image_grid_thw"].clone())
    bad["image_grid_thw"][1, 0, 1] += 2
    with pytest.raises(TrajectoryError, match="row 1: image_grid_thw needs 48 patches, pixel_values has 32"):
        validate_trajectory(bad)


@pytest.mark.parametrize("preset", ["tiny-vl", "tiny-vl2.5"])
@pytest.mark.parametrize("mb_max_tokens", [4096, 64])
def test_packed_logprobs_equal_each_episode_alone(episodes, preset, mb_max_tokens):
    vps, comps = episodes
    model = build_tiny_vl_model(preset, seed=2)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.eval()
    refs = [reference_logprobs(model, vp, c) for vp, c in zip(vps, comps, strict=True)]
    eng = TorchTrainEngine(
        TrainEngineConfig(mb_max_tokens=mb_max_tokens), ModelConfig(path=preset), model=copy.deepcopy(model)
    )
    eng.initialize()
    # the text-only episode carries empty vision keys in a batch with images
    trajs = [episode(vp, c) for vp, c in zip(vps, comps, strict=True)]
    trajs[3]["pixel_values"] = torch.zeros(1, 0, trajs[0]["pixel_values"].shape[2])
    trajs[3]["image_grid_thw"] = torch.zeros(1, 0, 3, dtype=torch.long)
    batch = concat_trajectories(trajs)
    validate_trajectory(batch)
    plan = eng._plan(batch)
    # 64 tokens: rows 1 and 2 (text + patches > 32) alone, row 0 (36 with its patches) with the text-only row 3
    assert plan == ([[0, 1, 2, 3]] if mb_max_tokens == 4096 else [[1], [2], [0, 3]])
    logp = eng.forward(batch)
    for i, ref in enumerate(refs):
        n = ref.shape[0]
        assert torch.allclose(logp[i, :n], ref, atol=1e-4), (i, (logp[i, :n] - ref).abs().max())


def test_micro_batches_count_vision_patches():
    lengths, patches = [20, 20, 20, 20], [0, 0, 40, 40]
    assert len(split_by_token_budget(lengths, 80)) == 1
    assert len(split_by_token_budget([n + v for n, v in zip(lengths, patches, strict=True)], 80)) == 2


def test_train_batch_updates_vision_tower(episodes):
    vps, comps = episodes
    model = build_tiny_vl_model("tiny-vl", seed=3)
    eng = TorchTrainEngine(TrainEngineConfig(), ModelConfig(path="tiny-vl"), model=model)
    eng.initialize()
    before = {k: v.detach().clone() for k, v in eng.model.named_parameters()}
    batch = concat_trajectories([episode(vp, c) for vp, c in zip(vps[:3], comps[:3], strict=True)])

    def loss_fn(logits, packed):
        from relayrl.train.packing import token_logprobs

        lp = token_logprobs(logits, packed)
        mask = packed["loss_mask"].bool()
        return -(lp[mask]).mean()

    stats = eng.train_batch(batch, loss_fn, lambda p: float(p["loss_mask"].sum()))
    assert stats and all(torch.isfinite(torch.tensor(v)) for v in stats.values() if isinstance(v, float))
    changed = {k for k, v in eng.model.named_parameters() if not torch.equal(v.detach(), before[k])}
    assert any(k.startswith("model.visual.") for k in changed)  # gradients flow into the vision tower
    assert any("language_model" in k for k in changed)


def test_a_generated_image_pad_token_is_an_ordinary_token(episodes):
    """A policy may sample the image pad id; it is a plain token (only the prompt's pads take image features)."""
    vps, comps = episodes
    model = build_tiny_vl_model("tiny-vl", seed=4).eval()
    pad = model.config.image_token_id
    j = 3
    completion = comps[0][:j] + [pad] + comps[0][j:]
    eng = TorchTrainEngine(TrainEngineConfig(), ModelConfig(path="tiny-vl"), model=copy.deepcopy(model))
    eng.initialize()
    both = eng.forward(concat_trajectories([episode(vps[0], completion), episode(vps[1], comps[1])]))
    alone = eng.forward(episode(vps[0], completion))
    n = len(vps[0].input_ids) + len(completion)
    assert torch.allclose(both[0, :n], alone[0], atol=1e-5)
    # before the generated pad token, Hugging Face's forward (which cannot take it) agrees
    ref = reference_logprobs(model, vps[0], completion[:j])
    assert torch.allclose(alone[0, : ref.shape[0]], ref, atol=1e-4)
