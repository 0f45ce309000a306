"""LoRA (rank 16) vs full fine-tuning on the ~30M model: peak memory and step time.

One ``TorchTrainEngine.train_batch`` (packed forward, backward, AdamW step) on the RL-like
length mix of ``bench/training.py``, same batches, same token budget. Full = every weight
trains (weights + gradients + two AdamW moments); LoRA = ``model.lora.rank=16`` on every
linear projection (the base is frozen: no gradients or optimizer state for it). Each mode runs
in its own child process, so each peak RSS is its own (large allocations are mmap'd, so RSS
follows live memory rather than the allocator's history). Goals: peak RSS <= 0.6x full,
step time <= 1.1x full.

Two settings, each LoRA vs full: the engine's defaults (no gradient checkpointing: at 4096
tokens per micro-batch the activations of this small model outweigh its weights, gradients and
AdamW state together), and with ``model.gradient_checkpointing`` (how memory-bound runs train:
then weights and optimizer state dominate). The headline ratios are the first setting's.

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


def run_mode(mode: str, gc: bool, args: argparse.Namespace, queue: mp.Queue) -> None:
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
    mcfg = ModelConfig(path=args.model, attn_impl="varlen", gradient_checkpointing=gc, lora=lora)
    eng = TorchTrainEngine(cfg, mcfg, model=model)
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
    # glibc keeps freed heap memory (RSS then reflects allocation history, not live tensors): allocations of
    # 64 KiB and more are mmap'd in the children instead, so that freeing returns them and peak RSS is live memory
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    ctx = mp.get_context("spawn")
    out: dict[str, object] = {"name": "lora"}
    for gc in (False, True):
        results = {}
        for mode in ("full", "lora"):
            q = ctx.Queue()
            proc = ctx.Process(target=run_mode, args=(mode, gc, args, q))
            proc.start()
            results[mode] = q.get()
            proc.join()
        step = {m: statistics.median(results[m]["step_s"]) for m in results}
        rss = {m: results[m]["peak_rss_mb"] for m in results}
        imports = {m: results[m]["import_rss_mb"] for m in results}
        tag = "_gc" if gc else ""
        out.update(
            {
                f"ratio{tag}": step["lora"] / step["full"],
                f"rss_ratio{tag}": rss["lora"] / rss["full"],
                # the same with what the processes held before building the model (torch, transformers) left out
                f"rss_ratio_above_imports{tag}": (rss["lora"] - imports["lora"]) / (rss["full"] - imports["full"]),
                f"full_step_s{tag}": step["full"],
                f"lora_step_s{tag}": step["lora"],
                f"full_steps_s{tag}": results["full"]["step_s"],
                f"lora_steps_s{tag}": results["lora"]["step_s"],
                f"full_peak_rss_mb{tag}": rss["full"],
                f"lora_peak_rss_mb{tag}": rss["lora"],
                f"full_import_rss_mb{tag}": imports["full"],
                f"lora_import_rss_mb{tag}": imports["lora"],
            }
        )
        print(
            f"{'gradient checkpointing' if gc else 'defaults'}: step time LoRA {step['lora']:.2f}s vs full "
            f"{step['full']:.2f}s = {out[f'ratio{tag}']:.2f}x (goal <= 1.1); peak RSS LoRA {rss['lora']:.0f} MB vs "
            f"full {rss['full']:.0f} MB = {out[f'rss_ratio{tag}']:.2f}x (goal <= 0.6), "
            f"{out[f'rss_ratio_above_imports{tag}']:.2f}x above the imports",
            flush=True,
        )
    out["loadavg"] = list(os.getloadavg())
    out["figure"] = "step time LoRA / full (goal <= 1.1); rss_ratio: peak RSS LoRA / full (goal <= 0.6)"
    out["full_trainable_params"] = results["full"]["trainable_params"]
    out["lora_trainable_params"] = results["lora"]["trainable_params"]
    out["settings"] = {
        **vars(args),
        "lengths": "lognormal(4.6, 0.7) clamped to [20, 512]",
        "MALLOC_MMAP_THRESHOLD_": os.environ["MALLOC_MMAP_THRESHOLD_"],
    }
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "lora.json"), "w") as fh:
        json.dump(out, fh, indent=2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
