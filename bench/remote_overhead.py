"""CPU cost of one generation request through RemoteEngine + `relayrl serve`, per side.

The RL-step workload of ``async_vs_sync`` (bursts of ``--burst`` requests of ~8 prompt tokens
and ``--max-new`` new tokens, started in one event-loop tick as an executor does), through one
server process with one torch thread. Measured in one run, variants alternating:

- client CPU ms / request: this process (RemoteEngine, its HTTP client, the event loop);
- server CPU ms / request: the server process (HTTP + JSON + validation + model);
- model CPU ms / request: the same bursts through an in-process LocalEngine, i.e. what the
  server would spend without HTTP; ``server - model`` is the serving overhead.

Variants are values of ``inference.batch_window_ms`` (0 = one HTTP call per request).

    python bench/remote_overhead.py [--bursts 20] [--burst 64] [--max-new 4] [--windows 0,1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relayrl.api.config import InferenceConfig, ModelConfig  # noqa: E402
from relayrl.api.io import GenerationConfig, ModelRequest  # noqa: E402
from relayrl.data.models import load_model  # noqa: E402
from relayrl.inference.local import LocalEngine  # noqa: E402
from relayrl.inference.remote import RemoteEngine  # noqa: E402
from relayrl.inference.server.launcher import launch_servers  # noqa: E402


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_of(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _bursts(engine: object, bursts: int, burst: int, max_new: int, tag: str) -> float:
    """Run the bursts on a fresh event loop; wall seconds."""
    g = GenerationConfig(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)

    async def go() -> None:
        for b in range(bursts):
            reqs = [
                ModelRequest(f"{tag}-{b}-{i}", [3, 10 + i % 60, 11 + (i * 7) % 60, 12, 13, 14, 15, 4], g)
                for i in range(burst)
            ]
            outs = await asyncio.gather(*(engine.agenerate(r) for r in reqs))  # type: ignore[attr-defined]
            assert all(o.output_len == max_new for o in outs)

    t0 = time.perf_counter()
    asyncio.run(go())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bursts", type=int, default=20)
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=4)
    ap.add_argument("--windows", default="0,1", help="batch_window_ms values to compare (comma-separated)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="", help="also write the JSON result here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    windows = [float(w) for w in args.windows.split(",")]
    n = args.bursts * args.burst
    local = LocalEngine(InferenceConfig(max_batch_size=args.burst), model=load_model(ModelConfig(path="tiny")))
    local.initialize()
    group = launch_servers(1, model="tiny", threads=1, overrides=[f"inference.max_batch_size={args.burst}"])
    server = psutil.Process(group.procs[0].pid)
    engines = {
        w: RemoteEngine(InferenceConfig(backend="remote", addresses=group.addresses, batch_window_ms=w))
        for w in windows
    }
    rows: dict[str, list[dict[str, float]]] = {"local": [], **{f"window={w:g}ms": [] for w in windows}}
    try:
        for e in engines.values():
            e.initialize()
            _bursts(e, 2, args.burst, args.max_new, "warm")
        _bursts(local, 2, args.burst, args.max_new, "warm")
        for rep in range(args.repeats):
            c0 = _cpu_self()
            wall = _bursts(local, args.bursts, args.burst, args.max_new, f"l{rep}")
            rows["local"].append({"model_ms": 1e3 * (_cpu_self() - c0) / n, "wall_s": wall})
            for w, e in engines.items():
                c0, s0 = _cpu_self(), _cpu_of(server)
                wall = _bursts(e, args.bursts, args.burst, args.max_new, f"r{rep}-{w}")
                rows[f"window={w:g}ms"].append(
                    {
                        "client_ms": 1e3 * (_cpu_self() - c0) / n,
                        "server_ms": 1e3 * (_cpu_of(server) - s0) / n,
                        "wall_s": wall,
                    }
                )
            print(
                f"repeat {rep}: "
                + " | ".join(f"{k} " + ", ".join(f"{m} {v:.3f}" for m, v in r[-1].items()) for k, r in rows.items()),
                flush=True,
            )
    finally:
        for e in engines.values():
            e.destroy()
        group.shutdown()
        local.destroy()
    med = {k: {m: round(statistics.median(r[m] for r in rs), 4) for m in rs[0]} for k, rs in rows.items()}
    model_ms = med["local"]["model_ms"]
    for k, v in med.items():
        if k != "local":
            v["server_overhead_ms"] = round(v["server_ms"] - model_ms, 4)
    result = {
        "name": "remote_overhead",
        "per_request": med,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "settings": {
            "bursts": args.bursts,
            "burst": args.burst,
            "max_new_tokens": args.max_new,
            "repeats": args.repeats,
            "model": "tiny",
            "torch_threads": 1,
        },
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
