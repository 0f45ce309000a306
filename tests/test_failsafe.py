"""CUDA-only fast paths fall back to the CPU-tested path when they fail at first use.

The fast paths cannot run here, so each test puts a failing stand-in in the fast path's place
through its declared seam (``train.packing.flash_varlen_impl``, ``train.fastpath.autocast_for``,
``LocalEngine(kernels=...)``, ``WeightBroadcastGroup``'s ``backend``) and shows: one warning naming
the path and the reason, and the run going on with exactly the tested path's results. A correct
stand-in passes its check and stays in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import re
import sys

import pytest
import torch
from torch.nn import functional
from transformers import AttentionInterface

from relayrl.api.config import InferenceConfig, ModelConfig, OptimizerConfig, TrainEngineConfig
from relayrl.api.io import GenerationConfig, ModelRequest, WeightUpdate
from relayrl.data.models import build_tiny_model
from relayrl.inference.local import LocalEngine, decode
from relayrl.inference.local import memory as local_memory
from relayrl.inference.local.decode import PACKED, FastDecoder, SlabLayer
from relayrl.inference.local.graphs import CUDA_GRAPHS, FLASH_DECODE, Kernels, StaticDecoder
from relayrl.inference.remote import sglang as sglang_peer
from relayrl.inference.remote import vllm_transfer
from relayrl.inference.remote.engine import RemoteEngine
from relayrl.inference.server.launcher import launch_servers
from relayrl.train import fastpath, packing
from relayrl.train.engine import TorchTrainEngine
from relayrl.utils import failsafe
from tests.test_packing import make_batch
from tests.test_train_engine import LENGTHS, n_loss_tokens, pg_loss


@pytest.fixture(autouse=True)
def fresh_fallbacks(monkeypatch, caplog):
    monkeypatch.setattr(failsafe, "FALLBACKS", {})
    caplog.set_level(logging.WARNING, logger="relayrl.failsafe")


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "relayrl.failsafe"]


def engine(model, attn_impl: str = "auto", bf16: bool = False) -> TorchTrainEngine:
    cfg = TrainEngineConfig(mb_max_tokens=100_000, optimizer=OptimizerConfig(lr=1e-3), total_steps=10, bf16=bf16)
    eng = TorchTrainEngine(cfg, ModelConfig(attn_impl=attn_impl), model=copy.deepcopy(model))
    eng.initialize()
    return eng


def run(eng: TorchTrainEngine) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """Logprobs, one training step's stats, logprobs after the step."""
    batch = make_batch(LENGTHS, seed=1)
    before = eng.forward(batch)
    stats = eng.train_batch(batch, pg_loss, n_loss_tokens)
    return before, stats, eng.forward(batch)


def broken_import(*args, **kwargs):
    raise ImportError("flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c10")


def broken_numbers(module, query, key, value, attention_mask, **kwargs):
    """A kernel that runs but returns garbage (a wrong layout, a bad build): zeros."""
    return torch.zeros_like(query).transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("kernel", [broken_import, broken_numbers], ids=["raises", "wrong_numbers"])
def test_a_failing_flash_varlen_kernel_falls_back_to_varlen_attention(tiny_model, monkeypatch, caplog, kernel):
    expected = run(engine(tiny_model, attn_impl="varlen"))
    AttentionInterface.register("broken_kernel", kernel)
    monkeypatch.setattr(packing, "flash_varlen_impl", lambda device: "broken_kernel")
    eng = engine(tiny_model)  # attn_impl=auto picks the seam's kernel (transformers refuses names with "flash")
    assert eng.model.config._attn_implementation == "broken_kernel"
    got = run(eng)
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    assert got[1] == expected[1]
    torch.testing.assert_close(got[2], expected[2], atol=0, rtol=0)
    (message,) = warnings_of(caplog)
    assert message.startswith(fastpath.FLASH_VARLEN + " failed at first use")
    assert ("undefined symbol" if kernel is broken_import else "differs from the tested path's by") in message
    assert list(failsafe.FALLBACKS) == [fastpath.FLASH_VARLEN]


def test_a_correct_flash_stand_in_passes_its_check_and_stays_in_use(tiny_model, monkeypatch, caplog):
    calls = []

    def stand_in(*args, **kwargs):  # flash-attn's varlen contract (cu_seq_lens_q), computed as relayrl_varlen does
        calls.append(1)
        return packing.varlen_attention_forward(*args, **kwargs)

    AttentionInterface.register("kernel_stand_in", stand_in)
    monkeypatch.setattr(packing, "flash_varlen_impl", lambda device: "kernel_stand_in")
    eng = engine(tiny_model)
    expected = run(engine(tiny_model, attn_impl="varlen"))
    got = run(eng)
    assert eng.model.config._attn_implementation == "kernel_stand_in" and len(calls) > 3 * 4  # every layer, every pass
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    assert not warnings_of(caplog) and not failsafe.FALLBACKS


def test_a_failing_bf16_autocast_falls_back_to_fp32(tiny_model, monkeypatch, caplog):
    @contextlib.contextmanager
    def unsupported():
        raise RuntimeError("Current CUDA Device does not support bfloat16. Please switch dtype to float16.")
        yield

    expected = run(engine(tiny_model))
    monkeypatch.setattr(fastpath, "autocast_for", lambda device: unsupported())
    got = run(engine(tiny_model, bf16=True))
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    assert got[1] == expected[1]
    (message,) = warnings_of(caplog)
    assert message.startswith(fastpath.BF16_AUTOCAST + " failed at first use (RuntimeError: Current CUDA Device")


def test_a_working_bf16_autocast_stays_in_use_within_rounding_of_fp32(tiny_model, monkeypatch, caplog):
    expected = run(engine(tiny_model))
    monkeypatch.setattr(fastpath, "autocast_for", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
    got = run(engine(tiny_model, bf16=True))
    gap = (got[0] - expected[0]).abs()
    # bf16 rounding of the tiny model's logprobs (measured max 0.0062, mean 0.00094): the autocast is really on,
    # and its results are fp32's within rounding
    assert 0.003 < gap.max().item() < 0.012 and 4e-4 < gap.mean().item() < 2e-3
    assert not warnings_of(caplog)


def test_a_corrupting_bf16_autocast_fails_its_check(tiny_model, monkeypatch, caplog):
    vocab = tiny_model.config.vocab_size

    @contextlib.contextmanager
    def corrupting():  # autocast whose output head comes out scrambled (as an overflowing kernel's would)
        def scramble(module, args, out):
            return out.flip(-1) if isinstance(module, torch.nn.Linear) and module.out_features == vocab else out

        with torch.autocast("cpu", dtype=torch.bfloat16):
            hook = torch.nn.modules.module.register_module_forward_hook(scramble)
            try:
                yield
            finally:
                hook.remove()

    expected = run(engine(tiny_model))
    monkeypatch.setattr(fastpath, "autocast_for", lambda device: corrupting())
    got = run(engine(tiny_model, bf16=True))
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    assert got[1] == expected[1]
    (message,) = warnings_of(caplog)
    assert fastpath.BF16_AUTOCAST in message and "differs from the tested path's by" in message


# ---------------------------------------------------------------- LocalEngine's static decode step

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 50)), [3, 4, 5, 6], [40, 41, 42, 43, 44]]
NEW = (30, 7, 19, 3, 25)  # rows leave at different steps: the batch is laid out again each time


def generate(model, static: bool, kernels: Kernels | None = None, cuda_graphs: bool = True):
    eng = LocalEngine(
        InferenceConfig(cuda_graphs=cuda_graphs), copy.deepcopy(model), static_steps=static, kernels=kernels
    )
    eng.initialize()

    async def go():
        reqs = [
            ModelRequest(str(i), p, GenerationConfig(max_new_tokens=n, greedy=True, ignore_eos=True))
            for i, (p, n) in enumerate(zip(PROMPTS, NEW, strict=True))
        ]
        return await asyncio.gather(*(eng.agenerate(r) for r in reqs))

    try:
        return asyncio.run(go()), eng._static
    finally:
        eng.destroy()


def same_as(a, b) -> None:
    assert [r.output_tokens for r in a] == [r.output_tokens for r in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(x.output_logprobs), torch.tensor(y.output_logprobs), atol=1e-5, rtol=0)


def test_cpu_decode_steps_use_packed_weights_and_generate_as_the_plain_product(tiny_model, caplog):
    """oneDNN's packed weights (the CPU decode step's default) give the same greedy tokens and
    logprobs (1e-5) as ``functional.linear`` over the same weights (forced here as after a fallback)."""
    fast = FastDecoder(copy.deepcopy(tiny_model))
    assert fast.linear is decode.packed_linear and fast.head is not None
    assert all(w.is_mkldnn for layer in fast.layers for w in (layer[1], layer[3], layer[6], layer[8]))
    packed, _ = generate(tiny_model, static=False)
    failsafe.FALLBACKS[PACKED] = "forced by the test"
    assert FastDecoder(copy.deepcopy(tiny_model)).linear is functional.linear
    plain, _ = generate(tiny_model, static=False)
    same_as(packed, plain)
    assert not warnings_of(caplog)


def test_a_forward_hook_on_the_lm_head_still_applies_with_packed_weights(tiny_model):
    """The packed step calls the LM head's kernel itself; a hook on ``lm_head`` (bench/generation.py's
    EOS bias, a user's logit processor) must still see every step, so the step then calls the module."""
    model = copy.deepcopy(tiny_model)
    model.lm_head.register_forward_hook(
        lambda module, args, out: out.index_add(-1, torch.tensor([5]), out[..., :1] * 0 + 1e4)
    )
    got, _ = generate(model, static=False)
    assert all(set(r.output_tokens) == {5} for r in got)


def pack_raises(w, rows=64):
    raise RuntimeError("could not create a primitive descriptor for a reorder primitive")


def packed_wrong(x, w, b):
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "") * 1.5  # a kernel with a wrong scale


@pytest.mark.parametrize("kernel", ["raises", "wrong_numbers"])
def test_a_failing_packed_kernel_falls_back_to_the_plain_product(tiny_model, monkeypatch, caplog, kernel):
    failsafe.FALLBACKS[PACKED] = "forced by the test"
    plain, _ = generate(tiny_model, static=False)
    del failsafe.FALLBACKS[PACKED]
    monkeypatch.setattr(
        decode, "pack" if kernel == "raises" else "packed_linear", {"raises": pack_raises}.get(kernel, packed_wrong)
    )
    got, _ = generate(tiny_model, static=False)
    same_as(got, plain)
    (message,) = warnings_of(caplog)
    assert message.startswith(PACKED + " failed at first use")
    assert ("primitive descriptor" if kernel == "raises" else "differs from functional.linear's by") in message
    assert list(failsafe.FALLBACKS) == [PACKED]
    assert FastDecoder(copy.deepcopy(tiny_model)).linear is functional.linear  # not tried again in this process


def eager_capture(device):
    """A capture that works: the "graph" replays the step eagerly into the same output buffer."""

    def capture(run):
        out = run()
        return (lambda: out.copy_(run())), out

    return capture


def capture_raises(device):
    def capture(run):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    return capture


def capture_stale(device):
    """A graph that replays nothing: its output buffer keeps the warm-up's logits (a capture that
    recorded the wrong stream)."""

    def capture(run):
        out = run().clone().fill_(0.0)
        return (lambda: None), out

    return capture


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, cache_leftpad, softmax_scale, causal):
    """Stand-in for flash-attn 2.7.4's ``flash_attn_with_kvcache`` (decode, no new k/v passed):
    q [b, 1, H, D], caches [b, L, H_kv, D]; row i attends to cache columns [cache_leftpad[i],
    cache_seqlens[i]); query head h reads kv head h // (H / H_kv)."""
    b, _, heads, d = q.shape
    k = k_cache.repeat_interleave(heads // k_cache.shape[2], dim=2)
    v = v_cache.repeat_interleave(heads // v_cache.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * softmax_scale
    cols = torch.arange(k.shape[1], device=q.device)
    keep = (cols[None] >= cache_leftpad[:, None]) & (cols[None] < cache_seqlens[:, None])
    probs = scores.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(q.dtype)


def flash_import_fails():
    raise ImportError("libcudart.so.12: cannot open shared object file: No such file or directory")


def flash_ignores_left_padding():
    """A kernel (or a call) without ``cache_leftpad``: rows attend to their padding columns too."""

    def kernel(q, k_cache, v_cache, cache_leftpad, **kw):
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_leftpad=torch.zeros_like(cache_leftpad), **kw)

    return kernel


@pytest.mark.parametrize("capture", [capture_raises, capture_stale], ids=["raises", "stale_output"])
def test_a_failing_graph_capture_falls_back_to_eager_steps(tiny_model, caplog, capture):
    eager, _ = generate(tiny_model, static=False)
    got, dec = generate(tiny_model, static=True, kernels=Kernels(capture=capture))
    same_as(got, eager)
    assert dec.capture is False and dec.graphs == {}
    (message,) = warnings_of(caplog)
    assert message.startswith(CUDA_GRAPHS + " failed at first use")
    assert ("operation not permitted" if capture is capture_raises else "differs from eager steps's by") in message
    # inference.cuda_graphs=false: the capture is never tried
    got, dec = generate(tiny_model, static=True, kernels=Kernels(capture=capture), cuda_graphs=False)
    same_as(got, eager)
    assert dec.captures == 0 and len(warnings_of(caplog)) == 1


def test_a_working_capture_is_replayed_for_every_bucket(tiny_model, caplog):
    eager, _ = generate(tiny_model, static=False)
    got, dec = generate(tiny_model, static=True, kernels=Kernels(capture=eager_capture))
    same_as(got, eager)
    assert dec.capture is True and dec.captures == len(dec.graphs) >= 3  # 5, 4, 2 and 1 rows: buckets 8, 4, 2, 1
    assert not warnings_of(caplog)


def test_flash_decode_stand_in_equals_sdpa_with_left_padded_rows(tiny_model, caplog):
    """flash-attn's argument layout, GQA head order and per-row left padding, checked on CPU."""
    eager, _ = generate(tiny_model, static=False)
    got, dec = generate(tiny_model, static=True, kernels=Kernels(flash_decode=lambda: flash_attn_with_kvcache))
    assert dec.attention == "flash_attn"
    same_as(got, eager)
    assert not warnings_of(caplog)


@pytest.mark.parametrize(
    "loader", [flash_import_fails, flash_ignores_left_padding], ids=["import_fails", "wrong_numbers"]
)
def test_a_failing_flash_decode_kernel_falls_back_to_sdpa(tiny_model, caplog, loader):
    eager, _ = generate(tiny_model, static=False)
    got, dec = generate(tiny_model, static=True, kernels=Kernels(capture=eager_capture, flash_decode=loader))
    same_as(got, eager)
    assert dec.attention == "sdpa" and dec.capture is True  # the graphs passed their own check
    (message,) = warnings_of(caplog)
    assert message.startswith(FLASH_DECODE + " failed at first use")
    assert ("libcudart" if loader is flash_import_fails else "differs from SDPA's by") in message


def static_decoder(model, kernels: Kernels) -> StaticDecoder:
    return StaticDecoder(FastDecoder(copy.deepcopy(model)), kernels)


def slab(model, n: int, width: int) -> list[SlabLayer]:
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    shape = (n, cfg.num_key_value_heads, width, d)
    return [
        SlabLayer(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        for _ in range(cfg.num_hidden_layers)
    ]


def test_flash_decode_needs_left_padded_rows_else_sdpa(tiny_model, caplog):
    """A row whose cached columns are not its right end (a hole) cannot be told to flash-attn by a
    left padding: the decoder says so once and uses SDPA, which reads the mask."""
    mask = torch.tensor([[False, True, True, True], [True, False, True, True]])
    dec = static_decoder(tiny_model, Kernels(flash_decode=lambda: flash_attn_with_kvcache))
    dec.load(slab(tiny_model, 2, 4), mask, torch.tensor([3, 3]))
    assert dec.attention == "sdpa"
    (message,) = warnings_of(caplog)
    assert "the batch's cached columns are not each row's right end" in message
    ok = static_decoder(tiny_model, Kernels(flash_decode=lambda: flash_attn_with_kvcache))
    ok.load(slab(tiny_model, 2, 4), torch.tensor([[False, True, True, True], [True] * 4]), torch.tensor([3, 4]))
    assert ok.attention == "flash_attn" and ok._rows[2 * ok.b : 2 * ok.b + 2].tolist() == [1, 0]  # left padding


def test_padding_rows_do_not_reuse_a_former_rows_ids(tiny_model):
    dec = static_decoder(tiny_model, Kernels())
    layers = dec.load(slab(tiny_model, 4, 5), torch.ones(4, 5, dtype=torch.bool), torch.full((4,), 5))
    with torch.inference_mode():
        dec.step(torch.tensor([7, 8, 9, 10]), torch.full((4,), 5), layers)
    dec.load(slab(tiny_model, 3, 5), torch.ones(3, 5, dtype=torch.bool), torch.full((3,), 5))  # bucket 4, row 3 pads
    assert dec.b == 4 and dec._rows[3].item() == 0 and dec._rows[dec.b + 3].item() == 0  # token and position


# ---------------------------------------------------------------- release_memory(weights=True)


def released_and_resumed(model, mover=None, monkeypatch=None):
    """Greedy outputs of PROMPTS with a release_memory(weights=True) / resume_memory() between two halves."""
    if mover is not None:
        monkeypatch.setattr(local_memory, "move_weights", mover)
    eng = LocalEngine(InferenceConfig(), copy.deepcopy(model))
    eng.initialize()
    g = GenerationConfig(max_new_tokens=6, greedy=True, ignore_eos=True)

    def half(tag):
        async def go():
            return await asyncio.gather(
                *(eng.agenerate(ModelRequest(f"{tag}{i}", p, g)) for i, p in enumerate(PROMPTS))
            )

        return asyncio.run(go())

    try:
        first = half("a")
        eng.release_memory(weights=True)
        eng.resume_memory()
        return first + half("b"), eng
    finally:
        eng.destroy()


def test_a_failing_move_off_the_device_keeps_the_weights_in_place(tiny_model, monkeypatch, caplog):
    expected, _ = released_and_resumed(tiny_model)
    moves = []

    def pinned_memory_exhausted(model, device):
        moves.append(device.type)
        if len(moves) == 1:  # the move to host memory (here the engine's device is the CPU too)
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc, pinned host memory)")
        model.to(device)

    got, eng = released_and_resumed(tiny_model, pinned_memory_exhausted, monkeypatch)
    same_as(got, expected)
    assert moves == ["cpu", "cpu"]  # the failed move, then the weights put back where they were
    (message,) = warnings_of(caplog)
    assert message.startswith(local_memory.OFFLOAD + " failed at first use (RuntimeError: CUDA error: out of memory")
    eng.release_memory(weights=True)  # not tried again
    assert moves == ["cpu", "cpu"] and len(warnings_of(caplog)) == 1


def test_weights_that_come_back_changed_stop_generation_with_a_clear_error(tiny_model, monkeypatch):
    def lossy(model, device):  # e.g. a copy through a wrong dtype: the weights come back rounded
        model.to(device)
        if device.type == "cpu":
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())

    with pytest.raises(RuntimeError, match=r"moving weights off the device .* the weights came back changed"):
        released_and_resumed(tiny_model, lossy, monkeypatch)


# ---------------------------------------------------------------- NCCL weight group


def test_a_failing_nccl_weight_group_falls_back_to_gloo(tiny_model, monkeypatch, caplog):
    """NCCL put in the way through the seam: on CPU it fails at first use (no CUDA), as a broken NCCL
    would; the group is built again over gloo with the real server, and the weights arrive."""
    monkeypatch.setattr(sglang_peer, "broadcast_backend", lambda peer: "nccl")
    group = launch_servers(1, admin_token="tok")
    cfg = InferenceConfig(backend="remote", admin_token="tok", weight_sync="broadcast", request_timeout=60)
    eng = RemoteEngine(cfg, addresses=group.addresses)
    new = build_tiny_model("tiny", seed=2).eval()
    g = GenerationConfig(max_new_tokens=8, greedy=True, ignore_eos=True)

    async def outputs(engine):
        return [
            r.output_tokens
            for r in await asyncio.gather(
                *(engine.agenerate(ModelRequest(str(i), p, g)) for i, p in enumerate(PROMPTS))
            )
        ]

    try:
        eng.initialize()
        eng.update_weights(WeightUpdate(kind="tensors", version=5, tensors=new.state_dict()))
        got = asyncio.run(outputs(eng))
        eng.update_weights(WeightUpdate(kind="tensors", version=6, tensors=new.state_dict()))  # the gloo group again
        assert eng.get_version() == 6
    finally:
        eng.destroy()
        group.shutdown()
    local = LocalEngine(InferenceConfig(), copy.deepcopy(new))
    local.initialize()
    try:
        assert got == asyncio.run(outputs(local))
    finally:
        local.destroy()
    (message,) = warnings_of(caplog)
    assert message.startswith(
        sglang_peer.NCCL_GROUP + " failed at first use (RuntimeError: a weight group with backend='nccl' needs CUDA"
    )


def test_a_failing_vllm_nccl_transfer_falls_back_to_disk_reloads(tiny_model, monkeypatch, caplog, tmp_path):
    """vLLM has no gloo transfer: when its NCCL transfer fails at first use (here vLLM's trainer helpers do
    not import, as in a trainer without vllm installed), updates reload from inference.weight_sync_dir through
    /collective_rpc, with one warning; without that directory the error says what to set."""
    from tests.peers import start
    from tests.test_remote import greedy, prompts, reference, run_all

    monkeypatch.setattr(vllm_transfer, "transfer_backend", lambda: "nccl")
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.nccl_engine", None)  # its import fails
    nccl = ("--weight-transfer-config", '{"backend": "nccl"}')
    peer = start("vllm", "--logprobs-mode", "processed_logprobs", *nccl, env={"VLLM_SERVER_DEV_MODE": "1"})
    new = build_tiny_model("tiny", seed=2).eval()
    fields = dict(backend="remote", protocol="vllm", weight_sync="broadcast", request_timeout=60, batch_window_ms=0)
    try:
        bare = RemoteEngine(InferenceConfig(**fields), addresses=[peer.address])
        bare.initialize()
        try:
            refusal = (
                "^" + re.escape(vllm_transfer.NCCL_TRANSFER) + " failed at first use .*set inference.weight_sync_dir"
            )
            with pytest.raises(RuntimeError, match=refusal) as e:
                bare.update_weights(WeightUpdate(kind="tensors", version=1, tensors=new.state_dict()))
            assert "\n" not in str(e.value) and not warnings_of(caplog)
        finally:
            bare.destroy()
        eng = RemoteEngine(InferenceConfig(**fields, weight_sync_dir=str(tmp_path)), addresses=[peer.address])
        eng.initialize()
        try:
            for version, model in ((1, new), (2, tiny_model)):
                eng.update_weights(WeightUpdate(kind="tensors", version=version, tensors=model.state_dict()))
                outs = run_all(eng, prompts(3), greedy(6), prefix=f"v{version}")
                assert [o.output_tokens for o in outs] == [
                    r.output_tokens for r in reference(model, prompts(3), greedy(6))
                ]
                assert all(o.output_versions == [version] * 6 for o in outs)
            assert peer.get("/weight_info").json()["weight_version"] == "2"
        finally:
            eng.destroy()
        counts = peer.get("/stand_in").json()["counts"]
        assert (counts["init"], counts["updates"]) == (0, 0)  # no transfer group: both updates were disk reloads
        assert sorted(p.name for p in tmp_path.glob("v*")) == ["v00000001", "v00000002"]
    finally:
        peer.stop()
    (message,) = warnings_of(caplog)
    assert message.startswith(
        vllm_transfer.NCCL_TRANSFER + " failed at first use (RuntimeError: weight_sync=broadcast to vLLM over NCCL"
    )
    assert message.endswith(
        f"using disk reloads from inference.weight_sync_dir ({tmp_path}) through /collective_rpc instead"
    )
