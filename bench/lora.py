"""LoRA (rank 16) vs full fine-tuning on the ~30M model: peak memory and step time.

One ``TorchTrainEngine.train_batch`` (packed forward, backward, AdamW step) on the RL-like
length mix of ``bench/training.py``, same batches, same token budget. Full = every weight
trains (weights + gradients + two AdamW moments); LoRA = ``model.lora.rank=16`` on every
linear projection (the base is frozen: no gradients or optimizer state for it). Each mode runs
in its own child process, so each peak RSS is its own. Goals: peak RSS <= 0.6x full,
step time <= 1.1x full.

    python bench/lora.py [--model tiny-30m] [--rank 16] [--batch 16] [--budget 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training import make_batch, rl_lengths  # noqa: E402


def run_mode(mode: str, args: argparse.Namespace, queue: mp.Queue) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from relayrl.api.config import LoraConfig, ModelConfig, OptimizerConfig, TrainEngineConfig
    from relayrl.data.models import build_tiny_model
    from relayrl.train.engine import TorchTrainEngine
    from relayrl.train.packing import token_logprobs

    base_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the interpreter and libraries
    model = build_tiny_model(args.model, seed=0)
    vocab = model.config.vocab_size
    batches = [make_batch(rl_lengths(args.batch, seed=r), seed=r, vocab=vocab) for r in range(args.repeats + 1)]
    lora = LoraConfig(rank=args.rank if mode == "lora" else 0, alpha=2.0 * args.rank)
    cfg = TrainEngineConfig(mb_max_tokens=args.budget, optimizer=OptimizerConfig(lr=1e-5))
    eng = TorchTrainEngine(cfg, ModelConfig(path=args.model, attn_impl="varlen", lora=lora), model=model)
    eng.initialize()
    del model

    def loss_fn(logits: torch.Tensor, packed: dict) -> torch.Tensor:
        mask = packed["loss_mask"].float()
        return -(token_logprobs(logits, packed) * packed["advantages"] * mask).sum() / mask.sum()

    def weight(packed: dict) -> float:
        return float(packed["loss_mask"].sum())

    eng.train_batch(batches[0], loss_fn, weight)  # warm-up (AdamW state allocated)
    times = []
    for b in batches[1:]:
        t0 = time.perf_counter()
        eng.train_batch(b, loss_fn, weight)
        times.append(time.perf_counter() - t0)
    trainable = sum(p.numel() for p in eng.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in eng.model.parameters())
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put(
        {
            "step_s": times,
            "peak_rss_mb": peak_mb,
            "import_rss_mb": base_mb,
            "trainable_params": trainable,
            "params": total,
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-30m", choices=["tiny", "tiny-30m"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16, help="sequences per train_batch")
    ap.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch (both modes)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = {}
    for mode in ("full", "lora"):
        q = ctx.Queue()
        proc = ctx.Process(target=run_mode, args=(mode, args, q))
        proc.start()
        results[mode] = q.get()
        proc.join()
    step = {m: statistics.median(results[m]["step_s"]) for m in results}
    rss = {m: results[m]["peak_rss_mb"] for m in results}
    out = {
        "name": "lora",
        "ratio": step["lora"] / step["full"],
        "figure": "step time LoRA / full (goal <= 1.1); rss_ratio: peak RSS LoRA / full (goal <= 0.6)",
        "rss_ratio": rss["lora"] / rss["full"],
        "full_step_s": step["full"],
        "lora_step_s": step["lora"],
        "full_steps_s": results["full"]["step_s"],
        "lora_steps_s": results["lora"]["step_s"],
        "full_peak_rss_mb": rss["full"],
        "lora_peak_rss_mb": rss["lora"],
        "full_import_rss_mb": results["full"]["import_rss_mb"],
        "lora_import_rss_mb": results["lora"]["import_rss_mb"],
        # the same ratio with what the processes held before building the model (torch, transformers, peft) left out
        "rss_ratio_above_imports": (rss["lora"] - results["lora"]["import_rss_mb"])
        / (rss["full"] - results["full"]["import_rss_mb"]),
        "full_trainable_params": results["full"]["trainable_params"],
        "lora_trainable_params": results["lora"]["trainable_params"],
        "settings": {**vars(args), "lengths": "lognormal(4.6, 0.7) clamped to [20, 512]"},
    }
    print(
        f"step time LoRA {step['lora']:.2f}s vs full {step['full']:.2f}s: {out['ratio']:.2f}x (goal <= 1.1); "
        f"peak RSS LoRA {rss['lora']:.0f} MB vs full {rss['full']:.0f} MB: {out['rss_ratio']:.2f}x (goal <= 0.6); "
        f"({out['rss_ratio_above_imports']:.2f}x above the imports); "
        f"trainable {out['lora_trainable_params']:,} of {out['full_trainable_params']:,}"
    )
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "lora.json"), "w") as fh:
        json.dump(out, fh, indent=2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
