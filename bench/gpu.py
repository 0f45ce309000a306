"""GPU benchmarks: generation and training of a 0.5B-class model in bf16, with train MFU.

Needs a CUDA device; without one it prints why and exits 0 (``bench/run_all.py`` skips it).
The model is a randomly initialised Qwen2-0.5B-shaped config (hidden 896, 24 layers, 14
heads, 2 KV heads, MLP 4864, vocab 151936, tied embeddings: ~494M parameters) built from a
config, no hub access.

- generation: tokens/s of ``LocalEngine`` (``inference.device=cuda``) ÷ HF ``generate`` on the
  workload of ``bench/generation.py`` scaled to ``--n-requests`` (256) prompts of 8-40 tokens,
  temperature 1, top_k off, EOS biased so completion lengths are geometric (long-tailed) with
  mean ~``--mean-len``, capped at ``--max-new``; goal >= 5x;
- batch-1 decode: one greedy request of ``--max-new`` tokens; step time = (latency - ttft) /
  (tokens - 1); roofline fraction = weight bytes / step time / peak HBM bandwidth; goal >= 50%;
  with CUDA graphs (the default) and again with ``inference.cuda_graphs=false`` for comparison;
- training: tokens/s of one full ``train_batch`` (packed, ``TorchTrainEngine`` with bf16
  autocast) ÷ the padded HF baseline (``bench/training.py``'s micro-batching, SDPA, bf16
  autocast), on its RL length mix; and train MFU = 6 * params * tokens / (seconds * peak
  bf16 dense FLOP/s of the detected GPU); goal >= 35%.

    python bench/gpu.py [--repeats 3] [--batch 64] [--budget 8192] [--max-new 256]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time

import common
import torch

QWEN2_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rope_theta": 1e6,
}
# Peak dense bf16 tensor-core FLOP/s (no sparsity), matched by substring of the device name.
PEAK_BF16 = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
]


# Peak HBM bandwidth in bytes/s, matched the same way.
PEAK_HBM = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("H800", 3.35e12),
    ("A100-SXM4-80GB", 2.04e12),
    ("A100 80GB PCIe", 1.94e12),
    ("A100", 1.555e12),
    ("A800", 2.04e12),
    ("L40S", 0.864e12),
    ("L40", 0.864e12),
    ("L4", 0.3e12),
    ("A10", 0.6e12),
    ("RTX 4090", 1.008e12),
    ("RTX 3090", 0.936e12),
]


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16 if k in name), None)


def peak_bandwidth(name: str) -> float | None:
    return next((v for k, v in PEAK_HBM if k in name), None)


def build_model(eos_bias: float | None = None) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen2", tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2, **QWEN2_05B
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda()
    model.generation_config.pad_token_id = 0
    if eos_bias is not None:
        bias = torch.zeros(cfg.vocab_size, device="cuda", dtype=torch.bfloat16)
        bias[1] = eos_bias
        model.lm_head.register_forward_hook(lambda _m, _i, out: out + bias)
    return model


def bench_generation(args: argparse.Namespace) -> dict:
    from generation import EOS, PAD
    from generation import make_prompts as gen_prompts

    from relayrl.api.config import InferenceConfig
    from relayrl.api.io import GenerationConfig, ModelRequest
    from relayrl.inference.local import LocalEngine

    vocab = QWEN2_05B["vocab_size"]
    model = build_model(eos_bias=math.log(vocab / args.mean_len)).eval()  # P(EOS) ~ 1/mean_len per step

    def make_prompts(seed: int, vocab: int) -> list[list[int]]:
        return [p for k in range(math.ceil(args.n_requests / 64)) for p in gen_prompts(seed * 1000 + k, vocab)][
            : args.n_requests
        ]

    def hf(prompts: list[list[int]]) -> tuple[int, float]:
        n = max(len(p) for p in prompts)
        ids = torch.tensor([[PAD] * (n - len(p)) + p for p in prompts], device="cuda")
        mask = (
            torch.arange(n, device="cuda")[None] >= torch.tensor([n - len(p) for p in prompts], device="cuda")[:, None]
        ).long()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new,
                eos_token_id=EOS,
                pad_token_id=PAD,
            )
        torch.cuda.synchronize()
        rows = out[:, n:].tolist()
        return sum(r.index(EOS) + 1 if EOS in r else len(r) for r in rows), time.perf_counter() - t0

    def local(engine: LocalEngine, prompts: list[list[int]], timeout: float = 600.0) -> tuple[int, float]:
        g = GenerationConfig(max_new_tokens=args.max_new, temperature=1.0, top_k=0, top_p=1.0)

        async def go() -> list[int]:
            reqs = asyncio.gather(*(engine.agenerate(ModelRequest(str(i), p, g)) for i, p in enumerate(prompts)))
            # a model error while admitting requests can leave them unanswered: time out instead of hanging
            return [r.output_len for r in await asyncio.wait_for(reqs, timeout=timeout)]

        t0 = time.perf_counter()
        lengths = asyncio.run(go())
        torch.cuda.synchronize()
        return sum(lengths), time.perf_counter() - t0

    hf(make_prompts(999, vocab)[:8])  # warm-up
    hf_tps = []
    for r in range(args.repeats):
        tok, s = hf(make_prompts(r, vocab))
        hf_tps.append(tok / s)
    out: dict = {"generate_tok_s": common.spread(hf_tps)}
    try:
        engine = LocalEngine(InferenceConfig(max_batch_size=args.n_requests, seed=0, device="cuda"), model=model)
        engine.initialize()
        local(engine, make_prompts(999, vocab)[:8], timeout=120.0)  # warm-up; fails fast if CUDA is unsupported
        eng_tps = []
        for r in range(args.repeats):
            tok, s = local(engine, make_prompts(r, vocab))
            eng_tps.append(tok / s)
        ratios = [e / h for e, h in zip(eng_tps, hf_tps, strict=True)]
        out.update(
            engine_tok_s=common.spread(eng_tps),
            ratio=common.spread(ratios),
            kv_capacity=engine.kv_capacity,
            preemptions=engine.counters["preemptions"],
            fast_decode=engine._fast is not None,
            cuda_graphs=engine._static is not None,
            attention=engine._static.attention if engine._static is not None else "sdpa",
        )
        out["batch1"] = batch1_decode(engine, model, args.max_new)
        out["graph_captures"] = engine._static.captures if engine._static is not None else 0
        engine.destroy()
        eager = LocalEngine(InferenceConfig(seed=0, device="cuda", cuda_graphs=False), model=model)
        eager.initialize()
        out["batch1_without_cuda_graphs"] = batch1_decode(eager, model, args.max_new)
        eager.destroy()
    except Exception as e:  # noqa: BLE001 - reported, not fatal: the training half still runs
        out["engine_error"] = f"LocalEngine on CUDA failed: {type(e).__name__}: {str(e)[:300]}"
    print(f"generation: {out}", flush=True)
    return out


def batch1_decode(engine, model: torch.nn.Module, n: int) -> dict:  # noqa: ANN001
    """Step time of one greedy request alone and its fraction of the HBM-bandwidth roofline."""
    from relayrl.api.io import GenerationConfig, ModelRequest

    g = GenerationConfig(max_new_tokens=n, greedy=True, ignore_eos=True)
    steps = []
    for r in range(3):
        resp = asyncio.run(engine.agenerate(ModelRequest(f"b1-{r}", [5, 6, 7, 8, 9, 10, 11, 12], g)))
        steps.append((resp.latency - resp.ttft) / (resp.output_len - 1))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = peak_bandwidth(torch.cuda.get_device_name())
    step = min(steps)
    return {
        "step_ms": step * 1e3,
        "weight_bytes": weight_bytes,
        "peak_hbm_bytes_s": bw,
        "roofline_fraction": weight_bytes / step / bw if bw else None,
        "formula": "weight bytes / step time / peak HBM bandwidth",
    }


def bench_training(args: argparse.Namespace) -> dict:
    from training import make_batch, padded_micro_batches, rl_lengths

    from relayrl.api.config import ModelConfig, OptimizerConfig, TrainEngineConfig
    from relayrl.train.engine import TorchTrainEngine
    from relayrl.train.packing import token_logprobs

    vocab = QWEN2_05B["vocab_size"]
    batches = [make_batch(rl_lengths(args.batch, seed=r), seed=r, vocab=vocab) for r in range(args.repeats + 1)]

    def loss_fn(logits: torch.Tensor, packed: dict) -> torch.Tensor:
        mask = packed["loss_mask"].float()
        return -(token_logprobs(logits, packed) * packed["advantages"] * mask).sum() / mask.sum()

    def run(step) -> list[float]:  # noqa: ANN001
        step(batches[0])  # warm-up
        rates = []
        for b in batches[1:]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(b)
            torch.cuda.synchronize()
            rates.append(float(b["attention_mask"].sum()) / (time.perf_counter() - t0))
        return rates

    model = build_model().float()  # fp32 master weights, bf16 autocast (both modes)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = TrainEngineConfig(mb_max_tokens=args.budget, bf16=True, optimizer=OptimizerConfig(lr=1e-6))
    eng = TorchTrainEngine(cfg, ModelConfig(attn_impl="auto"), model=model)
    eng.initialize()
    packed = run(lambda b: eng.train_batch(b, loss_fn, lambda p: float(p["loss_mask"].sum())))
    attn = eng.model.config._attn_implementation  # type: ignore[union-attr]
    eng.destroy()
    model = eng = None  # free GPU memory before the padded run
    torch.cuda.empty_cache()

    model = build_model().float()
    model.config.use_cache = False
    model.set_attn_implementation("sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def padded_step(batch: dict) -> None:
        batch = {k: v.cuda() for k, v in batch.items()}
        lengths = batch["attention_mask"].sum(1).tolist()
        total = float(batch["loss_mask"].sum())
        opt.zero_grad()
        for rows in padded_micro_batches(lengths, args.budget):
            n = max(lengths[i] for i in rows)
            ids, mask = batch["input_ids"][rows, :n], batch["attention_mask"][rows, :n]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            lp = logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
            m = batch["loss_mask"][rows, 1:n].float()
            (-(lp * batch["advantages"][rows, 1:n] * m).sum() / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    padded = run(padded_step)
    name = torch.cuda.get_device_name()
    peak = peak_flops(name)
    mfu = [6 * n_params * r / peak for r in packed] if peak else None
    out = {
        "params": n_params,
        "packed_attn": attn,
        "packed_tok_s": common.spread(packed),
        "padded_tok_s": common.spread(padded),
        "ratio": common.spread([p / q for p, q in zip(packed, padded, strict=True)]),
        "train_mfu": common.spread(mfu) if mfu else None,
        "padded_mfu": common.spread([6 * n_params * r / peak for r in padded]) if peak else None,
        "peak_bf16_flops": peak,
        "mfu_formula": "6 * params * tokens / (seconds * peak bf16 dense FLOP/s)",
    }
    print(f"training: {out}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="sequences per train_batch")
    ap.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch (both modes)")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--n-requests", type=int, default=256, help="generation requests per repeat (long-tailed lengths)")
    ap.add_argument("--mean-len", type=float, default=64.0, help="mean completion length (EOS bias)")
    ap.add_argument("--quick", action="store_true", help="1 repeat, small batch (smoke test)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device is available (torch.cuda.is_available() is False); nothing to measure.")
        return
    if args.quick:
        args.repeats, args.batch, args.max_new, args.n_requests = 1, 16, 64, 32
    torch.backends.cuda.matmul.allow_tf32 = True
    gen = bench_generation(args)
    train = bench_training(args)
    ratio = gen.get("ratio", {}).get("median") if isinstance(gen.get("ratio"), dict) else None
    common.write_result(
        {
            "name": "gpu",
            "ratio": ratio,
            "ratio_is": "generation: LocalEngine / HF generate tokens/s",
            "batch1_roofline": (gen.get("batch1") or {}).get("roofline_fraction"),
            "training_ratio": train["ratio"]["median"],
            "train_mfu": train["train_mfu"]["median"] if train["train_mfu"] else None,
            "device": torch.cuda.get_device_name(),
            "generation": gen,
            "training": train,
            "settings": {
                "model": {**QWEN2_05B, "tie_word_embeddings": True},
                "dtype": "bf16",
                "repeats": args.repeats,
                "batch": args.batch,
                "budget": args.budget,
                "max_new_tokens": args.max_new,
                "n_requests": args.n_requests,
                "mean_len": args.mean_len,
                "torch": torch.__version__,
            },
        },
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
