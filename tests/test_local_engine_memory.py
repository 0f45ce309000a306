"""LocalEngine's device, KV budget, preemption, failure isolation and release/resume of memory.

All on CPU with a small token budget (``inference.max_tokens_in_flight``, which is the KV
capacity on CPU; on CUDA the same code is sized by ``kv_cache_fraction``): requests that do not
fit together are preempted and continued, never dropped, and give the same tokens as an engine
with room to spare; a request that can never fit, or whose prefill runs out of memory, fails
alone with a message naming the limit; ``release_memory`` frees the cache mid-generation.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from relayrl.api.commands import ServerConfig
from relayrl.api.config import ConfigError, InferenceConfig, load_config
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.data.families import save_tiny_family
from relayrl.inference.local import LocalEngine
from relayrl.inference.server import LISTEN_PREFIX
from tests.test_local_engine import pause_at_step

PROMPTS = [list(range(10, 10 + n)) for n in (12, 9, 15, 6, 11, 8)]


def generate(engine: LocalEngine, prompts, g: GenerationConfig, during=None):
    async def go():
        tasks = [asyncio.ensure_future(engine.agenerate(ModelRequest(f"r{i}", p, g))) for i, p in enumerate(prompts)]
        if during is not None:
            await asyncio.sleep(0)
            await asyncio.to_thread(during)
        return await asyncio.gather(*tasks, return_exceptions=True)

    return asyncio.run(go())


def teacher_forced(model, prompt, out):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(out)[:, None])[:, 0]


@pytest.mark.parametrize("fast_decode", [True, False])
def test_full_cache_preempts_and_continues(tiny_model, fast_decode):
    g = GenerationConfig(max_new_tokens=30, temperature=1.0, ignore_eos=True)
    roomy = LocalEngine(InferenceConfig(device="cpu", seed=5, fast_decode=fast_decode), tiny_model)
    roomy.initialize()
    try:
        expected = generate(roomy, PROMPTS, g)
    finally:
        roomy.destroy()
    assert roomy.counters["preemptions"] == 0
    tight = LocalEngine(
        InferenceConfig(device="cpu", seed=5, max_tokens_in_flight=100, fast_decode=fast_decode), tiny_model
    )
    tight.initialize()
    try:
        got = generate(tight, PROMPTS, g)
    finally:
        tight.destroy()
    assert tight.kv_capacity == 100
    assert tight.counters["preemptions"] > 0 and tight.counters["aborts"] == 0
    assert 0 < tight.counters["kv_peak"] <= 100 < roomy.counters["kv_peak"]
    for p, e, r in zip(PROMPTS, expected, got, strict=True):
        assert r.stop_reason == "length" and len(r.output_tokens) == 30
        assert r.output_tokens == e.output_tokens
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs), teacher_forced(tiny_model, p, r.output_tokens), atol=1e-4, rtol=0
        )


def test_request_that_cannot_fit_fails_alone(tiny_model):
    engine = LocalEngine(InferenceConfig(device="cpu", max_tokens_in_flight=40), tiny_model)
    engine.initialize()
    try:
        ok, too_big = generate(
            engine, [[5, 6, 7], list(range(10, 40))], GenerationConfig(max_new_tokens=20, greedy=True)
        )[:2]
    finally:
        engine.destroy()
    assert len(ok.output_tokens) >= 1
    assert isinstance(too_big, ValueError)
    assert "request 'r1'" in str(too_big) and "30 + max_new_tokens 20" in str(too_big)
    assert "KV cache of 40 tokens (inference.max_tokens_in_flight)" in str(too_big)


def test_out_of_memory_in_prefill_fails_only_that_request(tiny_model):
    model = copy.deepcopy(tiny_model)

    def boom(_module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] >= 25:  # a prefill of a long prompt
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    model.register_forward_pre_hook(boom, with_kwargs=True)
    engine = LocalEngine(InferenceConfig(device="cpu", admit_window_ms=50), model)
    engine.initialize()
    prompts = [[5, 6, 7, 8], list(range(10, 40)), [9, 10, 11]]
    try:
        res = generate(engine, prompts, GenerationConfig(max_new_tokens=8, greedy=True, ignore_eos=True))
        later = generate(engine, [[7, 8, 9]], GenerationConfig(max_new_tokens=8, greedy=True, ignore_eos=True))[0]
    finally:
        engine.destroy()
    assert isinstance(res[1], RuntimeError)
    assert "prefill of 30 tokens on cpu ran out of memory" in str(res[1]) and "KV cache capacity 65536 tokens" in str(
        res[1]
    )
    assert [len(res[0].output_tokens), len(res[2].output_tokens), len(later.output_tokens)] == [8, 8, 8]


def test_release_and_resume_memory_mid_generation(tiny_model):
    model = copy.deepcopy(tiny_model)  # it gets a hook
    engine = LocalEngine(InferenceConfig(device="cpu", seed=2), model)
    engine.initialize()
    reached, _ = pause_at_step(engine, model, 7)  # ~20 of the 360 tokens: the release lands mid-generation
    g = GenerationConfig(max_new_tokens=120, temperature=1.0, ignore_eos=True)
    seen: dict[str, int | bool] = {}

    def release_then_resume():
        assert reached.wait(60), "decode step 7 never ran"
        engine.release_memory(weights=True)
        engine.resume()  # released, the engine must stay idle without the pause
        seen["cache_freed"] = engine._cache is None and not engine._rows
        before = engine.counters["tokens"]
        time.sleep(0.2)
        seen["idle"] = engine.counters["tokens"] == before
        engine.resume_memory()

    try:
        res = generate(engine, PROMPTS[:3], g, during=release_then_resume)
    finally:
        engine.destroy()
    assert seen == {"cache_freed": True, "idle": True}
    assert engine.counters["preemptions"] >= 1 and engine.counters["aborts"] == 0
    for p, r in zip(PROMPTS, res, strict=False):
        assert r.stop_reason == "length" and len(r.output_tokens) == 120
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs), teacher_forced(tiny_model, p, r.output_tokens), atol=1e-4, rtol=0
        )


def test_device_setting_is_validated(tiny_model):
    with pytest.raises(ConfigError, match=r"inference\.device='gpu' is not one of 'auto', 'cpu', 'cuda', 'cuda:N'"):
        load_config(ServerConfig, None, ["inference.device=gpu"])
    engine = LocalEngine(InferenceConfig(device="auto"), tiny_model)
    engine.initialize()
    engine.destroy()
    assert engine.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"inference.device='cuda:0' but torch sees no CUDA device"):
            LocalEngine(InferenceConfig(device="cuda:0"), tiny_model).initialize()


def test_serve_device_flag_serves_any_family(tmp_path):
    """`relayrl serve --device cpu` on a Mistral checkpoint (a family that crashed before)."""
    path = save_tiny_family("mistral", tmp_path / "mistral", seed=1)
    bad = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "serve", "--model", str(path), "--device", "gpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "inference.device='gpu'" in bad.stderr
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "serve",
            "--model",
            str(path),
            "--device",
            "cpu",
            "--port",
            "0",
            "model.tokenizer_path=tiny",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        url = _wait_listening(proc)
        prompt = list(range(20, 40))
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
        out = httpx.post(url + "/generate", json=body, timeout=60).json()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=12,
        do_sample=False,
        top_k=None,
        top_p=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert out["output_ids"] == ref[0, len(prompt) :].tolist()


def _wait_listening(proc: subprocess.Popen) -> str:
    found: list[str] = []

    def read():
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith(LISTEN_PREFIX):
                found.append(line.strip()[len(LISTEN_PREFIX) :])
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout=120)
    assert found, "server did not start"
    return found[0]


@pytest.mark.gpu
def test_cuda_release_frees_memory_and_trainer_weights_move_device_to_device(tiny_model):
    from relayrl.api.config import ModelConfig, TrainEngineConfig
    from relayrl.train.engine import TorchTrainEngine

    model = copy.deepcopy(tiny_model)
    engine = LocalEngine(InferenceConfig(device="cuda", seed=2, kv_cache_fraction=0.01), model)
    engine.initialize()
    assert (
        engine.device.type == "cuda" and engine.kv_capacity >= 16 and "kv_cache_fraction=0.01" in engine.kv_capacity_by
    )
    g = GenerationConfig(max_new_tokens=64, temperature=1.0, ignore_eos=True)
    try:
        first = generate(engine, PROMPTS, g)
        held = torch.cuda.memory_allocated()
        engine.release_memory(weights=True)
        assert torch.cuda.memory_allocated() < held
        engine.resume_memory()
        trainer = TorchTrainEngine(TrainEngineConfig(), ModelConfig(), model=copy.deepcopy(tiny_model), trainable=False)
        trainer.initialize()
        assert trainer.device.type == "cuda"
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(1.01)
        trainer.set_version(1)
        trainer.update_weights(engine)
        second = generate(engine, PROMPTS, g)
    finally:
        engine.destroy()
    assert engine.get_version() == 1 and all(len(r.output_tokens) == 64 for r in first + second)
    ref = trainer.model.cpu().float()
    for p, r in zip(PROMPTS, second, strict=True):
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs), teacher_forced(ref, p, r.output_tokens), atol=2e-3, rtol=0
        )


def test_kv_bytes_per_token_of_any_family():
    """What sizes the CUDA cache: keys + values of one token over all layers, from any config."""
    from relayrl.data.families import build_tiny_family
    from relayrl.inference.local.device import kv_bytes_per_token, kv_capacity

    assert kv_bytes_per_token(build_tiny_family("qwen2")) == 2 * 2 * 2 * 16 * 4  # layers, kv heads, head_dim, fp32
    assert kv_bytes_per_token(build_tiny_family("gpt2", dtype=torch.bfloat16)) == 2 * 2 * 4 * 16 * 2  # n_layer, n_head
    assert kv_bytes_per_token(build_tiny_family("gemma2")) == 2 * 2 * 2 * 16 * 4  # explicit head_dim
    assert kv_capacity(build_tiny_family("llama"), torch.device("cpu"), 0.5, 4096) == (
        4096,
        "inference.max_tokens_in_flight",
    )


def test_weight_update_while_requests_are_preempted(tiny_model):
    """Rows set aside for lack of cache room are running requests too: a weight update ends them
    with "abort" like the rest and agenerate continues them under the new version."""
    from relayrl.api.io import WeightUpdate

    model = copy.deepcopy(tiny_model)
    new_state = {k: v * 1.01 for k, v in model.state_dict().items()}
    engine = LocalEngine(InferenceConfig(device="cpu", seed=1, max_tokens_in_flight=90), model)
    engine.initialize()
    g = GenerationConfig(max_new_tokens=40, temperature=1.0, ignore_eos=True)
    seen = {}
    reached = threading.Event()

    def pause_once_preempted(_module: torch.nn.Module, _args: tuple[torch.Tensor, ...]) -> None:
        """On the loop thread: the engine stops after the first step that runs with rows set aside, however
        late the test thread gets to the update."""
        if engine._preempted and not reached.is_set():
            engine.pause()
            reached.set()

    model.get_input_embeddings().register_forward_pre_hook(pause_once_preempted)

    def update_when_preempted():
        assert reached.wait(60), "no row was ever set aside"
        seen["preempted"] = len(engine._preempted)
        engine.update_weights(WeightUpdate(kind="tensors", version=1, tensors=new_state))
        engine.resume()

    try:
        res = generate(engine, PROMPTS, g, during=update_when_preempted)
    finally:
        engine.destroy()
    assert seen["preempted"] > 0 and engine.counters["aborts"] >= seen["preempted"]
    for r in res:
        assert r.stop_reason == "length" and len(r.output_tokens) == 40
        assert r.output_versions == sorted(r.output_versions) and r.output_versions[-1] == 1


def test_out_of_memory_in_decode_lowers_the_budget_and_continues(tiny_model):
    model = copy.deepcopy(tiny_model)
    calls = {"n": 0}

    def boom(_module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape == (len(PROMPTS), 1):  # a decode step of the full batch
            calls["n"] += 1
            if calls["n"] == 5:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.register_forward_pre_hook(boom, with_kwargs=True)
    engine = LocalEngine(InferenceConfig(device="cpu", seed=3, fast_decode=False, admit_window_ms=50), model)
    engine.initialize()
    try:
        res = generate(engine, PROMPTS, GenerationConfig(max_new_tokens=24, temperature=1.0, ignore_eos=True))
    finally:
        engine.destroy()
    assert calls["n"] >= 5 and engine.counters["preemptions"] >= len(PROMPTS) and engine.counters["aborts"] == 0
    assert engine.kv_capacity < 65536 and "lowered after running out of memory" in engine.kv_capacity_by
    for p, r in zip(PROMPTS, res, strict=True):
        assert r.stop_reason == "length" and len(r.output_tokens) == 24
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs), teacher_forced(tiny_model, p, r.output_tokens), atol=1e-4, rtol=0
        )
