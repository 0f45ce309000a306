"""Generator–trainer gap by dtype: mean |Δ logprob| (LocalEngine vs the train engine) in fp32, bf16
and fp16 on the tiny HF families, with the ratios against bf16 measured in the same run, and whether
GRPO still learns at each dtype.

The gap: LocalEngine samples in the dtype and the train engine rescores the tokens in the same dtype
(the run's gap) and in fp32 (what rounding to the dtype alone moves the generator's logprobs).

The learning check: ``recipes/algorithms/grpo.yaml`` from the shipped warm start
(``tests/data/demo_sft``, the demo's SFT model on 2-digit addition, where GRPO does learn) with
``model.dtype`` set, ``--steps`` steps; held-out sampled accuracy (4 samples at temperature 1 on
``--eval-prompts`` held-out prompts, generated in the run's dtype) before and after, the reward
curve, the logged gap and the wall time.

    python bench/mismatch.py [--families llama,gpt2,...] [--no-train] [--steps 30] [--device cpu]

Writes ``bench/results/mismatch.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import common
import torch
from families import dtype_gaps

from relayrl.data.families import FAMILIES, save_tiny_family

DTYPES = ("float32", "bfloat16", "float16")
RECIPE = common.ROOT / "recipes" / "algorithms" / "grpo.yaml"
WARM = common.ROOT / "tests" / "data" / "demo_sft"


def _train(overrides: list[str]) -> float:
    """One run of the recipe with ``overrides`` (in a child process); its wall seconds."""
    from relayrl.api.config import RunConfig, load_config
    from relayrl.trainer import train

    torch.set_num_threads(1)
    t0 = time.monotonic()
    train(load_config(RunConfig, RECIPE, overrides))
    return time.monotonic() - t0


def learns(dtype: str, steps: int, eval_prompts: int) -> dict:
    """GRPO (the recipe) from the demo's warm start with ``model.dtype=dtype``: held-out sampled
    accuracy before and after ``steps`` steps, the reward curve and the logged gap."""
    run_dir = common.CACHE / f"mismatch-{dtype}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resumed one
    overrides = [
        f"run_dir={run_dir}",
        f"model.path={WARM}",
        f"model.dtype={dtype}",
        f"total_steps={steps}",
        f"eval.every_n_steps={steps}",
        f"eval.max_prompts={eval_prompts}",
        "logging.tensorboard=false",
        "logging.progress=off",
        "logging.doctor_every=0",
        "logging.rollouts_per_step=0",
        "checkpoint.save_final=false",
    ]
    seconds = common.in_child(_train, overrides)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    acc = [(r["step"], r["eval/accuracy_mean"]) for r in rows if "eval/accuracy_mean" in r]
    curve = [round(r["rollout/reward"], 3) for r in rows if "rollout/reward" in r]
    gaps = [r["mismatch/abs_diff_mean"] for r in rows if "mismatch/abs_diff_mean" in r]
    (step0, before), (step1, after) = acc[0], acc[-1]
    return {
        "held_out_accuracy_before": round(before, 4),
        "held_out_accuracy_after": round(after, 4),
        "eval_steps": [step0, step1],
        "rise": round(after - before, 4),
        "rewards": curve,
        "reward_first_5": round(statistics.fmean(curve[:5]), 3),
        "reward_last_5": round(common.tail_mean(curve), 3),
        "mismatch_abs_diff_mean": statistics.fmean(gaps),
        "mismatch_abs_diff_max": max(r["mismatch/abs_diff_max"] for r in rows if "mismatch/abs_diff_max" in r),
        "skipped_steps": sum(r.get("actor/skipped_steps", 0.0) for r in rows),
        "seconds": round(seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated tiny families")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-train", action="store_true", help="skip the learning check")
    ap.add_argument("--steps", type=int, default=30, help="GRPO steps of the learning check")
    ap.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts of the learning check")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="dtypes of the learning check")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.monotonic()
    gaps: dict[str, dict[str, float]] = {}
    vs_fp32: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families.split(","):
            path = str(save_tiny_family(name, Path(tmp) / name, seed=1))
            both = {d: dtype_gaps(path, args.device, dtype=d) for d in DTYPES}
            gaps[name] = {d: both[d][d] for d in DTYPES}
            vs_fp32[name] = {d: both[d]["float32"] for d in DTYPES if d != "float32"}
            print(name, {d: f"{v:.2e}" for d, v in gaps[name].items()}, "vs fp32", vs_fp32[name], flush=True)
    mean = {d: statistics.fmean(g[d] for g in gaps.values()) for d in DTYPES}
    ratios = [g["bfloat16"] / g["float16"] for g in gaps.values()]
    result = {
        "name": "mismatch",
        "figure": mean["bfloat16"] / mean["float16"],
        "figure_desc": "mean |Δ logprob| bf16 / fp16 (LocalEngine vs train engine, tiny families): how many times "
        "fp16 cuts the bf16 gap",
        "mean_abs_diff": mean,
        "median_ratio_bf16_fp16": statistics.median(ratios),
        "mean_abs_diff_vs_fp32_trainer": {d: statistics.fmean(v[d] for v in vs_fp32.values()) for d in DTYPES[1:]},
        "device": args.device,
        "families": gaps,
        "families_vs_fp32_trainer": vs_fp32,
        "gap_seconds": round(time.monotonic() - t0, 1),
    }
    if not args.no_train:
        result["learns_setup"] = {
            "recipe": str(RECIPE.relative_to(common.ROOT)),
            "warm_start": str(WARM.relative_to(common.ROOT)),
            "steps": args.steps,
            "eval_prompts": args.eval_prompts,
            "eval": "held-out sampled accuracy, 4 samples per prompt at temperature 1, in the run's dtype",
        }
        result["learns"] = {}
        for d in args.dtypes.split(","):
            result["learns"][d] = learns(d, args.steps, args.eval_prompts)
            print(d, result["learns"][d], flush=True)
    result["seconds"] = round(time.monotonic() - t0, 1)
    common.write_result(result)


if __name__ == "__main__":
    main()
