"""Any HF causal LM in bf16: how far LocalEngine's logprobs are from the train engine's.

For each tiny family checkpoint of ``relayrl.data.families`` (saved and reloaded as a directory,
weights in bf16), LocalEngine samples 4 completions of 24 tokens at temperature 1 and the train
engine (``TorchTrainEngine``, bf16 weights, packed varlen attention) recomputes their logprobs;
the figure is the mean |delta logprob| over generated tokens (fp32: ~1e-6). Runs on CPU (or
``--device cuda``); writes ``bench/results/families.json``.

    python bench/families.py [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/x.py` from the repo root

from relayrl.api.config import InferenceConfig, ModelConfig, TrainEngineConfig  # noqa: E402
from relayrl.api.io import GenerationConfig, ModelRequest  # noqa: E402
from relayrl.data.families import FAMILIES, save_tiny_family  # noqa: E402
from relayrl.data.models import load_model  # noqa: E402
from relayrl.inference.local import LocalEngine  # noqa: E402
from relayrl.train.engine import TorchTrainEngine  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 50)), [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


def bf16_gap(path: str, device: str = "cpu", new: int = 24, dtype: str = "bfloat16") -> float:
    """Mean |LocalEngine logprob - train engine logprob| over generated tokens, both in ``dtype`` (bf16)."""
    return dtype_gaps(path, device, new, dtype)[dtype]


def dtype_gaps(path: str, device: str = "cpu", new: int = 24, dtype: str = "bfloat16") -> dict[str, float]:
    """Mean |LocalEngine logprob - train engine logprob| over the tokens LocalEngine generates in
    ``dtype``, with the train engine in ``dtype`` (the run's gap) and in float32 (what rounding
    to ``dtype`` alone changes): ``{dtype: gap, "float32": gap}``."""
    mc = ModelConfig(path=path, dtype=dtype)
    engine = LocalEngine(InferenceConfig(device=device, admit_window_ms=0, seed=3), load_model(mc))
    engine.initialize()
    g = GenerationConfig(max_new_tokens=new, temperature=1.0, ignore_eos=True)

    async def go():
        return await asyncio.gather(
            *[engine.agenerate(ModelRequest(rid=str(i), input_ids=p, gconfig=g)) for i, p in enumerate(PROMPTS)]
        )

    try:
        resps = asyncio.run(go())
    finally:
        engine.destroy()
    seqs = [r.input_tokens + r.output_tokens for r in resps]
    width = max(len(s) for s in seqs)
    batch = {
        "input_ids": torch.tensor([s + [0] * (width - len(s)) for s in seqs]),
        "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs]),
    }
    out = {}
    for trainer_dtype in dict.fromkeys((dtype, "float32")):
        trainer = TorchTrainEngine(TrainEngineConfig(), ModelConfig(path=path, dtype=trainer_dtype), trainable=False)
        trainer.initialize()
        logp = trainer.forward(batch)
        out[trainer_dtype] = statistics.fmean(
            abs(float(logp[i, len(r.input_tokens) + t]) - lp)
            for i, r in enumerate(resps)
            for t, lp in enumerate(r.output_logprobs)
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    gaps = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in FAMILIES:
            gaps[name] = bf16_gap(str(save_tiny_family(name, Path(tmp) / name, seed=1)), args.device)
            print(f"{name:12s} mean |delta logprob| bf16 = {gaps[name]:.4f}", flush=True)
    result = {
        "name": "families",
        "figure": 1e3 * statistics.fmean(gaps.values()),
        "figure_desc": "1e3 x mean |delta logprob| LocalEngine vs train engine, bf16, over 12 tiny HF families",
        "device": args.device,
        "models": gaps,
    }
    out = Path(__file__).resolve().parent / "results" / "families.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
