"""Where LocalEngine's time goes in the ``generation`` workload, and what bounds its ratio.

Two measurements per model, same process:

1. the cost of one decode step (``FastDecoder``, KV length 80) for 1, 4, 16 and 64 rows:
   a fixed part (reading every weight once per step) plus a part per row;
2. the ``generation`` benchmark's engine run (64 prompts, EOS-ended lengths) split into
   prefill, decode and the rest of the step (sampling, bookkeeping, row compaction).

From them, ``ideal_ratio`` = HF ``generate`` seconds ÷ (prefill + steps × fixed + tokens × per
row): what an engine with no overhead at all beyond prefill and the model's decode work would
reach against ``generate`` in this run. Writes ``bench/results/decode_cost.json``; not part of a
full ``run_all`` (``run_all.py --only decode_cost``).

    python bench/decode_cost.py [--models tiny,tiny-30m]
"""

from __future__ import annotations

import argparse
import collections
import time

import common
import generation as gen
import torch

from relayrl.api.config import InferenceConfig
from relayrl.inference.local import LocalEngine, decode


def step_cost(model: torch.nn.Module, rows: int, length: int = 80, n: int = 20) -> float:
    """Seconds of one FastDecoder step over ``rows`` rows with ``length`` cached tokens."""
    fd, cfg = decode.FastDecoder(model), model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    kv = [
        decode.SlabLayer(
            torch.randn(rows, cfg.num_key_value_heads, length, d), torch.randn(rows, cfg.num_key_value_heads, length, d)
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    tok, pos, mask = (
        torch.randint(8, 100, (rows,)),
        torch.full((rows,), length),
        torch.ones(rows, length + 1, dtype=torch.bool),
    )
    with torch.inference_mode():
        for i in range(n + 3):
            if i == 3:
                t0 = time.perf_counter()
            fd(tok, pos, mask, kv)
            for layer in kv:  # rewind: every step sees the same cache length
                layer.length = length
    return (time.perf_counter() - t0) / n


def phases(model: torch.nn.Module) -> dict[str, float]:
    """Seconds of prefill / decode / other in one engine run of the generation workload."""
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(name: str, fn):  # noqa: ANN001, ANN202
        def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0

        return run

    originals = {n: getattr(LocalEngine, n) for n in ("_prefill", "_decode")}
    for n, fn in originals.items():
        setattr(LocalEngine, n, timed(n.strip("_"), fn))
    try:
        engine = LocalEngine(InferenceConfig(max_batch_size=gen.N_PROMPTS, seed=0), model)
        engine.initialize()
        gen.run_engine(engine, gen.make_prompts(999, model.config.vocab_size)[:8])  # warm-up
        spent.clear()
        tokens, seconds, lengths = gen.run_engine(engine, gen.make_prompts(0, model.config.vocab_size))
        steps = engine.counters["steps"]
        engine.destroy()
    finally:
        for n, fn in originals.items():
            setattr(LocalEngine, n, fn)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "max_len": max(lengths),
        "prefill": spent["prefill"],
        "decode": spent["decode"],
        "other": seconds - spent["prefill"] - spent["decode"],
        "engine_steps": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,tiny-30m")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {}
    for preset in args.models.split(","):
        model = gen.eos_biased_model(preset)
        costs = {rows: step_cost(model, rows) for rows in (1, 4, 16, 64)}
        per_row = (costs[64] - costs[1]) / 63
        run = phases(model)
        g_tok, g_s, _ = gen.run_generate(model, gen.make_prompts(0, model.config.vocab_size), seed=0)
        steps = run["max_len"]
        ideal = run["prefill"] + steps * costs[1] + run["tokens"] * per_row
        out[preset] = {
            "step_ms_by_rows": {r: round(c * 1e3, 2) for r, c in costs.items()},
            "fixed_ms": round(costs[1] * 1e3, 2),
            "per_row_ms": round(per_row * 1e3, 3),
            "engine": {k: round(v, 3) for k, v in run.items()},
            "generate_seconds": round(g_s, 3),
            "ratio": round(g_s / run["seconds"], 3),
            "ideal_ratio": round(g_s / ideal, 3),
        }
        r = out[preset]
        print(
            f"{preset}: step {r['step_ms_by_rows']} ms by rows; engine {run['seconds']:.2f}s = prefill {run['prefill']:.2f} + "
            f"decode {run['decode']:.2f} + other {run['other']:.2f}; generate {g_s:.2f}s; ratio {r['ratio']:.2f}, "
            f"no-overhead ideal {r['ideal_ratio']:.2f}",
            flush=True,
        )
    common.write_result(
        {
            "name": "decode_cost",
            "figure": min(m["ideal_ratio"] for m in out.values()),
            "models": out,
            "figure_is": "ideal_ratio (worst model): generate seconds / (prefill + the model's decode work alone)",
        }
    )


if __name__ == "__main__":
    main()
