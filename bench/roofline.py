"""Training roofline on CPU: one train step's achieved FLOP/s against ``torch.mm``'s peak on this machine.

Issue #37 ("fast on real models"): how close does one update step come to what this CPU's matmuls
can do? The workload is ``bench/lm_head.py``'s token budget: 64 rows of one GRPO batch, prompts of
28-44 tokens (mean 36; varied so per-document lengths are real) + 8 completion tokens = ~2,816
tokens, the 8 completion tokens carry the loss. One torch thread (as the trainer runs).

Sides (each in its own process, so each peak RSS is its own; one warm-up step, then ``--steps``
timed steps):

- ``relayrl``: ``TorchTrainEngine.train_batch`` with the actor's default loss
  (``PPOActor(ActorConfig())``'s loss fn, what ``ppo_update`` hands ``train_batch`` per
  mini-batch): packed documents, per-document attention, the LM head only at loss positions
  (``relayrl.train.lmhead``; each chunk is checkpointed, so its forward runs twice).
- ``hf``: the plain Hugging Face way with the same tokens: left-padded prompts, right-aligned
  completions (TRL's layout), one padded ``[64, L_max]`` forward with SDPA and
  ``logits_to_keep = completion + 1`` (as TRL), the same PPO-clip token-mean loss, entropy
  without grad, backward, grad clip 1, AdamW.

FLOPs counted (per side, what it actually computes): 2·m·n·k per matmul over the attention
projections and the MLP at every position it runs (padded ones included for ``hf``), attention
scores and values over each document's real length (causal: n(n+1)/2 query-key pairs per head; a
~1% term here), the LM head at the positions where it is computed (``relayrl``: the loss positions;
``hf``: the last 9 of every row); forward + backward = 3 x forward (relayrl's checkpointed LM head:
4x). ``useful`` FLOPs count real tokens only; the headline is useful FLOP/s ÷ peak.

Rates are FLOPs per CPU second of the one thread (its wall-clock rate is recorded too; on the shared
machine other jobs' threads take turns on the cores, so wall time runs ahead of CPU time).

Peak: ``torch.mm`` on one thread at the model's own matmul shapes (the projections, MLP and LM head
at this micro-batch's token count, and their backward transposes), best of a few repeats, measured in
this same run before and after the sides (the machine may be shared: both are recorded, the higher
is the peak).

Models: ``--model DIR`` (e.g. SmolLM2-135M-Instruct) or ``--config qwen0.5b`` (Qwen2.5-0.5B's shapes
built in code: hidden 896, 14 heads / 2 KV heads, intermediate 4864, vocab 151,936, tied embeddings;
``--layers`` of its 24, random weights) or ``--config tiny`` (the smoke test's).

    python bench/roofline.py --model ~/.cache/relayrl/models/smollm2-135m-instruct
    python bench/roofline.py --config qwen0.5b --layers 6
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results"
ROWS, PROMPT_MIN, PROMPT_MAX, COMPLETION = 64, 28, 44, 8
CONFIGS = {
    # Qwen2.5-0.5B's shapes (24 layers in the real model)
    "qwen0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        num_hidden_layers=24,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
}


def build_model(model_dir: str | None, config: str | None, layers: int):  # noqa: ANN201
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if model_dir:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    kw = dict(CONFIGS[config])
    if layers:
        kw["num_hidden_layers"] = layers
    cfg = AutoConfig.for_model(kw.pop("model_type"), max_position_embeddings=2048, **kw)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def shapes(cfg) -> dict[str, int]:  # noqa: ANN001
    t = cfg.get_text_config()
    hd = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    return {
        "h": t.hidden_size,
        "layers": t.num_hidden_layers,
        "heads": t.num_attention_heads,
        "kv_heads": t.num_key_value_heads,
        "head_dim": hd,
        "inter": t.intermediate_size,
        "vocab": t.vocab_size,
    }


def prompt_lengths() -> list[int]:
    """64 prompt lengths spread evenly over 28..44 (symmetric: mean 36), in a fixed shuffled order."""
    import random

    lens = [PROMPT_MIN + round(i * (PROMPT_MAX - PROMPT_MIN) / (ROWS - 1)) for i in range(ROWS)]
    random.Random(0).shuffle(lens)
    return lens


def count_flops(s: dict[str, int], positions: int, doc_lens: list[int], head_positions: int, head_mult: int) -> float:
    """Forward+backward FLOPs: matmuls at ``positions`` tokens, causal attention over ``doc_lens``, the
    LM head at ``head_positions`` (x ``head_mult``: 3, or 4 when its forward is recomputed)."""
    h, q, kv, inter = s["h"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["inter"]
    per_token = 2 * h * q + 2 * 2 * h * kv + 2 * q * h + 3 * 2 * h * inter
    attn = sum(2 * 2 * s["heads"] * s["head_dim"] * n * (n + 1) // 2 for n in doc_lens)
    body = s["layers"] * (positions * per_token + attn)
    return 3.0 * body + head_mult * head_positions * 2.0 * h * s["vocab"]


def peak_mm(s: dict[str, int], tokens: int, head_rows: int, repeats: int = 3) -> dict[str, float]:
    """GFLOP per CPU second of one-thread ``torch.mm`` at each of the model's matmul shapes (best of
    ``repeats``; CPU time, not wall: on the shared machine a descheduled thread is not a slower CPU)."""
    import torch

    torch.set_num_threads(1)
    h, q, kv, inter, v = s["h"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["inter"], s["vocab"]
    cases = {
        "q/o proj [T,h]x[h,q]": (tokens, h, q),
        "k/v proj [T,h]x[h,kv]": (tokens, h, kv),
        "mlp up [T,h]x[h,I]": (tokens, h, inter),
        "mlp down [T,I]x[I,h]": (tokens, inter, h),
        "weight grad [I,T]x[T,h]": (inter, tokens, h),
        "lm head [N,h]x[h,V]": (head_rows, h, v),
    }
    out = {}
    for name, (m, k, n) in cases.items():
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            torch.mm(a, b)
            best = min(best, time.process_time() - t0)
        out[name] = round(2 * m * k * n / best / 1e9, 2)
    return out


def make_batch(vocab: int):  # noqa: ANN201
    """Right-padded rows (prompt + completion), loss on the completion, old logprobs and advantages."""
    import torch

    g = torch.Generator().manual_seed(0)
    lens = [p + COMPLETION for p in prompt_lengths()]
    width = max(lens)
    ids = torch.zeros(ROWS, width, dtype=torch.long)
    attn = torch.zeros(ROWS, width, dtype=torch.bool)
    loss = torch.zeros(ROWS, width, dtype=torch.bool)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=g)
        attn[i, :n] = True
        loss[i, n - COMPLETION : n] = True
    adv = torch.randn(ROWS, 1, generator=g).expand(ROWS, width).contiguous() * loss
    old = (-2.0 - torch.rand(ROWS, width, generator=g)) * loss  # plausible logprobs of the sampled tokens
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss,
        "logprobs": old,
        "old_logp": old,
        "advantages": adv,
    }


def child(side: str, model_dir: str | None, config: str | None, layers: int, steps: int) -> dict:
    import common
    import torch

    torch.set_num_threads(1)
    model = build_model(model_dir, config, layers)
    s = shapes(model.config)
    batch = make_batch(s["vocab"])
    lens = batch["attention_mask"].sum(1).tolist()
    real = int(sum(lens))
    if side == "relayrl":
        from relayrl.api.config import ActorConfig, ModelConfig, TrainEngineConfig
        from relayrl.train.actor import PPOActor, _StatsSink
        from relayrl.train.engine import TorchTrainEngine

        engine = TorchTrainEngine(TrainEngineConfig(mb_max_tokens=4096), ModelConfig(path="bench"), model=model)
        engine.initialize()
        actor = PPOActor(ActorConfig(), engine)
        rows = {**batch, "batch_row": torch.arange(ROWS)}

        def step() -> float:  # what PPOActor.ppo_update does per mini-batch
            engine.train()
            return float(engine.train_batch(rows, actor._loss_fn(_StatsSink()), actor.loss_weight)["loss"])

        positions, head_positions, head_mult = real, int(batch["loss_mask"].sum()), 4
    else:
        # TRL's layout: prompts left-padded to the longest, completions right after them
        p_lens = [n - COMPLETION for n in lens]
        width = max(p_lens) + COMPLETION
        ids = torch.zeros(ROWS, width, dtype=torch.long)
        mask = torch.zeros(ROWS, width, dtype=torch.long)
        old = torch.zeros(ROWS, COMPLETION)
        adv = torch.zeros(ROWS, 1)
        for i, n in enumerate(lens):
            ids[i, width - n :] = batch["input_ids"][i, :n]
            mask[i, width - n :] = 1
            old[i] = batch["logprobs"][i, n - COMPLETION : n]
            adv[i] = batch["advantages"][i, n - 1]
        completion = ids[:, -COMPLETION:]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        model.train()

        def step() -> float:
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=COMPLETION + 1).logits[:, :-1]
            logp_all = logits.float().log_softmax(-1)
            logp = logp_all.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
            with torch.no_grad():
                (-(logp_all.exp() * logp_all).sum(-1)).mean()  # entropy, as the actor logs it
            ratio = (logp - old).exp()
            loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
            loss = loss.mean()  # token mean: every completion token is a loss token
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss)

        positions, head_positions, head_mult = ROWS * width, ROWS * (COMPLETION + 1), 3
    step()  # warm-up (allocations, optimizer state)
    t0, c0 = time.perf_counter(), common.cpu_seconds()
    for _ in range(steps):
        loss = step()
    wall, cpu = (time.perf_counter() - t0) / steps, (common.cpu_seconds() - c0) / steps
    flops = count_flops(s, positions, lens, head_positions, head_mult)
    useful = count_flops(s, real, lens, head_positions, head_mult)
    return {
        "wall_s_per_step": round(wall, 3),
        "cpu_s_per_step": round(cpu, 3),
        "tokens": real,
        "positions_computed": positions,
        "lm_head_positions": head_positions,
        "gflop_per_step": round(flops / 1e9, 1),
        "useful_gflop_per_step": round(useful / 1e9, 1),
        # per CPU second (the headline: one thread, on a machine shared with other jobs) and per wall second
        "gflop_s": round(flops / cpu / 1e9, 2),
        "useful_gflop_s": round(useful / cpu / 1e9, 2),
        "gflop_per_wall_s": round(flops / wall / 1e9, 2),
        "loss": round(loss, 6),
        "peak_rss_mb": common.peak_rss_mb(),
        "params": sum(p.numel() for p in model.parameters()),
        "shapes": s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="an HF model directory (e.g. SmolLM2-135M-Instruct)")
    src.add_argument("--config", default=None, choices=sorted(CONFIGS), help="a config built in code")
    ap.add_argument("--layers", type=int, default=0, help="--config: decoder layers (0: the config's)")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per side, after one warm-up step")
    ap.add_argument("--sides", default="relayrl,hf")
    ap.add_argument("--out", default="", help="result file (default bench/results/roofline_<model>.json)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.model and not a.config:
        a.config = "qwen0.5b"
    if a.child:
        print(json.dumps(child(a.child, a.model, a.config, a.layers, a.steps)))
        return
    from transformers import AutoConfig

    if a.model:
        tag, cfg = Path(a.model).name.split("-")[0], AutoConfig.from_pretrained(a.model)
        layers_note = f"{a.model} (real weights)"
    else:
        tag = a.config.replace(".", "_") + (f"_{a.layers}l" if a.layers else "")
        kw = {**CONFIGS[a.config], **({"num_hidden_layers": a.layers} if a.layers else {})}
        cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
        layers_note = f"{a.config} shapes built in code, {cfg.num_hidden_layers} layers, random weights"
    s = shapes(cfg)
    tokens = sum(p + COMPLETION for p in prompt_lengths())
    head_rows = ROWS * COMPLETION
    print(f"peak: torch.mm at {s} ...", flush=True)
    before = peak_mm(s, tokens, head_rows)
    print("peak GFLOP/s before:", before, flush=True)
    res: dict = {"name": f"roofline_{tag}", "model": layers_note, "threads": 1, "steps": a.steps, "shapes": s}
    for side in a.sides.split(","):
        cmd = [sys.executable, __file__, "--child", side, "--steps", str(a.steps), "--layers", str(a.layers)]
        cmd += ["--model", a.model] if a.model else ["--config", a.config]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        res[side] = json.loads(out.strip().splitlines()[-1])
        print(side, {k: v for k, v in res[side].items() if k != "shapes"}, flush=True)
    after = peak_mm(s, tokens, head_rows)
    print("peak GFLOP/s after:", after, flush=True)
    peak = max(max(before.values()), max(after.values()))
    res["peak_gflop_s"] = peak
    res["peak_mm_gflop_s"] = {"before": before, "after": after}
    for side in a.sides.split(","):
        res[side]["fraction_of_peak"] = round(res[side]["gflop_s"] / peak, 3)
        res[side]["useful_fraction_of_peak"] = round(res[side]["useful_gflop_s"] / peak, 3)
    if {"relayrl", "hf"} <= set(res):
        res["ratio"] = round(res["hf"]["cpu_s_per_step"] / res["relayrl"]["cpu_s_per_step"], 3)
        res["ratio_is"] = "hf padded step CPU seconds / relayrl train_batch step CPU seconds (same tokens, 1 thread)"
    res["settings"] = {
        "rows": ROWS,
        "prompt_tokens": [PROMPT_MIN, PROMPT_MAX],
        "completion_tokens": COMPLETION,
        "tokens": tokens,
        "flops": "2mnk per matmul; causal attention over real lengths; fwd+bwd = 3x fwd (relayrl LM head 4x)",
        "machine": "2 CPU cores shared with other jobs; 1 torch thread",
    }
    out = Path(a.out) if a.out else RESULTS / f"{res['name']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
