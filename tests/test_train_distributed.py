"""FSDP2 over 2 real gloo processes == 1 process; checkpoints gathered across ranks; weight
broadcast groups (gloo on CPU, NCCL when two GPUs exist)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from relayrl.api.config import ModelConfig, OptimizerConfig, TrainEngineConfig
from relayrl.api.io import SaveLoadMeta
from relayrl.train.engine import TorchTrainEngine
from tests.test_packing import make_batch
from tests.test_train_engine import n_loss_tokens, pg_loss

LENGTHS = [20, 37, 9, 50, 33, 16, 41, 12]
STEPS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine(fsdp: bool = True) -> TorchTrainEngine:
    from relayrl.data.models import build_tiny_model

    cfg = TrainEngineConfig(mb_max_tokens=64, fsdp=fsdp, optimizer=OptimizerConfig(lr=1e-3), total_steps=10)
    eng = TorchTrainEngine(cfg, ModelConfig(), model=build_tiny_model("tiny", seed=0))
    eng.initialize()
    return eng


def run_steps(eng: TorchTrainEngine, seeds: range) -> list[dict[str, float]]:
    stats = []
    for s in seeds:
        out = eng.train_batch(make_batch(LENGTHS, seed=s), pg_loss, n_loss_tokens)
        out.pop("n_mbs")  # per rank
        stats.append(out)
    return stats


def _worker(rank: int, world: int, port: int, out_dir: str, fsdp: bool) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    eng = engine(fsdp)
    stats = run_steps(eng, range(STEPS))
    logp = eng.forward(make_batch(LENGTHS, seed=9))
    state = eng.state_dict()
    eng.set_version(STEPS)
    eng.save(SaveLoadMeta(os.path.join(out_dir, "ckpt"), with_optim=True))
    if rank == 0:
        torch.save({"stats": stats, "state": state, "logp": logp}, os.path.join(out_dir, "result.pt"))
    dist.barrier()  # tear down together: a rank leaving while its peer still saves aborted gloo once
    dist.destroy_process_group()


@pytest.mark.parametrize("fsdp", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_two_ranks_equal_one_process(tmp_path, fsdp):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path), fsdp), nprocs=2, join=True)
    got = torch.load(tmp_path / "result.pt", weights_only=False)
    single = engine()
    expected = run_steps(single, range(STEPS))
    for a, b in zip(got["stats"], expected, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(b[k])), (k, a[k], b[k])
    mine = single.state_dict()
    assert got["state"].keys() == mine.keys()
    for k, v in mine.items():
        # summation order differs across ranks (~1e-9 on gradients); Adam's first steps
        # (update ~ lr * sign(grad)) can turn that into ~1e-6 on a few weights
        assert (got["state"][k] - v).abs().max() <= 1e-5, k
    torch.testing.assert_close(got["logp"], single.forward(make_batch(LENGTHS, seed=9)), atol=1e-5, rtol=0)
    if not fsdp:
        return
    # the 2-rank checkpoint (weights + gathered optimizer state) resumes on one process
    resumed = engine()
    resumed.load(SaveLoadMeta(str(tmp_path / "ckpt"), with_optim=True))
    assert resumed.get_version() == STEPS
    a, b = run_steps(resumed, range(STEPS, STEPS + 1)), run_steps(single, range(STEPS, STEPS + 1))
    assert abs(a[0]["loss"] - b[0]["loss"]) <= 1e-6
    for p, q in zip(resumed.model.parameters(), single.model.parameters(), strict=True):
        assert (p - q).abs().max() <= 1e-5


def _receiver(rank: int, port: int, out_dir: str) -> None:
    from relayrl.data.models import build_tiny_model
    from relayrl.inference.weight_group import WeightBroadcastGroup

    torch.set_num_threads(1)
    model = build_tiny_model("tiny", seed=123)  # different weights, same shapes
    group = WeightBroadcastGroup("127.0.0.1", port, world_size=2, rank=1, backend="gloo")
    with torch.no_grad():
        group.broadcast(dict(sorted(model.state_dict().items())))  # the sender's order
    torch.save(model.state_dict(), os.path.join(out_dir, "received.pt"))


@pytest.mark.slow
def test_weight_broadcast_group_gloo(tmp_path):
    from relayrl.inference.weight_group import WeightBroadcastGroup

    port = free_port()
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_receiver, args=(1, port, str(tmp_path)))
    proc.start()
    eng = engine()
    eng.train_batch(make_batch(LENGTHS), pg_loss, n_loss_tokens)
    group = WeightBroadcastGroup("127.0.0.1", port, world_size=2, rank=0, backend="gloo")
    group.broadcast(dict(sorted(eng.state_dict().items())))
    proc.join(timeout=120)
    assert proc.exitcode == 0
    received = torch.load(tmp_path / "received.pt")
    for k, v in eng.state_dict().items():
        assert torch.equal(received[k], v), k


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL broadcast needs two CUDA devices (one per process)")
def test_weight_broadcast_group_nccl():
    from relayrl.inference.weight_group import WeightBroadcastGroup

    port = free_port()
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_nccl_receiver, args=(port,))
    proc.start()
    torch.cuda.set_device(0)
    group = WeightBroadcastGroup("127.0.0.1", port, world_size=2, rank=0, backend="nccl")
    group.broadcast({"w": torch.arange(6.0, device="cuda")})
    proc.join(timeout=120)
    assert proc.exitcode == 0


def _nccl_receiver(port: int) -> None:
    from relayrl.inference.weight_group import WeightBroadcastGroup

    torch.cuda.set_device(1)
    group = WeightBroadcastGroup("127.0.0.1", port, world_size=2, rank=1, backend="nccl")
    buf = {"w": torch.zeros(6, device="cuda")}
    group.broadcast(buf)
    assert torch.equal(buf["w"].cpu(), torch.arange(6.0))
