"""Generator–trainer gap by dtype: mean |Δ logprob| (LocalEngine vs the train engine) in fp32, bf16
and fp16 on the tiny HF families, with the ratios against bf16 measured in the same run, and whether
GRPO still learns at each dtype (the count workload, ``grpo_vs_trl``'s settings, 12 steps).

    python bench/mismatch.py [--families llama,gpt2,...] [--no-train] [--device cpu]

Writes ``bench/results/mismatch.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import common
import torch
from families import bf16_gap

from relayrl.data.families import FAMILIES, save_tiny_family

DTYPES = ("float32", "bfloat16", "float16")


def learns(dtype: str, steps: int = 12) -> dict:
    """GRPO on the count workload from its SFT warm start with ``model.dtype=dtype``: the reward curve."""
    ckpt = common.warm_start(workload="count")
    run_dir = common.CACHE / f"mismatch-{dtype}"
    overrides = common.relayrl_overrides(ckpt, run_dir, 0, steps, "count") + [f"model.dtype={dtype}"]
    res = common.in_child(common.run_relayrl, overrides, False)
    curve = [round(r, 3) for r in res["rewards"]]
    gaps = [m.get("mismatch/abs_diff_mean") for m in res["steps"]]
    return {
        "rewards": curve,
        "first_3": round(statistics.fmean(curve[:3]), 3),
        "last_5": round(common.tail_mean(curve), 3),
        "mismatch_abs_diff_mean": [None if g is None else round(g, 5) for g in gaps],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated tiny families")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-train", action="store_true", help="skip the learning check")
    args = ap.parse_args()
    torch.set_num_threads(1)
    gaps: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families.split(","):
            path = str(save_tiny_family(name, Path(tmp) / name, seed=1))
            gaps[name] = {d: bf16_gap(path, args.device, dtype=d) for d in DTYPES}
            print(name, {d: f"{v:.2e}" for d, v in gaps[name].items()}, flush=True)
    mean = {d: statistics.fmean(g[d] for g in gaps.values()) for d in DTYPES}
    result = {
        "name": "mismatch",
        "figure": mean["bfloat16"] / mean["float16"],
        "figure_desc": "mean |Δ logprob| bf16 / fp16 (LocalEngine vs train engine, tiny families): how many times "
        "fp16 cuts the bf16 gap",
        "mean_abs_diff": mean,
        "device": args.device,
        "families": gaps,
    }
    if not args.no_train:
        result["learns"] = {d: learns(d) for d in DTYPES}
        print(result["learns"], flush=True)
    common.write_result(result)


if __name__ == "__main__":
    main()
