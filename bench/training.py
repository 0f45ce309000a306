"""Training throughput: packed varlen micro-batches vs the padded HF baseline.

Useful (non-pad) tokens per second of one full ``train_batch`` (forward, backward, AdamW
step) on an RL-like length mix (20-512 tokens, long tail), same model, same token budget
per micro-batch, same loss. Packed = ``TorchTrainEngine`` (balanced bin packing, per-document
attention). Padded = the plain HF way: rows in batch order, right-padded micro-batches with
an attention mask (``B_mb * L_max <= budget``), SDPA attention. Each mode runs in its own
child process, so each peak RSS is its own.

    python bench/training.py [--model tiny] [--batch 32] [--budget 4096] [--repeats 3]
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rl_lengths(n: int, seed: int) -> list[int]:
    """Prompt + completion lengths: mostly short, a long tail up to 512."""
    import torch

    g = torch.Generator().manual_seed(seed)
    raw = (4.6 + 0.7 * torch.randn(n, generator=g)).exp()  # lognormal, median ~100
    return [int(x) for x in raw.clamp(20, 512).round()]


def make_batch(lengths: list[int], seed: int, vocab: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    bsz, seqlen = len(lengths), max(lengths)
    ids = torch.randint(3, vocab, (bsz, seqlen), generator=g)
    attn = torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]
    loss = attn.clone()
    loss[:, :16] = False
    return {
        "input_ids": ids * attn,
        "attention_mask": attn,
        "loss_mask": loss,
        "advantages": torch.randn(bsz, seqlen, generator=g) * attn,
    }


def padded_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive rows while rows * longest <= budget (what a padded trainer does)."""
    groups: list[list[int]] = [[]]
    longest = 0
    for i, n in enumerate(lengths):
        if groups[-1] and (len(groups[-1]) + 1) * max(longest, n) > budget:
            groups.append([])
            longest = 0
        groups[-1].append(i)
        longest = max(longest, n)
    return groups


def run_mode(mode: str, args: argparse.Namespace, queue: mp.Queue) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from relayrl.api.config import ModelConfig, OptimizerConfig, TrainEngineConfig
    from relayrl.data.models import build_tiny_model
    from relayrl.train.engine import TorchTrainEngine
    from relayrl.train.packing import token_logprobs

    model = build_tiny_model(args.model, seed=0)
    vocab = model.config.vocab_size
    batches = [make_batch(rl_lengths(args.batch, seed=r), seed=r, vocab=vocab) for r in range(args.repeats + 1)]

    def loss_fn(logits: torch.Tensor, packed: dict) -> torch.Tensor:
        mask = packed["loss_mask"].float()
        return -(token_logprobs(logits, packed) * packed["advantages"] * mask).sum() / mask.sum()

    if mode == "packed":
        cfg = TrainEngineConfig(mb_max_tokens=args.budget, optimizer=OptimizerConfig(lr=1e-5))
        eng = TorchTrainEngine(cfg, ModelConfig(attn_impl="varlen"), model=model)
        eng.initialize()

        def step(batch: dict) -> None:
            eng.train_batch(batch, loss_fn, lambda p: float(p["loss_mask"].sum()))
    else:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(batch: dict) -> None:
            lengths = batch["attention_mask"].sum(1).tolist()
            groups = padded_micro_batches(lengths, args.budget)
            total = float(batch["loss_mask"].sum())
            opt.zero_grad()
            for rows in groups:
                n = max(lengths[i] for i in rows)
                ids, attn = batch["input_ids"][rows, :n], batch["attention_mask"][rows, :n]
                logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
                lp = logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
                mask = batch["loss_mask"][rows, 1:n].float()
                (-(lp * batch["advantages"][rows, 1:n] * mask).sum() / total).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

    step(batches[0])  # warm-up
    rates = []
    for b in batches[1:]:
        t0 = time.perf_counter()
        step(b)
        rates.append(float(b["attention_mask"].sum()) / (time.perf_counter() - t0))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put({"rates": rates, "peak_rss_mb": peak_mb})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "tiny-30m"])
    ap.add_argument("--batch", type=int, default=32, help="sequences per train_batch")
    ap.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch (both modes)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = {}
    for mode in ("padded", "packed"):
        q = ctx.Queue()
        proc = ctx.Process(target=run_mode, args=(mode, args, q))
        proc.start()
        results[mode] = q.get()
        proc.join()
    lengths = [n for r in range(1, args.repeats + 1) for n in rl_lengths(args.batch, seed=r)]
    pad_tokens = sum(
        len(g) * max(lengths_r[i] for i in g)
        for r in range(1, args.repeats + 1)
        for lengths_r in [rl_lengths(args.batch, seed=r)]
        for g in padded_micro_batches(lengths_r, args.budget)
    )
    med = {m: statistics.median(results[m]["rates"]) for m in results}
    ratios = [p / q for p, q in zip(results["packed"]["rates"], results["padded"]["rates"], strict=True)]
    out = {
        "name": "training",
        "ratio": med["packed"] / med["padded"],
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "packed_tokens_per_s": med["packed"],
        "padded_tokens_per_s": med["padded"],
        "packed_rates": results["packed"]["rates"],
        "padded_rates": results["padded"]["rates"],
        "packed_peak_rss_mb": results["packed"]["peak_rss_mb"],
        "padded_peak_rss_mb": results["padded"]["peak_rss_mb"],
        "padded_pad_fraction": 1 - sum(lengths) / pad_tokens,
        "settings": {
            **vars(args),
            "lengths": "lognormal(4.6, 0.7) clamped to [20, 512]",
            "mean_len": statistics.mean(lengths),
        },
    }
    print(
        f"packed {med['packed']:.0f} tok/s vs padded {med['padded']:.0f} tok/s: {out['ratio']:.2f}x "
        f"(range {out['ratio_min']:.2f}-{out['ratio_max']:.2f}); pad fraction {out['padded_pad_fraction']:.0%}; "
        f"peak RSS packed {out['packed_peak_rss_mb']:.0f} MB, padded {out['padded_peak_rss_mb']:.0f} MB"
    )
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "training.json"), "w") as fh:
        json.dump(out, fh, indent=2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
