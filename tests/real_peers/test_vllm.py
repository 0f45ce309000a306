"""RemoteEngine against a real ``vllm serve`` (vLLM 0.32.0, the CPU build; scripts/peers.sh) serving
the tiny model in fp32 on 127.0.0.1: one server for the module (started with LoRA), restarted once
(kill -9) without LoRA for the tests at the end. Logprobs are checked against a teacher-forced
forward of the same checkpoint in this process."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model, get_peft_model_state_dict

from relayrl.api.config import InferenceConfig, LoraConfig, ModelConfig
from relayrl.api.io import GenerationConfig, ModelRequest, WeightUpdate
from relayrl.data.models import build_tiny_model
from relayrl.inference.remote import RemoteEngine
from tests.real_peers.servers import (
    FREEZE,
    FREEZE_UPDATE,
    TOL,
    RealServer,
    check_freeze_during_update,
    check_freeze_mid_generation,
    check_teacher_server,
    check_versions,
    free_port,
    gap,
    in_flight,
    peer_env,
    peer_environ,
    prompts,
    run,
    vllm_command,
)

pytestmark = pytest.mark.real_peers

LORA = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")
N_LONG = 960  # tokens of the requests a weight update must land in (the server's --max-model-len is 1024)
# rows of those requests: vLLM's step is mostly fixed cost on the tiny model, so 16 rows take longer than 3 only a
# little, but each of the pause's and the update's chances to land mid-generation is worth more (with 3 rows the
# update landed on the 4th try on a quiet machine, never in 4 beside the main suite, CI 2026-11-29)
N_ROWS = 16


@pytest.fixture(scope="module")
def vllm(tiny_dir, tmp_path_factory):
    env = peer_env("vllm")
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    cmd = vllm_command(env, tiny_dir, free_port(), *LORA)
    server = RealServer("vllm", cmd, peer_environ(VLLM_ALLOW_RUNTIME_LORA_UPDATING="True"), log).start()
    yield server
    server.stop()


def engine(server: RealServer, sync_dir: Path, lora: LoraConfig | None = None, **kw) -> RemoteEngine:
    cfg = InferenceConfig(
        **{
            "backend": "remote",
            "protocol": "vllm",
            "weight_sync_dir": str(sync_dir),
            "health_interval": 0.2,
            # a busy machine (the other peer starting beside it) answers /health slowly: only a dead or
            # killed server (connection refused) is evicted here, never a slow one
            "health_timeout": 60,
            "request_timeout": 120,
            "max_retries": 10,
            "batch_window_ms": 0,
            **kw,
        }
    )
    eng = RemoteEngine(cfg, addresses=[server.address], model=ModelConfig(lora=lora or LoraConfig()))
    eng.initialize()
    return eng


def test_generation_and_logprobs_match_a_teacher_forced_forward(vllm, served_model, tmp_path):
    eng = engine(vllm, tmp_path)
    try:
        assert eng.servers[0].info.version == "0.32.0"
        sampled = GenerationConfig(max_new_tokens=24, temperature=0.8, ignore_eos=True)
        greedy = GenerationConfig(max_new_tokens=24, greedy=True, ignore_eos=True)
        outs = run(eng, [(p, sampled) for p in prompts(4)] + [(p, greedy) for p in prompts(2)])
        gaps = [gap(served_model, o, 0.8) for o in outs[:4]] + [gap(served_model, o, 1.0) for o in outs[4:]]
        print(f"vLLM logprob gap to the teacher-forced forward (fp32): max {max(gaps):.2e}")
        assert max(gaps) <= TOL
        for o in outs[4:]:  # greedy: the argmax of each position
            ids = torch.tensor([o.input_tokens + o.output_tokens])
            with torch.inference_mode():
                want = served_model(ids).logits[0, len(o.input_tokens) - 1 : -1].argmax(-1).tolist()
            assert o.output_tokens == want
        assert all(o.output_versions == [0] * 24 and o.stop_reason == "length" for o in outs)
    finally:
        eng.destroy()


def test_n_samples_of_one_prompt_batch_into_one_call_and_stops_end_them(vllm, served_model, tmp_path):
    eng = engine(vllm, tmp_path, batch_window_ms=50)
    try:
        g = GenerationConfig(max_new_tokens=16, temperature=1.0, ignore_eos=True)
        calls = eng.counters["http_calls"]
        outs = run(eng, [(prompts(1)[0], g)] * 4)
        assert eng.counters["http_calls"] - calls == 1  # n=4: one /v1/completions with four prompts
        assert len({tuple(o.output_tokens) for o in outs}) > 1  # independent samples
        assert max(gap(served_model, o, 1.0) for o in outs) <= TOL
        greedy = run(eng, [(prompts(1)[0], GenerationConfig(max_new_tokens=16, greedy=True, ignore_eos=True))])[0]
        stop_at = greedy.output_tokens[5]
        first = greedy.output_tokens.index(stop_at)
        g = GenerationConfig(max_new_tokens=16, greedy=True, stop_token_ids=[stop_at])
        out = run(eng, [(prompts(1)[0], g)])[0]
        assert out.stop_reason == "stop" and out.output_tokens == greedy.output_tokens[: first + 1]
    finally:
        eng.destroy()


def test_pause_with_requests_in_flight_then_resume(vllm, served_model, tmp_path):
    """/pause?mode=abort with N_ROWS requests generating: they come back with their tokens and are held until
    /resume, then continue exactly. Tried up to 8 times until the pause lands mid-generation (4 were not
    enough beside the main suite at a load of ~11, CI 2026-11-29: each time vLLM finished first)."""
    eng = engine(vllm, tmp_path)
    # N_LONG, not 240: vLLM finished 3 x 240 tokens before the pause reached it, 4 times in a row (CI, 2026-11-28)
    g = GenerationConfig(max_new_tokens=N_LONG, temperature=1.0, ignore_eos=True)
    try:
        for tries in range(8):
            results: list = []
            t = threading.Thread(target=lambda out=results: out.extend(run(eng, [(p, g) for p in prompts(N_ROWS)])))
            t.start()
            in_flight(eng, N_ROWS, after_s=0.0, sender=t)
            running(vllm, N_ROWS, t)  # vLLM runs them (sent is not enough: a pause before they run aborts nothing)
            eng.pause()
            try:
                assert httpx.get(vllm.url + "/is_paused", timeout=10).json()["is_paused"] is True
                time.sleep(0.5)
                held = t.is_alive()  # requests it interrupted wait for resume
            finally:
                eng.resume()
            t.join(timeout=120)
            if held:
                print(f"vLLM: the pause landed mid-generation on try {tries + 1}")
                break
        assert held and eng.counters["interrupted"] >= 1
        assert [len(o.output_tokens) for o in results] == [N_LONG] * N_ROWS
        assert max(gap(served_model, o, 1.0) for o in results) <= TOL  # continued exactly where it stopped
    finally:
        eng.destroy()


def test_a_weight_update_mid_generation_tags_every_token_with_its_version(vllm, served_model, tmp_path):
    """Updates (disk, /collective_rpc reload under /pause?mode=abort) while N_ROWS requests generate: every
    token's logprob is that of the weights its version names. Tried up to 8 times until an update
    lands mid-generation: on a quiet machine vLLM finished 3 x 240 tokens before the update (written
    to disk first) reached it, 4 times in a row, so the requests are 960 tokens long."""
    eng = engine(vllm, tmp_path / "w", weight_sync="disk")
    new = build_tiny_model("tiny", seed=3).eval()
    g = GenerationConfig(max_new_tokens=N_LONG, temperature=1.0, ignore_eos=True)
    version = eng.get_version()
    models = {version: served_model}
    try:
        for tries in range(8):
            results: list = []
            t = threading.Thread(target=lambda out=results: out.extend(run(eng, [(p, g) for p in prompts(N_ROWS)])))
            t.start()
            in_flight(eng, N_ROWS, after_s=0.05, sender=t)
            version += 1
            models[version] = new if models[version - 1] is served_model else served_model
            eng.update_weights(WeightUpdate(kind="tensors", version=version, tensors=models[version].state_dict()))
            t.join(timeout=120)
            assert httpx.get(vllm.url + "/weight_info", timeout=10).json()["weight_version"] == str(version)
            if any(len(set(o.output_versions)) > 1 for o in results):
                print(f"vLLM: the update landed mid-generation on try {tries + 1}")
                break
        check_versions(results, models, N_LONG)  # (it also asserts the update landed mid-generation)
    finally:
        eng.update_weights(WeightUpdate(kind="tensors", version=version + 1, tensors=served_model.state_dict()))
        eng.destroy()


def lora_update(base, version: int, seed: int) -> tuple[WeightUpdate, torch.nn.Module]:
    """A rank-8 adapter on every projection (random A and B), as a trainer sends it, and the merged model."""
    import copy

    torch.manual_seed(seed)
    cfg = PeftLoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )  # fmt: skip
    peft_model = get_peft_model(copy.deepcopy(base), cfg)
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    config = cfg.to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    config["peft_type"] = "LORA"
    config["task_type"] = None
    update = WeightUpdate(kind="adapter", version=version, tensors=tensors, adapter_config=json.dumps(config))
    return update, peft_model.merge_and_unload().eval()


def test_lora_adapters_serve_the_merged_model_and_a_new_run_never_reuses_an_old_adapter(vllm, served_model, tmp_path):
    """Two runs sharing a weight_sync_dir and a server (a second run, a resume): each serves its own adapter.
    vLLM answers 400 "already been loaded" for a name it holds; that must not pass for the new adapter."""
    g = GenerationConfig(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    for run_i, seed in enumerate((1, 2)):
        eng = engine(vllm, tmp_path / "w", lora=LoraConfig(rank=8, sync="adapter"))
        try:
            update, merged = lora_update(served_model, version=1, seed=seed)
            eng.update_weights(update)
            outs = run(eng, [(p, g) for p in prompts(3)], prefix=f"run{run_i}-")
            gaps = [gap(merged, o, 1.0) for o in outs]
            print(f"vLLM LoRA run {run_i}: logprob gap to the merged model {max(gaps):.2e}")
            assert max(gaps) <= 1e-4  # vLLM's LoRA kernels add A and B products to fp32 activations
            assert all(o.output_versions == [1] * 12 for o in outs)
        finally:
            eng.destroy()


def test_a_sync_dir_holding_higher_versions_keeps_the_weights_just_written(vllm, served_model, tmp_path):
    """An earlier run left v5 and v6 in weight_sync_dir: the update to v1 must still load v1's weights."""
    root = tmp_path / "w"
    for v in (5, 6):
        (root / f"v{v:08d}").mkdir(parents=True)
        (root / f"v{v:08d}" / "model.safetensors").write_bytes(b"an earlier run's weights")
    eng = engine(vllm, root, weight_sync="disk")
    new = build_tiny_model("tiny", seed=4).eval()
    try:
        eng.update_weights(WeightUpdate(kind="tensors", version=1, tensors=new.state_dict()))
        out = run(eng, [(prompts(1)[0], GenerationConfig(max_new_tokens=8, temperature=1.0, ignore_eos=True))])[0]
        assert gap(new, out, 1.0) <= TOL and out.output_versions == [1] * 8
    finally:
        eng.update_weights(WeightUpdate(kind="tensors", version=2, tensors=served_model.state_dict()))
        eng.destroy()


def metric(server: RealServer, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


KEEP = 200  # tokens of the request that is not cancelled: long enough for running() to see both


def running(server: RealServer, n: int, sender: threading.Thread | None = None) -> None:
    """Wait until vLLM reports ``n`` requests running (scheduled, not only received), or ``sender`` is done."""
    deadline = time.monotonic() + 60
    while metric(server, "vllm:num_requests_running") < n:
        if sender is not None and not sender.is_alive():
            return
        assert time.monotonic() < deadline, f"vLLM never ran {n} requests at once"
        time.sleep(0.02)


@pytest.mark.long  # an abort that reaches vLLM before it schedules the request is ignored (CI failed on it once)
def test_a_cancelled_request_is_aborted_on_the_server(vllm, tmp_path):
    """A caller that gives up (asyncio cancel) while its request's call runs (batch_window_ms > 0: the
    batcher's call, not the caller's): vLLM is told to stop it (/abort_requests) instead of generating it
    to the end. Every token vLLM generates is counted in vllm:generation_tokens_total."""
    eng = engine(vllm, tmp_path, batch_window_ms=50)
    before = metric(vllm, "vllm:generation_tokens_total")

    async def go():
        keep = GenerationConfig(max_new_tokens=KEEP, temperature=1.0, ignore_eos=True)
        drop = GenerationConfig(max_new_tokens=N_LONG, temperature=1.0, ignore_eos=True)  # seconds, not ms
        a = asyncio.ensure_future(eng.agenerate(ModelRequest("keep", prompts(1)[0], keep)))
        b = asyncio.ensure_future(eng.agenerate(ModelRequest("give-up", prompts(2)[1], drop)))
        deadline = time.monotonic() + 60  # cancel once vLLM generates (the batch's call has arrived)
        while await asyncio.to_thread(metric, vllm, "vllm:generation_tokens_total") <= before:
            assert time.monotonic() < deadline, "vLLM generated nothing"
            await asyncio.sleep(0.05)
        b.cancel()
        out = await a
        await asyncio.sleep(0.5)  # the abort call is on its way
        return out

    try:
        assert len(asyncio.run(go()).output_tokens) == KEEP
        deadline = time.monotonic() + 60
        while metric(vllm, "vllm:num_requests_running") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        generated = metric(vllm, "vllm:generation_tokens_total") - before
        assert generated < KEEP + N_LONG, "the cancelled request ran to its end on the server"
    finally:
        eng.destroy()


def test_kill_9_during_an_update_then_readmission_without_lora(vllm, served_model, tmp_path):
    """The only server dies (SIGKILL) while weights are being updated: the update waits for it within
    server_wait_timeout, the server comes back (here without --enable-lora), is re-admitted and given the weights.
    Then model.lora.sync=auto on this server, which has the adapter route (runtime updating allowed) but
    no --enable-lora, falls back to merged weights."""
    eng = engine(vllm, tmp_path / "w", weight_sync="disk", max_retries=40, server_wait_timeout=600)
    new = build_tiny_model("tiny", seed=5).eval()
    try:
        vllm.kill9()
        done: list = []
        t = threading.Thread(
            target=lambda: done.append(
                eng.update_weights(WeightUpdate(kind="tensors", version=1, tensors=new.state_dict()))
            )
        )
        t.start()
        cmd = [c for c in vllm.cmd if c not in LORA]
        vllm.restart(cmd)
        t.join(timeout=180)
        assert done == [None], "update_weights did not complete after the server came back"
        assert eng.live_servers() == [vllm.url] and eng.counters["readmissions"] >= 1
        assert httpx.get(vllm.url + "/weight_info", timeout=10).json()["weight_version"] == "1"
        out = run(eng, [(prompts(1)[0], GenerationConfig(max_new_tokens=8, temperature=1.0, ignore_eos=True))])[0]
        assert gap(new, out, 1.0) <= TOL and out.output_versions == [1] * 8
    finally:
        eng.destroy()
    auto = engine(vllm, tmp_path / "w2", lora=LoraConfig(rank=8, sync="auto"))
    try:
        assert not auto.accepts_adapters  # --enable-lora missing: merged weights instead
    finally:
        auto.destroy()
    assert re.search(r"/v1/load_lora_adapter", json.dumps(httpx.get(vllm.url + "/openapi.json").json()["paths"]))


def test_a_distillation_teacher_on_vllm_gives_the_forward_top_k(vllm, served_model, tmp_path):
    eng = engine(vllm, tmp_path / "reset")  # earlier tests leave other weights on the module's server
    try:
        eng.update_weights(
            WeightUpdate(kind="tensors", version=eng.get_version() + 1, tensors=served_model.state_dict())
        )
    finally:
        eng.destroy()
    check_teacher_server(vllm.url, "vllm", served_model)


@pytest.mark.timeout(400)
def test_a_server_frozen_mid_generation_stops_the_wait_with_one_line_then_comes_back(vllm, tmp_path):
    """#40: vLLM SIGSTOPped (every process of it) with requests running
    (servers.check_freeze_mid_generation)."""
    eng = engine(vllm, tmp_path, **FREEZE)
    try:
        took = check_freeze_mid_generation(vllm, eng, N_LONG)
    finally:
        eng.destroy()
    print(f"vllm frozen mid-generation: Stalled {took:.1f}s after the freeze")
    assert took < 120  # health_timeout 5 s + server_wait_timeout 10 s, far from the test's own timeout


@pytest.mark.timeout(400)
def test_a_server_frozen_during_a_disk_load_stops_the_update_with_one_line_then_comes_back_with_the_weights(
    vllm, tmp_path
):
    """#40: vLLM SIGSTOPped as its disk load (``/collective_rpc``) is sent (servers.check_freeze_during_update)."""
    eng = engine(vllm, tmp_path / "w", weight_sync="disk", **FREEZE_UPDATE)
    try:
        took = check_freeze_during_update(vllm, eng, build_tiny_model("tiny", seed=7).eval(), "/collective_rpc")
    finally:
        eng.destroy()
    print(f"vllm frozen during a disk load: Stalled {took:.1f}s after the freeze")
    assert took < 120  # request_timeout 5 s + server_wait_timeout 5 s, far from the test's own timeout
