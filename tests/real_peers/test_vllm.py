"""RemoteEngine against a real ``vllm serve`` (vLLM 0.32.0, the CPU build; scripts/peers.sh) serving
the tiny model in fp32 on 127.0.0.1: one server for the module (started with LoRA), restarted once
(kill -9) without LoRA for the tests at the end. Logprobs are checked against a teacher-forced
forward of the same checkpoint in this process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model, get_peft_model_state_dict

from relayrl.api.config import InferenceConfig, LoraConfig, ModelConfig
from relayrl.api.io import GenerationConfig, ModelRequest, ModelResponse, WeightUpdate
from relayrl.data.models import build_tiny_model
from relayrl.inference.remote import RemoteEngine
from relayrl.inference.remote.protocol import Call, Server
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
N_ROWS = 4  # rows of those requests
TRIES = 6  # of landing a pause mid-generation (``generating_when_paused``): one lost in three under four CPU burners


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
    /resume, then continue exactly. The pause is made to land mid-generation (``generating_when_paused``); a
    try that still loses (the requests were done first) is tried again, up to TRIES times."""
    eng = engine(vllm, tmp_path)
    g = GenerationConfig(max_new_tokens=N_LONG, temperature=1.0, ignore_eos=True)
    try:
        for _ in range(TRIES):
            sender, results = generating_when_paused(vllm, eng, g, eng.pause)
            try:
                assert httpx.get(vllm.url + "/is_paused", timeout=10).json()["is_paused"] is True
                time.sleep(0.5)
                held = sender.is_alive()  # the requests it interrupted wait for resume
            finally:
                eng.resume()
            sender.join(timeout=120)
            if eng.counters["interrupted"]:
                break
        assert eng.counters["interrupted"] >= 1 and held, eng.counters
        assert [len(o.output_tokens) for o in results] == [N_LONG] * N_ROWS
        assert max(gap(served_model, o, 1.0) for o in results) <= TOL  # continued exactly where it stopped
    finally:
        eng.destroy()


# In `--all`, not CI: beside CPU burners (two or four) its update missed the middle of generation on all 6 tries
# in one run of three (2026-11-29; the pause test above lands), cause not found. CI keeps the same check against
# the vLLM stand-in (tests/test_peers.py::test_vllm_tokens_keep_the_version_that_generated_them_across_a_reload)
# and against real SGLang (tests/real_peers/test_sglang.py, the test of this name).
@pytest.mark.long
def test_a_weight_update_mid_generation_tags_every_token_with_its_version(vllm, served_model, tmp_path):
    """Updates (disk, /collective_rpc reload under /pause?mode=abort) while N_ROWS requests generate: every
    token's logprob is that of the weights its version names. The update's pause is made to land mid-generation
    (``generating_when_paused``); a try that still loses is tried again, up to TRIES times."""
    eng = engine(vllm, tmp_path / "w", weight_sync="disk")
    new = build_tiny_model("tiny", seed=3).eval()
    g = GenerationConfig(max_new_tokens=N_LONG, temperature=1.0, ignore_eos=True)
    version = eng.get_version()
    models = {version: served_model}
    try:
        for _ in range(TRIES):
            version += 1
            models[version] = new if models[version - 1] is served_model else served_model
            update = WeightUpdate(kind="tensors", version=version, tensors=models[version].state_dict())
            sender, results = generating_when_paused(vllm, eng, g, lambda u=update: eng.update_weights(u))
            sender.join(timeout=120)
            assert httpx.get(vllm.url + "/weight_info", timeout=10).json()["weight_version"] == str(version)
            if any(len(set(o.output_versions)) > 1 for o in results):
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


KEEP = 200  # tokens of the request that is not cancelled


def generating_when_paused(
    server: RealServer, eng: RemoteEngine, g: GenerationConfig, act: Callable[[], None]
) -> tuple[threading.Thread, list[ModelResponse]]:
    """Send N_ROWS requests of ``g`` and run ``act`` (``eng.pause``, a weight update: anything that sends vLLM
    ``/pause``) aiming its pause at the middle of their generation; the thread sending them (still running when
    it landed there: an aborted request waits for ``/resume``) and the list it fills.

    Looking at ``/metrics`` and then pausing lost the race beside the main suite on 8 tries in a row (CI,
    2026-11-29): the engine-core process generated the 960 tokens before the starved API server reported them.
    So vLLM's engine core (``VLLM::EngineCore``) is stopped (SIGSTOP) before the requests are sent and continued
    0.1 s at a time until it has generated tokens (read while it is stopped, once the API server has caught up:
    ``generated``); it stays stopped while ``act`` runs up to its ``/pause`` and 2 s after (the API server passes
    the pause on), so the pause is waiting for it when it goes on, hundreds of steps from the end. It can still
    lose on a loaded machine: while vLLM generates, other processes can stall for seconds (measured with four
    CPU burners beside it: a 0.1 s window lasted 3.5-4.8 s in one try of three, for this process, for a shell of
    its own session and with vLLM at nice 19 alike), so the window holds the whole generation."""
    (core,) = server.group_pids(b"VLLM::EngineCore")
    sent, admin, errors, results = threading.Event(), eng.admin, [], []

    def spy(srv: Server, call: Call, *args: object, **kwargs: object) -> object:
        if call.path.startswith("/pause"):
            sent.set()
        return admin(srv, call, *args, **kwargs)  # type: ignore[arg-type]

    def call() -> None:
        try:
            act()
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread below
            errors.append(e)

    sender = threading.Thread(target=lambda: results.extend(run(eng, [(p, g) for p in prompts(N_ROWS)])))
    worker = threading.Thread(target=call)
    eng.admin = spy  # type: ignore[method-assign]
    try:
        os.kill(core, signal.SIGSTOP)
        try:
            before = generated(server)
            sender.start()
            in_flight(eng, N_ROWS, after_s=0.0)
            deadline = time.monotonic() + 120
            while generated(server) == before:
                assert time.monotonic() < deadline, "vLLM generated nothing"
                os.kill(core, signal.SIGCONT)
                time.sleep(0.1)
                os.kill(core, signal.SIGSTOP)
            worker.start()
            assert sent.wait(120), "the pause was never sent"
            time.sleep(2.0)
        finally:
            os.kill(core, signal.SIGCONT)  # never left stopped
        worker.join(timeout=300)
    finally:
        del eng.admin  # the method again
    assert not worker.is_alive(), "the pause (or update) did not return"
    if errors:
        raise errors[0]
    return sender, results


def generated(server: RealServer) -> float:
    """The tokens vLLM has generated, once the API server has handled every output of a stopped engine core
    (the same count twice in a row)."""
    before = metric(server, "vllm:generation_tokens_total")
    while True:
        time.sleep(0.05)
        now = metric(server, "vllm:generation_tokens_total")
        if now == before:
            return now
        before = now


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
