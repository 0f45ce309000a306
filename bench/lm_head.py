"""The LM-head fast path (relayrl.train.lmhead, issue #37): one update step's CPU time and peak RSS
with full ``[T, V]`` logits against logprobs/entropies computed only at loss positions.

A Llama-shaped model built from a config in code (SmolLM2-135M's widths: vocab 49,152, hidden 576,
intermediate 1536, 9 heads / 3 KV heads, tied embeddings; ``--layers`` of them, 4 by default),
one packed micro-batch of 64 sequences x (36 prompt + 8 completion) = 2,816 tokens, 18% loss tokens,
one torch thread. Each mode runs in its own process (peak RSS is per process), ``--steps`` timed
train_batch steps after one warm-up; CPU time from ``resource.getrusage``. ``--model DIR`` measures a
real checkpoint instead (e.g. the directory ``relayrl models pull smollm2-135m-instruct`` prints).

    python bench/lm_head.py            # writes bench/results/lm_head.json

``--shared-prefix`` (issue #37): the 64 rows are 8 GRPO groups of 8 samples sharing their 36-token
prompt, and the fast path runs with ``train.shared_prefix`` off ("fast") and auto ("shared": each
group's prompt computed once, ``relayrl.train.prefix``); writes bench/results/shared_prefix.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = Path(__file__).resolve().parent / "results" / "lm_head.json"
OUT_SHARED = OUT.with_name("shared_prefix.json")
GROUP = 8  # --shared-prefix: samples per prompt


def child(mode: str, layers: int, steps: int, model_dir: str | None, shared_prompts: bool = False) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from relayrl.api.config import ModelConfig, TrainEngineConfig
    from relayrl.train.engine import TorchTrainEngine
    from relayrl.train.lmhead import token_stats_loss
    from relayrl.train.packing import pack, token_entropy, token_logprobs
    from relayrl.train.prefix import shared_layout

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if model_dir:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        cfg = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=layers,
            num_attention_heads=9,
            num_key_value_heads=3,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
        )
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    vocab = model.config.vocab_size
    config = TrainEngineConfig(mb_max_tokens=4096, shared_prefix="auto" if mode == "shared" else "off")
    engine = TorchTrainEngine(config, ModelConfig(path="bench"), model=model)
    engine.initialize()
    n, prompt, comp = 64, 36, 8
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n, prompt + comp), generator=g)
    if shared_prompts:  # groups of GROUP rows share their prompt
        ids[:, :prompt] = ids[::GROUP, :prompt].repeat_interleave(GROUP, 0)
    loss_mask = torch.zeros(n, prompt + comp, dtype=torch.bool)
    loss_mask[:, prompt:] = True
    adv = torch.randn(n, generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool), "loss_mask": loss_mask}

    def loss_fn(logits, packed):  # the actor's shape: logprobs with grad, entropy without
        logp = token_logprobs(logits, packed)
        with torch.no_grad():
            ent = token_entropy(logits.detach(), packed)
        mask = packed["loss_mask"].bool()
        seq = torch.repeat_interleave(torch.arange(len(packed["cu_seqlens"]) - 1), packed["cu_seqlens"].diff().long())
        loss = torch.where(mask, -logp * adv[packed["batch_row"]][seq] if "batch_row" in packed else -logp, 0.0)
        return loss.sum() / mask.sum() + 0.0 * ent.sum()

    fn = loss_fn if mode == "full" else token_stats_loss(loss_fn)
    layout = shared_layout(pack(batch))  # what the shared mode's one micro-batch computes
    weight = lambda p: float(p["loss_mask"].sum())  # noqa: E731
    engine.train_batch(batch, fn, weight)  # warm-up
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        stats = engine.train_batch(batch, fn, weight)
    r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / steps
    return {
        "cpu_s_per_step": round(cpu, 3),
        "wall_s_per_step": round((w1 - w0) / steps, 3),
        "peak_rss_mb": round(r1.ru_maxrss / 1024, 1),
        "peak_rss_mb_after_warmup_step": round(rss_before / 1024, 1),
        "tokens": int(ids.numel()),
        "loss_tokens": int(loss_mask.sum()),
        "computed_tokens": int(ids.numel()) - (layout.saved if mode == "shared" and layout is not None else 0),
        "loss": round(float(stats["loss"]), 6),
        "grad_norm": round(float(stats["grad_norm"]), 6),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--model", default=None, help="a real HF model directory instead of the config-built one")
    ap.add_argument("--out", default=None, help="default: bench/results/lm_head.json (shared_prefix.json)")
    ap.add_argument("--shared-prefix", action="store_true", help="8 groups of 8 rows sharing a prompt: fast vs shared")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.layers, a.steps, a.model, a.shared_prefix)))
        return
    a.out = a.out or str(OUT_SHARED if a.shared_prefix else OUT)
    modes = ("fast", "shared") if a.shared_prefix else ("full", "fast")
    res: dict[str, object] = {
        "name": Path(a.out).stem,  # lm_head, or lm_head_smollm2 with --model and that --out
        "model": a.model or f"llama-shaped from config: vocab 49152, hidden 576, {a.layers} layers, tied",
        "threads": 1,
        "steps": a.steps,
    }
    for mode in modes:
        cmd = [sys.executable, __file__, "--child", mode, "--layers", str(a.layers), "--steps", str(a.steps)]
        cmd += ["--model", a.model] if a.model else []
        cmd += ["--shared-prefix"] if a.shared_prefix else []
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        res[mode] = json.loads(out.strip().splitlines()[-1])
        print(mode, res[mode], flush=True)
    full, fast = res[modes[0]], res[modes[1]]
    assert isinstance(full, dict) and isinstance(fast, dict)
    res["cpu_speedup"] = round(full["cpu_s_per_step"] / fast["cpu_s_per_step"], 3)
    res["ratio"] = res["cpu_speedup"]  # the headline (bench/run_all.py's table): full ÷ fast CPU per update step
    res["peak_rss_ratio"] = round(fast["peak_rss_mb"] / full["peak_rss_mb"], 3)
    flags = (["--model", "DIR"] if a.model else []) + (["--shared-prefix"] if a.shared_prefix else [])
    res["command"] = " ".join(
        ["python bench/lm_head.py", *flags, "--steps", str(a.steps), "--out", os.path.relpath(a.out, ROOT)]
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("cpu_speedup", "peak_rss_ratio")}))


if __name__ == "__main__":
    main()
