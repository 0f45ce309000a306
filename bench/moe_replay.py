"""MoE routed-experts replay: how far the trainer's logprobs are from the generator's, with and without it.

For tiny random Qwen3-MoE and Mixtral models (``relayrl.data.families``, here with 8 experts,
top-2, 4 layers: more near-tied routing choices than the 4-expert test models), LocalEngine
samples completions at temperature 1 and records the experts of every token it runs; the train
engine (``TorchTrainEngine``, packed) recomputes the completions' logprobs once with
``routed_experts`` replayed and once routing on its own. Figures per family and dtype: the mean
|delta logprob| over generated tokens, and the share of (token, MoE layer) routings where the
trainer's own top-k set differs from the generator's (the flips replay removes). fp32 and bf16
weights, CPU. Writes ``bench/results/moe_replay.json``.

    python bench/moe_replay.py [--requests 16] [--new 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/x.py` from the repo root

from relayrl.api.config import InferenceConfig, ModelConfig, TrainEngineConfig  # noqa: E402
from relayrl.api.io import GenerationConfig, ModelRequest, ModelResponse  # noqa: E402
from relayrl.api.workflow import concat_trajectories, trajectory_from_response  # noqa: E402
from relayrl.data.families import build_tiny_family  # noqa: E402
from relayrl.inference.local import LocalEngine  # noqa: E402
from relayrl.train.engine import TorchTrainEngine  # noqa: E402

MOE_OVERRIDES = {
    "qwen3_moe": {"num_experts": 8, "num_hidden_layers": 4},
    "mixtral": {"num_local_experts": 8, "num_hidden_layers": 4},
}


def build(family: str, dtype: torch.dtype, seed: int = 1) -> torch.nn.Module:
    return build_tiny_family(family, seed=seed, dtype=dtype, **MOE_OVERRIDES[family]).eval()


def generate(model: torch.nn.Module, n: int, new: int, seed: int = 0) -> list[ModelResponse]:
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, 120, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    engine = LocalEngine(InferenceConfig(device="cpu", admit_window_ms=20, seed=seed), model)
    engine.initialize()
    gc = GenerationConfig(max_new_tokens=new, temperature=1.0, ignore_eos=True)

    async def go() -> list[ModelResponse]:
        # every request queued before the engine runs, so they share one batch however busy the machine is
        # (bf16 rounding, hence routing, follows the batch's shape)
        engine.pause()
        calls = [asyncio.ensure_future(engine.agenerate(ModelRequest(str(i), p, gc))) for i, p in enumerate(prompts)]
        while engine._waiting.qsize() < len(prompts):  # (a benchmark may look inside)
            await asyncio.sleep(0.001)
        engine.resume()
        return await asyncio.gather(*calls)

    try:
        return asyncio.run(go())
    finally:
        engine.destroy()


def gaps(model: torch.nn.Module, resps: list[ModelResponse]) -> dict[str, float]:
    """Mean |delta logprob| with and without replay, and the trainer's own routing-flip rate."""
    batch = concat_trajectories([trajectory_from_response(r, 0.0) for r in resps])
    trainer = TorchTrainEngine(TrainEngineConfig(), ModelConfig(), model=model, trainable=False)
    trainer.initialize()
    out = {}
    for name, b in (("replay", batch), ("no_replay", {k: v for k, v in batch.items() if k != "routed_experts"})):
        logp = trainer.forward(b)
        mask = batch["loss_mask"]
        out[name] = float((logp[mask] - batch["logprobs"][mask]).abs().mean())
    assert trainer._moe is not None
    flips = total = 0
    for r in resps:  # the trainer's own routing of each sequence vs the recorded one
        seq = torch.tensor([r.input_tokens + r.output_tokens[:-1]])
        trainer._moe.ids = None
        with torch.no_grad():
            trainer.model(seq)  # type: ignore[misc]
        own = torch.stack(trainer._moe.chosen, 1).sort(-1).values
        rec = r.routed_experts.long().sort(-1).values  # type: ignore[union-attr]
        flips += int((own != rec).any(-1).sum())
        total += own.shape[0] * own.shape[1]
    out["flip_rate"] = flips / total
    trainer.destroy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--seeds", type=int, default=3, help="models (seeds) per family and dtype")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for family in MOE_OVERRIDES:
        for dtype in (torch.float32, torch.bfloat16):
            runs = [
                gaps(build(family, dtype, seed), generate(build(family, dtype, seed), args.requests, args.new, seed))
                for seed in range(1, args.seeds + 1)
            ]
            res = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
            res["ratio_no_replay_over_replay"] = res["no_replay"] / max(res["replay"], 1e-12)
            results.setdefault(family, {})[str(dtype).removeprefix("torch.")] = res
            print(f"{family:10s} {dtype}: {res}", flush=True)
    bf16 = [results[f]["bfloat16"] for f in results]
    result = {
        "name": "moe_replay",
        "figure": statistics.fmean(r["ratio_no_replay_over_replay"] for r in bf16),
        "figure_desc": "bf16: mean |delta logprob| generator vs trainer without replay / with replay (mean over families)",
        "results": results,
        "settings": {**vars(args), "overrides": MOE_OVERRIDES, "torch": torch.__version__, "device": "cpu"},
    }
    out = Path(__file__).resolve().parent / "results" / "moe_replay.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
