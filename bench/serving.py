"""Serving overhead: tokens/s through one `relayrl serve` process ÷ in-process LocalEngine.

Same model, same workload (``--concurrency`` requests at once, ``--max-new`` tokens each,
ignore_eos), same torch threads (1), measured alternately in one run; also p50/p99 request
latency through the server. Goal: HTTP costs <= 15% throughput (ratio >= 0.85).

    python bench/serving.py [--model tiny] [--concurrency 64] [--max-new 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

from relayrl.api.config import InferenceConfig, ModelConfig
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.data.models import load_model
from relayrl.inference.local import LocalEngine
from relayrl.inference.remote import RemoteEngine
from relayrl.inference.server.launcher import launch_servers


async def _load(engine, n: int, max_new: int, tag: str) -> tuple[float, list[float]]:
    g = GenerationConfig(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)
    reqs = [ModelRequest(f"{tag}-{i}", [3, 10 + i % 60, 11 + (i * 7) % 60, 4], g) for i in range(n)]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
    wall = time.perf_counter() - t0
    assert all(o.output_len == max_new for o in outs)
    return n * max_new / wall, [o.latency for o in outs]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    icfg = InferenceConfig(max_batch_size=args.concurrency)
    local = LocalEngine(icfg, model=load_model(ModelConfig(path=args.model)))
    local.initialize()
    group = launch_servers(1, model=args.model, threads=1, overrides=[f"inference.max_batch_size={args.concurrency}"])
    remote = RemoteEngine(InferenceConfig(backend="remote", addresses=group.addresses))
    remote.initialize()
    try:
        asyncio.run(_load(local, 8, 8, "warm"))
        asyncio.run(_load(remote, 8, 8, "warm"))
        local_tps, remote_tps, lat = [], [], []
        for rep in range(args.repeats):
            local_tps.append(asyncio.run(_load(local, args.concurrency, args.max_new, f"l{rep}"))[0])
            tps, lats = asyncio.run(_load(remote, args.concurrency, args.max_new, f"r{rep}"))
            remote_tps.append(tps)
            lat += lats
            print(
                f"repeat {rep}: local {local_tps[-1]:.0f} tok/s, server {tps:.0f} tok/s, ratio {tps / local_tps[-1]:.3f}"
            )
    finally:
        remote.destroy()
        group.shutdown()
        local.destroy()
    ratios = [r / lo for r, lo in zip(remote_tps, local_tps, strict=True)]
    result = {
        "name": "serving",
        "ratio": round(statistics.median(ratios), 4),
        "ratio_min": round(min(ratios), 4),
        "ratio_max": round(max(ratios), 4),
        "local_tokens_per_s": round(statistics.median(local_tps), 1),
        "server_tokens_per_s": round(statistics.median(remote_tps), 1),
        "latency_p50_s": round(_pct(lat, 0.50), 4),
        "latency_p99_s": round(_pct(lat, 0.99), 4),
        "goal": "ratio >= 0.85 (HTTP costs <= 15% throughput)",
        "settings": {
            "model": args.model,
            "concurrency": args.concurrency,
            "max_new_tokens": args.max_new,
            "repeats": args.repeats,
            "torch_threads": 1,
        },
    }
    out = Path(__file__).parent / "results" / "serving.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
