"""LoRA under FSDP2 over 2 real gloo processes == 1 process (as full fine-tuning: see
test_train_distributed.py): steps, adapters, merged weights, the adapters-off reference, and a
2-rank adapter checkpoint that resumes on one process."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from relayrl.api.config import LoraConfig, ModelConfig, OptimizerConfig, TrainEngineConfig
from relayrl.api.io import SaveLoadMeta
from relayrl.train import lora as L
from relayrl.train.engine import TorchTrainEngine
from relayrl.train.reference import AdapterOffReference
from tests.test_packing import make_batch
from tests.test_train_distributed import LENGTHS, STEPS, free_port, run_steps


def engine() -> TorchTrainEngine:
    from relayrl.data.models import build_tiny_model

    cfg = TrainEngineConfig(mb_max_tokens=64, optimizer=OptimizerConfig(lr=1e-3), total_steps=10)
    eng = TorchTrainEngine(cfg, ModelConfig(lora=LoraConfig(rank=8)), model=build_tiny_model("tiny", seed=0))
    eng.initialize()
    return eng


def outputs(eng: TorchTrainEngine) -> dict[str, object]:
    """What leaves the trainer: logprobs with and without adapters, merged weights, adapter tensors."""
    batch = make_batch(LENGTHS, seed=9)
    ref = AdapterOffReference(eng)
    ref.initialize()
    state = eng.state_dict()
    return {
        "logp": eng.forward(batch),
        "ref_logp": ref.forward(batch),
        "merged": L.merged_state_dict(state, L.lora_layers(eng.model)),
        "adapter": L.adapter_state_dict(state),
    }


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    eng = engine()
    stats = run_steps(eng, range(STEPS))
    out = outputs(eng)
    eng.set_version(STEPS)
    eng.save(SaveLoadMeta(os.path.join(out_dir, "ckpt"), with_optim=True))
    if rank == 0:
        torch.save({"stats": stats, **out}, os.path.join(out_dir, "result.pt"))
    dist.barrier()  # tear down together: a rank leaving while its peer still saves aborted gloo once
    dist.destroy_process_group()


def test_lora_two_ranks_equal_one_process(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "result.pt", weights_only=False)
    single = engine()
    expected = run_steps(single, range(STEPS))
    for a, b in zip(got["stats"], expected, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(b[k])), (k, a[k], b[k])
    mine = outputs(single)
    for key in ("merged", "adapter"):
        assert got[key].keys() == mine[key].keys()
        for k, v in mine[key].items():
            # summation order differs across ranks (~1e-9 on gradients); with B = 0 at the first step A's
            # gradients are ~0, and Adam (update ~ lr * sign(grad)) turns that into up to ~2e-5 at lr 1e-3
            assert (got[key][k] - v).abs().max() <= 5e-5, (key, k)
    torch.testing.assert_close(got["logp"], mine["logp"], atol=1e-5, rtol=0)
    # the base is frozen: only packing (other micro-batches per rank) separates the two reference passes
    torch.testing.assert_close(got["ref_logp"], mine["ref_logp"], atol=1e-5, rtol=0)
    assert (got["ref_logp"] - got["logp"]).abs().max() > 1e-4  # and it is not the adapted policy
    # the 2-rank adapter checkpoint (adapter + gathered optimizer state) resumes on one process
    resumed = engine()
    resumed.load(SaveLoadMeta(str(tmp_path / "ckpt"), with_optim=True))
    assert resumed.get_version() == STEPS
    a, b = run_steps(resumed, range(STEPS, STEPS + 1)), run_steps(single, range(STEPS, STEPS + 1))
    assert abs(a[0]["loss"] - b[0]["loss"]) <= 1e-6
    for p, q in zip(resumed.model.parameters(), single.model.parameters(), strict=True):
        assert (p - q).abs().max() <= 5e-5
