"""The static-buffer decode step (``inference.cuda_graphs``) and the attention-path choice.

On CPU the step runs eagerly over the same bucketed buffers a CUDA graph would replay, so
these tests check the layout logic itself: rows padded to a bucket, columns masked past the
written ones, the batch laid out again when rows leave or the column bucket is used up. The
``gpu`` tests capture real graphs and, with flash-attn installed, its KV-cache kernel.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util

import pytest
import torch

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.inference.local import LocalEngine, graphs
from relayrl.inference.local.graphs import bucket_cols, bucket_rows, choose_attention

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 50)), [3, 4, 5, 6], [40, 41, 42, 43, 44]]


def run(model, device: str, static: bool, gconfigs: list[GenerationConfig]):
    engine = LocalEngine(InferenceConfig(device=device, admit_window_ms=20, seed=3), model, static_steps=static)
    engine.initialize()

    async def go():
        return await asyncio.gather(
            *[
                engine.agenerate(ModelRequest(rid=str(i), input_ids=p, gconfig=g))
                for i, (p, g) in enumerate(zip(PROMPTS, gconfigs, strict=True))
            ]
        )

    try:
        return asyncio.run(go()), engine._static
    finally:
        engine.destroy()


def test_buckets():
    assert [bucket_rows(n) for n in (1, 3, 5, 17, 100, 512, 513, 700)] == [1, 4, 8, 24, 128, 512, 640, 768]
    assert [bucket_cols(n, 8) for n in (1, 8, 9, 17)] == [8, 8, 16, 24]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_static_step_equals_ordinary_step_on_cpu(tiny_model, monkeypatch, temperature):
    """5 rows (bucket 8: 3 padding rows) finishing at different lengths (the batch is laid out again
    as rows leave), columns in buckets of 8 (laid out again ~every 8 steps): same tokens, same logprobs."""
    monkeypatch.setattr(graphs, "COL_STEP", 8)
    gconfigs = [
        GenerationConfig(max_new_tokens=n, greedy=temperature == 0.0, temperature=temperature or 1.0, ignore_eos=True)
        for n in (30, 7, 19, 3, 25)
    ]
    plain, none = run(tiny_model, "cpu", False, gconfigs)
    static, dec = run(tiny_model, "cpu", True, gconfigs)
    assert none is None and dec is not None and dec.captures == 0  # eager on CPU: nothing captured
    assert dec.loads >= 8  # rows left 4 times and the column bucket filled several times
    for a, b in zip(plain, static, strict=True):
        assert a.output_tokens == b.output_tokens
        torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5, rtol=0)


def test_static_step_after_weight_update(tiny_model):
    """A weight update re-fuses the weights: the static buffers (and graphs) are dropped and rebuilt."""
    model = copy.deepcopy(tiny_model)
    g = GenerationConfig(max_new_tokens=6, greedy=True, ignore_eos=True)
    from relayrl.api.io import WeightUpdate

    engine = LocalEngine(InferenceConfig(device="cpu", seed=1), model, static_steps=True)
    engine.initialize()
    try:
        state = {k: v * 1.05 for k, v in tiny_model.state_dict().items()}
        engine.update_weights(WeightUpdate(kind="tensors", version=1, tensors=state))

        async def go():
            return await engine.agenerate(ModelRequest(rid="a", input_ids=PROMPTS[0], gconfig=g))

        out = asyncio.run(go())
    finally:
        engine.destroy()
    ref = copy.deepcopy(tiny_model)
    ref.load_state_dict(state)
    expect = ref.generate(
        torch.tensor([PROMPTS[0]]), max_new_tokens=6, do_sample=False, top_k=None, top_p=None, eos_token_id=None
    )
    assert out.output_tokens == expect[0, len(PROMPTS[0]) :].tolist()


def test_attention_choice():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose_attention(cuda, torch.bfloat16, flash_installed=True) == "flash_attn"
    assert choose_attention(cuda, torch.float16, flash_installed=True) == "flash_attn"
    assert choose_attention(cuda, torch.float32, flash_installed=True) == "sdpa"  # flash-attn has no fp32 kernel
    assert choose_attention(cuda, torch.bfloat16, flash_installed=False) == "sdpa"
    assert choose_attention(cpu, torch.bfloat16, flash_installed=True) == "sdpa"


def test_cuda_graphs_default_only_on_cuda(tiny_model):
    engine = LocalEngine(InferenceConfig(device="cpu", cuda_graphs=True), tiny_model)
    engine.initialize()
    engine.destroy()
    assert engine._static is None  # ignored on CPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_equal_eager_on_cuda(tiny_model, dtype):
    """Captured graphs (and flash-attn's ``flash_attn_with_kvcache`` in bf16 where installed) sample
    what the plain step samples: same tokens in fp32, logprobs within bf16 rounding until the first
    differing token in bf16."""
    model = copy.deepcopy(tiny_model).to(dtype)
    gconfigs = [GenerationConfig(max_new_tokens=n, temperature=0.8, ignore_eos=True) for n in (40, 7, 19, 3, 25)]
    plain, _ = run(model, "cuda", False, gconfigs)
    static, dec = run(model, "cuda", None, gconfigs)
    assert dec is not None and dec.captures >= 1
    flash = importlib.util.find_spec("flash_attn") is not None and dtype == torch.bfloat16
    assert dec.attention == ("flash_attn" if flash else "sdpa")  # the KV-cache kernel where installed
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    same = sum(a.output_tokens == b.output_tokens for a, b in zip(plain, static, strict=True))
    assert same == len(PROMPTS) or dtype == torch.bfloat16
    for a, b in zip(plain, static, strict=True):
        k = next(
            (i for i, (x, y) in enumerate(zip(a.output_tokens, b.output_tokens, strict=True)) if x != y),
            len(a.output_tokens),
        )
        torch.testing.assert_close(
            torch.tensor(a.output_logprobs[:k]), torch.tensor(b.output_logprobs[:k]), atol=tol, rtol=0
        )


@pytest.mark.gpu
def test_decode_step_has_no_host_sync_on_cuda(tiny_model):
    """The static step (graph replay) and the sampler launch work without waiting for the GPU:
    the only sync per step is the copy of the sampled ids, outside this check."""
    from relayrl.inference.local.sampling import RowParams, sample

    model = copy.deepcopy(tiny_model).cuda()
    engine = LocalEngine(InferenceConfig(device="cuda"), model)
    engine.initialize()
    engine.destroy()
    dec = engine._static
    assert dec is not None
    from relayrl.inference.local.decode import SlabLayer

    n, width = 3, 10
    cfg = model.config
    h, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    layers = [
        SlabLayer(torch.randn(n, h, width, d, device="cuda"), torch.randn(n, h, width, d, device="cuda"))
        for _ in range(cfg.num_hidden_layers)
    ]
    mask = torch.ones(n, width, dtype=torch.bool, device="cuda")
    pos = torch.full((n,), width, device="cuda")
    with torch.inference_mode():
        layers = dec.load(layers, mask, pos)
        tokens = torch.tensor([3, 4, 5], device="cuda")
        dec.step(tokens, pos, layers)  # captures
        p = RowParams(
            temperature=torch.ones(n, device="cuda"),
            top_k=torch.zeros(n, dtype=torch.long, device="cuda"),
            top_p=torch.ones(n, device="cuda"),
            greedy=torch.zeros(n, dtype=torch.bool, device="cuda"),
            keys=torch.arange(n, device="cuda"),
            counters=torch.zeros(n, dtype=torch.long, device="cuda"),
        )
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                logits = dec.step(tokens, pos, layers)
                tokens, _ = sample(logits, p)
                pos = pos + 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
