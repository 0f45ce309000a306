"""Generation throughput: LocalEngine vs Hugging Face ``model.generate`` (same model, same run).

Workload (an RL rollout batch): 64 prompts of 8-40 tokens, sampled at temperature 1 with
``top_k=0, top_p=1.0`` (passed explicitly to ``generate``), ``max_new_tokens=128``, ending
at EOS. The tiny models are random, so their next-token distribution is close to uniform
over ~100 tokens; a forward hook adds ``EOS_BIAS`` to the EOS logit of ``lm_head`` (for both
engines) so that P(EOS) is ~1/30 per step and completion lengths are geometric: most end
after a few dozen tokens (mean ~30), and the longest of 64 usually reach the 128 cap -- the long
tail RL rollouts have. The cap keeps both runs' longest rows comparable (each engine draws its
own samples, and an uncapped maximum of 64 geometric lengths varies a lot between runs).

Throughput = generated tokens (up to and including EOS) / wall seconds. ``generate`` keeps
every row in the batch until the longest finishes; LocalEngine drops finished rows at once.
Prints one line per repeat and a JSON object as the last line; writes
``bench/results/generation.json``.

    python bench/generation.py [--repeats 3] [--models tiny,tiny-30m]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.data.models import build_tiny_model
from relayrl.inference.local import LocalEngine

N_PROMPTS = 64
MAX_NEW = 128
EOS_BIAS = 1.25  # exp(1.25) / (exp(1.25) + ~100) ~ 1/30 per step
EOS, PAD = 1, 0


def make_prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(rng.randint(8, 40))] for _ in range(N_PROMPTS)]


def eos_biased_model(preset: str) -> torch.nn.Module:
    model = build_tiny_model(preset, seed=0).eval()
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = EOS_BIAS
    model.lm_head.register_forward_hook(lambda _mod, _inp, out: out + bias)
    return model


def run_generate(model: torch.nn.Module, prompts: list[list[int]], seed: int) -> tuple[int, float, list[int]]:
    length = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (length - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=MAX_NEW,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
    elapsed = time.perf_counter() - start
    lengths = []
    for row in out[:, length:].tolist():
        lengths.append(row.index(EOS) + 1 if EOS in row else len(row))
    return sum(lengths), elapsed, lengths


def run_engine(engine: LocalEngine, prompts: list[list[int]]) -> tuple[int, float, list[int]]:
    g = GenerationConfig(max_new_tokens=MAX_NEW, temperature=1.0, top_k=0, top_p=1.0)

    async def go() -> list[int]:
        resps = await asyncio.gather(*[engine.agenerate(ModelRequest(str(i), p, g)) for i, p in enumerate(prompts)])
        return [r.output_len for r in resps]

    start = time.perf_counter()
    lengths = asyncio.run(go())
    return sum(lengths), time.perf_counter() - start, lengths


def bench_model(preset: str, repeats: int) -> dict[str, object]:
    model = eos_biased_model(preset)
    n_params = sum(p.numel() for p in model.parameters())
    engine = LocalEngine(InferenceConfig(max_batch_size=N_PROMPTS, seed=0), model)
    engine.initialize()
    run_engine(engine, make_prompts(999, model.config.vocab_size)[:8])  # warm-up
    ratios, eng_tps, gen_tps, mean_len = [], [], [], []
    for r in range(repeats):
        prompts = make_prompts(r, model.config.vocab_size)
        g_tok, g_s, g_len = run_generate(model, prompts, seed=r)
        e_tok, e_s, e_len = run_engine(engine, prompts)
        gen_tps.append(g_tok / g_s)
        eng_tps.append(e_tok / e_s)
        ratios.append(eng_tps[-1] / gen_tps[-1])
        mean_len.append((statistics.mean(g_len) + statistics.mean(e_len)) / 2)
        print(
            f"{preset} repeat {r}: generate {g_tok} tok {g_s:.2f}s ({gen_tps[-1]:.0f} tok/s, max len {max(g_len)}) | "
            f"LocalEngine {e_tok} tok {e_s:.2f}s ({eng_tps[-1]:.0f} tok/s, max len {max(e_len)}) | ratio {ratios[-1]:.2f}",
            flush=True,
        )
    engine.destroy()
    return {
        "params": n_params,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratios": [round(x, 3) for x in ratios],
        "engine_tok_s": statistics.median(eng_tps),
        "generate_tok_s": statistics.median(gen_tps),
        "mean_completion_len": statistics.mean(mean_len),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="tiny,tiny-30m")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = {m: bench_model(m, args.repeats) for m in args.models.split(",")}
    summary = {
        "name": "generation",
        "ratio": min(float(r["ratio"]) for r in results.values()),  # type: ignore[arg-type]
        "baseline": "transformers model.generate (sampling, top_k=0, top_p=1.0)",
        "settings": {
            "n_prompts": N_PROMPTS,
            "prompt_len": [8, 40],
            "max_new_tokens": MAX_NEW,
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
            "eos_bias": EOS_BIAS,
            "repeats": args.repeats,
            "torch_threads": 1,
        },
        "models": results,
    }
    out = Path(__file__).parent / "results" / "generation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
