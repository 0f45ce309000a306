"""CUDA-only fast paths fall back to the CPU-tested path when they fail at first use.

The fast paths cannot run here, so each test puts a failing stand-in in the fast path's place
through its declared seam (``train.packing.flash_varlen_impl``, ``train.fastpath.autocast_for``,
``LocalEngine(kernels=...)``, ``WeightBroadcastGroup``'s ``backend``) and shows: one warning naming
the path and the reason, and the run going on with exactly the tested path's results. A correct
stand-in passes its check and stays in use.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
from transformers import AttentionInterface

from relayrl.api.config import ModelConfig, OptimizerConfig, TrainEngineConfig
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
    gap = (got[0] - expected[0]).abs().max().item()
    assert 0 < gap < 0.03  # bf16 rounding (measured ~0.007), so the autocast is really on
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
