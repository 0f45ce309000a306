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

``--model DIR`` measures a real chat model instead (e.g. SmolLM2-135M-Instruct; writes
``bench/results/generation_<name>.json``): 64 chat prompts (the ``arithmetic`` and ``count`` tasks'
user turns, half each, through the model's chat template with the generation prompt), the same
sampling, no EOS bias; both sides stop on the model's generation-config EOS ids (SmolLM2:
``<|im_end|>``), which must hold the token the chat template ends an assistant turn with. The
result records how many completions of each side end on that token (the rest hit the cap), and a
check that ``generate``'s processed scores equal the raw logits (no top-k / top-p warper applied:
transformers' default ``top_k=50`` must not apply).

    python bench/generation.py --model ~/.cache/relayrl/models/smollm2-135m-instruct --repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py

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


def _left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (length - len(p)) + p for p in prompts])
    return ids, torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])


def _sample(model: torch.nn.Module, prompts: list[list[int]], eos: int | list[int], pad: int, n: int, **extra):
    """HF ``generate`` sampling from the raw logits (temperature 1, no top-k / top-p) on the left-padded batch."""
    ids, mask = _left_padded(prompts, pad)
    return model.generate(  # type: ignore[operator]
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=n,
        eos_token_id=eos,
        pad_token_id=pad,
        **extra,
    )


def run_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    seed: int,
    eos: int | list[int] = EOS,
    pad: int = PAD,
    last: list | None = None,
) -> tuple[int, float, list[int]]:
    """HF ``generate`` on the left-padded batch; (tokens up to and including the first stop token, seconds,
    lengths). ``last``: filled with each completion's last token."""
    stops = {eos} if isinstance(eos, int) else set(eos)
    length = max(len(p) for p in prompts)
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = _sample(model, prompts, eos, pad, MAX_NEW)
    elapsed = time.perf_counter() - start
    lengths = []
    for row in out[:, length:].tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        lengths.append(n)
        if last is not None:
            last.append(row[n - 1])
    return sum(lengths), elapsed, lengths


def run_engine(engine: LocalEngine, prompts: list[list[int]], last: list | None = None) -> tuple[int, float, list[int]]:
    g = GenerationConfig(max_new_tokens=MAX_NEW, temperature=1.0, top_k=0, top_p=1.0)

    async def go() -> list:
        return await asyncio.gather(*[engine.agenerate(ModelRequest(str(i), p, g)) for i, p in enumerate(prompts)])

    start = time.perf_counter()
    resps = asyncio.run(go())
    elapsed = time.perf_counter() - start
    if last is not None:
        last.extend(r.output_tokens[-1] for r in resps)
    lengths = [r.output_len for r in resps]
    return sum(lengths), elapsed, lengths


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


def chat_prompts(tokenizer, seed: int) -> list[list[int]]:  # noqa: ANN001
    """64 chat prompts: the user turns of the arithmetic and count tasks (half each, in a seeded order),
    through the model's chat template with the generation prompt."""
    from relayrl.data.tasks import make_task

    rows = make_task("arithmetic", 0, N_PROMPTS // 2, 2, seed)[1] + make_task("count", 0, N_PROMPTS // 2, 2, seed)[1]
    random.Random(seed).shuffle(rows)
    texts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in rows]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def no_warper_applied(model: torch.nn.Module, prompts: list[list[int]], eos: list[int], pad: int) -> bool:
    """True when ``generate`` (with this benchmark's arguments) samples from the raw logits / temperature:
    its processed scores equal its raw logits at every step (a top-k / top-p warper would put -inf there)."""
    with torch.inference_mode():
        out = _sample(model, prompts, eos, pad, 4, output_scores=True, output_logits=True, return_dict_in_generate=True)
    return all(
        torch.equal(s, raw) and bool(torch.isfinite(s).all()) for s, raw in zip(out.scores, out.logits, strict=True)
    )


def bench_real(model_dir: str, repeats: int) -> dict[str, object]:
    """LocalEngine vs ``generate`` on a real chat model (see the module doc)."""
    import common
    from transformers import AutoModelForCausalLM

    from relayrl.api.config import ModelConfig
    from relayrl.data.models import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(ModelConfig(path=model_dir))
    stops = common.stop_token_ids(model, tokenizer)
    eot = common.end_of_turn_id(tokenizer)
    if eot not in stops:
        raise RuntimeError(f"the chat template ends a turn with token {eot}, the model stops on {stops}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    engine = LocalEngine(InferenceConfig(max_batch_size=N_PROMPTS, seed=0), model, tokenizer=tokenizer)
    engine.initialize()
    if sorted(engine.eos_ids) != stops:
        raise RuntimeError(f"LocalEngine stops on {sorted(engine.eos_ids)}, generate on {stops}")
    unwarped = no_warper_applied(model, chat_prompts(tokenizer, 999)[:4], stops, pad)
    run_engine(engine, chat_prompts(tokenizer, 999)[:8])  # warm-up
    ratios, eng_tps, gen_tps, runs = [], [], [], []
    for r in range(repeats):
        prompts = chat_prompts(tokenizer, r)
        g_last: list[int] = []
        e_last: list[int] = []
        c0 = time.process_time()  # CPU seconds of the process (all threads: the engine's loop runs on its own)
        g_tok, g_s, g_len = run_generate(model, prompts, seed=r, eos=stops, pad=pad, last=g_last)
        c1 = time.process_time()
        e_tok, e_s, e_len = run_engine(engine, prompts, last=e_last)
        c2 = time.process_time()
        gen_tps.append(g_tok / g_s)
        eng_tps.append(e_tok / e_s)
        ratios.append(eng_tps[-1] / gen_tps[-1])
        runs.append(
            {
                "generate": {
                    "tokens": g_tok,
                    "seconds": round(g_s, 2),
                    "cpu_seconds": round(c1 - c0, 2),
                    "mean_len": round(statistics.mean(g_len), 1),
                },
                "engine": {
                    "tokens": e_tok,
                    "seconds": round(e_s, 2),
                    "cpu_seconds": round(c2 - c1, 2),
                    "mean_len": round(statistics.mean(e_len), 1),
                },
                "ratio_cpu": round((e_tok / (c2 - c1)) / (g_tok / (c1 - c0)), 3),
                # what dropping finished rows alone can win on generate's own samples, at a constant cost per row
                # step: the row-steps generate runs (every row until the longest ends) / the tokens it keeps
                "drop_finished_rows_ceiling": round(len(g_len) * max(g_len) / g_tok, 3),
                # a completion ends where the template ends a turn (its last token), else it hit the cap
                "ended_on_end_of_turn": {
                    "generate": sum(t == eot for t in g_last),
                    "engine": sum(t == eot for t in e_last),
                },
                "hit_cap": {
                    "generate": sum(n == MAX_NEW and t != eot for n, t in zip(g_len, g_last, strict=True)),
                    "engine": sum(n == MAX_NEW and t != eot for n, t in zip(e_len, e_last, strict=True)),
                },
                "ended_otherwise": {
                    "generate": sum(n < MAX_NEW and t != eot for n, t in zip(g_len, g_last, strict=True)),
                    "engine": sum(n < MAX_NEW and t != eot for n, t in zip(e_len, e_last, strict=True)),
                },
            }
        )
        print(
            f"{model_dir} repeat {r}: generate {g_tok} tok {g_s:.2f}s ({gen_tps[-1]:.1f} tok/s) | LocalEngine {e_tok} "
            f"tok {e_s:.2f}s ({eng_tps[-1]:.1f} tok/s) | ratio {ratios[-1]:.2f} | {runs[-1]}",
            flush=True,
        )
    engine.destroy()
    return {
        "name": "generation_" + Path(model_dir).name.split("-")[0],
        "model": model_dir,
        "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "ratios": [round(x, 3) for x in ratios],
        "ratio_cpu": round(statistics.median(x["ratio_cpu"] for x in runs), 3),
        "drop_finished_rows_ceiling": round(statistics.median(x["drop_finished_rows_ceiling"] for x in runs), 3),
        "goal": ">= 2",
        "engine_tok_s": round(statistics.median(eng_tps), 1),
        "generate_tok_s": round(statistics.median(gen_tps), 1),
        "stop_token_ids": stops,
        "end_of_turn_id": eot,
        "generate_samples_raw_logits": unwarped,
        "runs": runs,
        "baseline": "transformers model.generate (sampling, temperature 1, top_k=0, top_p=1.0, eos = the model's)",
        "settings": {
            "n_prompts": N_PROMPTS,
            "prompts": "chat: arithmetic + count task user turns, the model's chat template",
            "max_new_tokens": MAX_NEW,
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
            "repeats": repeats,
            "torch_threads": 1,
            "machine": "2 CPU cores shared with other jobs",
            "cpu": common.cpu_model(),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="tiny,tiny-30m")
    ap.add_argument("--model", default="", help="a real chat model directory instead (see the module doc)")
    ap.add_argument("--out", default="", help="--model: the result file (default bench/results/generation_<name>.json)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.model:
        res = bench_real(args.model, args.repeats)
        out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"{res['name']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res))
        return
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
