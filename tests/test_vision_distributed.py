"""FSDP2 over 2 real gloo processes with a vision-language model == 1 process (tiny Qwen2-VL):
the vision tower is sharded (its blocks, then the tower), and a rank whose micro-batch holds no
image still runs the tower with the others."""

from __future__ import annotations

import functools
import os

import torch
import torch.multiprocessing as mp

from relayrl.api.config import ModelConfig, OptimizerConfig, TrainEngineConfig
from relayrl.api.workflow import concat_trajectories
from relayrl.train.engine import TorchTrainEngine
from relayrl.train.packing import token_logprobs
from tests.test_train_distributed import free_port

STEPS = 2


@functools.cache
def tokenizer_and_processor():
    from relayrl.data.models import build_vl_tokenizer
    from relayrl.data.vision import build_image_processor

    return build_vl_tokenizer(), build_image_processor()


def batch(seed: int) -> dict[str, torch.Tensor]:
    from relayrl.data.vision import encode_prompt
    from tests.test_vision import squares
    from tests.test_vision_train import TextOnly, episode

    tok, proc = tokenizer_and_processor()
    g = torch.Generator().manual_seed(seed)
    vps = [
        encode_prompt(tok, proc, [{"role": "user", "content": "count"}], [squares(k + 1, (56, 28 * (k + 1)), seed + k)])
        for k in range(3)
    ]
    vps += [TextOnly(tok("<|user|>no picture<|assistant|>")["input_ids"])] * 3  # some micro-batches: no image
    trajs = [episode(vp, torch.randint(5, 100, (4 + i,), generator=g).tolist()) for i, vp in enumerate(vps)]
    for t in trajs:
        t["advantages"] = torch.where(t["loss_mask"], torch.randn(t["loss_mask"].shape, generator=g), 0.0)
    return concat_trajectories(trajs)


def pg_loss(logits, packed):
    mask = packed["loss_mask"].float()
    return -(token_logprobs(logits, packed) * packed["advantages"] * mask).sum() / mask.sum()


def engine() -> TorchTrainEngine:
    from relayrl.data.models import build_tiny_vl_model

    cfg = TrainEngineConfig(mb_max_tokens=48, optimizer=OptimizerConfig(lr=1e-3))
    eng = TorchTrainEngine(cfg, ModelConfig(path="tiny-vl"), model=build_tiny_vl_model("tiny-vl", seed=0))
    eng.initialize()
    return eng


def run_steps(eng: TorchTrainEngine) -> list[float]:
    return [eng.train_batch(batch(s), pg_loss, lambda p: float(p["loss_mask"].sum()))["loss"] for s in range(STEPS)]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    eng = engine()
    visual = eng.model.model.visual
    sharded = isinstance(visual, FSDPModule) and all(isinstance(b, FSDPModule) for b in visual.blocks)
    losses = run_steps(eng)
    logp = eng.forward(batch(9))
    state = eng.state_dict()
    if rank == 0:
        torch.save({"losses": losses, "state": state, "logp": logp, "sharded": sharded}, f"{out_dir}/result.pt")
    dist.barrier()  # tear down together: a rank leaving while its peer still saves aborted gloo once
    dist.destroy_process_group()


def test_fsdp2_vision_model_two_ranks_equal_one_process(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "result.pt", weights_only=False)
    assert got["sharded"]
    single = engine()
    losses = run_steps(single)
    assert got["losses"] == [pytest_approx(x) for x in losses]
    assert torch.allclose(got["logp"], single.forward(batch(9)), atol=1e-5)
    mine = single.state_dict()
    for k, v in mine.items():
        assert (got["state"][k] - v).abs().max() <= 1e-5, k
    assert any(k.startswith("model.visual.") for k in mine)


def pytest_approx(x: float):
    import pytest

    return pytest.approx(x, rel=1e-5, abs=1e-6)
