"""Weight sync: seconds to move the weights of a ~30M model from the trainer into generators.

What the trainer pays per step: ``TorchTrainEngine.update_weights(target)`` (full state dict,
clone, hand-over, the target loads it and confirms the version), for

- ``local``: an in-process ``LocalEngine`` (tensor copy at a step boundary);
- ``server_http``: one ``relayrl serve`` process, safetensors upload over HTTP (the default);
- ``server_disk``: the same server, a versioned safetensors directory it reads
  (``inference.weight_sync_dir``; here on the local disk);
- ``server_broadcast``: the same server, a collective broadcast over a process group of
  their own (``inference.weight_sync=broadcast``: gloo here, NCCL between GPUs).

Median and spread over ``--repeats`` (after one warm-up each); ``ratio`` = server (HTTP)
seconds / LocalEngine seconds. Also the effective GB/s of fp32 weights.

    python bench/weight_sync.py [--model tiny-30m] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import time

import common
import torch

from relayrl.api.config import InferenceConfig, ModelConfig, TrainEngineConfig
from relayrl.data.models import load_model
from relayrl.inference.local import LocalEngine
from relayrl.inference.remote import RemoteEngine
from relayrl.inference.server.launcher import launch_servers
from relayrl.train.engine import TorchTrainEngine


def timed_pushes(trainer: TorchTrainEngine, target: object, repeats: int) -> list[float]:
    out = []
    for i in range(repeats + 1):  # the first push warms up
        trainer.set_version(trainer.get_version() + 1)
        t0 = time.perf_counter()
        trainer.update_weights(target)  # type: ignore[arg-type]
        if i:
            out.append(time.perf_counter() - t0)
        assert target.get_version() == trainer.get_version()  # type: ignore[attr-defined]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-30m")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 repeats (smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.model, args.repeats = "tiny", 2
    torch.set_num_threads(1)
    mcfg = ModelConfig(path=args.model)
    trainer = TorchTrainEngine(TrainEngineConfig(), mcfg, model=load_model(mcfg))
    trainer.initialize()
    n_params = sum(p.numel() for p in trainer.model.parameters())  # type: ignore[union-attr]
    n_bytes = sum(v.numel() * v.element_size() for v in trainer.state_dict().values())
    times: dict[str, list[float]] = {}

    local = LocalEngine(InferenceConfig(), model=load_model(mcfg))
    local.initialize()
    times["local"] = timed_pushes(trainer, local, args.repeats)
    local.destroy()

    sync_dir = common.CACHE / "weight_sync"
    shutil.rmtree(sync_dir, ignore_errors=True)
    sync_dir.mkdir(parents=True)
    group = launch_servers(1, model=args.model, threads=1, overrides=[f"allowed_weight_roots=[{sync_dir}]"])
    try:
        for mode in ("http", "disk", "broadcast"):
            cfg = InferenceConfig(
                backend="remote",
                addresses=group.addresses,
                weight_sync=mode,
                weight_sync_dir=str(sync_dir) if mode == "disk" else "",
                admin_token=group.admin_token,  # launched servers take weights only from the run's credential
            )
            remote = RemoteEngine(cfg)
            remote.initialize()
            times[f"server_{mode}"] = timed_pushes(trainer, remote, args.repeats)
            remote.destroy()
    finally:
        group.shutdown()
        shutil.rmtree(sync_dir, ignore_errors=True)

    for k, v in times.items():
        print(f"{k}: median {sorted(v)[len(v) // 2]:.3f}s ({n_bytes / 1e9 / sorted(v)[len(v) // 2]:.2f} GB/s) over {v}")
    seconds = {k: common.spread(v) for k, v in times.items()}
    ratios = [h / lo for h, lo in zip(times["server_http"], times["local"], strict=True)]
    s = common.spread(ratios)
    common.write_result(
        {
            "name": "weight_sync",
            "ratio": s["median"],
            "ratio_min": s["min"],
            "ratio_max": s["max"],
            "ratio_is": "server (HTTP upload) seconds / LocalEngine seconds",
            "seconds": seconds,
            "gb_per_s": {k: round(n_bytes / 1e9 / v["median"], 3) for k, v in seconds.items()},
            "settings": {
                "model": args.model,
                "params": n_params,
                "bytes": n_bytes,
                "dtype": "float32",
                "repeats": args.repeats,
                "servers": 1,
                "server_threads": 1,
                "torch_threads": 1,
                "path": "TorchTrainEngine.update_weights(target): state_dict + clone + transfer + load + version check",
            },
        },
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
