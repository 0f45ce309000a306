"""LoRA and a real `relayrl serve` process: the server starts from a base plus a peft adapter
(``model.lora.adapter_path``, what ``--lora-adapter`` sets) and takes a LoRA trainer's merged
weights with the trainer's version, generating what the merged model generates."""

from __future__ import annotations

import copy

import pytest
from peft import PeftModel

from relayrl.api.io import SaveLoadMeta
from relayrl.inference.server.launcher import launch_servers
from tests.test_lora import lora_engine
from tests.test_packing import make_batch
from tests.test_remote import TOKEN, greedy, make_engine, prompts, reference, run_all
from tests.test_train_engine import LENGTHS, n_loss_tokens, pg_loss


def test_serve_base_plus_adapter_and_merged_weight_updates(tiny_model, tmp_path):
    eng = lora_engine(tiny_model, lr=3e-2)
    eng.train_batch(make_batch(LENGTHS, seed=2), pg_loss, n_loss_tokens)
    adapter = tmp_path / "adapter"
    eng.save(SaveLoadMeta(str(adapter)))
    ps, g = prompts(6), greedy(6)
    base_out = reference(tiny_model, ps, g)
    first = reference(PeftModel.from_pretrained(copy.deepcopy(tiny_model), str(adapter)).merge_and_unload(), ps, g)
    assert [o.output_tokens for o in first] != [o.output_tokens for o in base_out]  # the adapter matters

    roots = f"allowed_weight_roots=['{tmp_path}']"
    group = launch_servers(1, admin_token=TOKEN, overrides=[f"model.lora.adapter_path={adapter}", roots])
    try:
        remote = make_engine(group, tmp_path)
        try:
            for out, ref in zip(run_all(remote, ps, g), first, strict=True):
                assert out.output_tokens == ref.output_tokens
                assert out.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-4)
            eng.train_batch(make_batch(LENGTHS, seed=3), pg_loss, n_loss_tokens)
            eng.set_version(5)
            eng.update_weights(remote)  # merged on the fly into new tensors, sent over HTTP
            assert remote.get_version() == 5
            second = reference(copy.deepcopy(eng.model).merge_and_unload(), ps, g)
            for out, ref in zip(run_all(remote, ps, g, prefix="v5-"), second, strict=True):
                assert out.output_tokens == ref.output_tokens and out.output_versions == [5] * 6
                assert out.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-4)
        finally:
            remote.destroy()
    finally:
        group.shutdown()
