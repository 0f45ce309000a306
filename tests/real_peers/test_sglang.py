"""RemoteEngine against a real SGLang 0.5.23 server (``python -m sglang.launch_server`` on CPU,
scripts/peers.sh) serving the tiny model in fp32 on 127.0.0.1: one server for the module, restarted
once (kill -9). Logprobs are checked against a teacher-forced forward of the same checkpoint."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig, WeightUpdate
from relayrl.data.models import build_tiny_model
from relayrl.inference.remote import RemoteEngine
from relayrl.inference.remote.protocol import Call
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
    sglang_command,
)

pytestmark = pytest.mark.real_peers


@pytest.fixture(scope="module")
def sglang(tiny_dir, tmp_path_factory):
    env = peer_env("sglang")
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    server = RealServer("sglang", sglang_command(env, tiny_dir, free_port()), peer_environ(), log).start()
    yield server
    server.stop()


def engine(server: RealServer, **kw) -> RemoteEngine:
    cfg = InferenceConfig(
        **{
            "backend": "remote",
            "protocol": "sglang",
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
    eng = RemoteEngine(cfg, addresses=[server.address])
    eng.initialize()
    return eng


def test_generation_and_logprobs_match_a_teacher_forced_forward(sglang, served_model):
    eng = engine(sglang)
    try:
        assert eng.servers[0].info.version == "0.5.23"
        sampled = GenerationConfig(max_new_tokens=24, temperature=0.8, ignore_eos=True)
        greedy = GenerationConfig(max_new_tokens=24, greedy=True, ignore_eos=True)
        outs = run(eng, [(p, sampled) for p in prompts(4)] + [(p, greedy) for p in prompts(2)])
        gaps = [gap(served_model, o, 0.8) for o in outs[:4]] + [gap(served_model, o, 1.0) for o in outs[4:]]
        print(f"SGLang logprob gap to the teacher-forced forward (fp32): max {max(gaps):.2e}")
        assert max(gaps) <= TOL
        assert all(o.stop_reason == "length" and len(o.output_tokens) == 24 for o in outs)
    finally:
        eng.destroy()


def test_n_samples_batch_into_one_call_and_stops_end_them(sglang, served_model):
    eng = engine(sglang, batch_window_ms=50)
    try:
        g = GenerationConfig(max_new_tokens=16, temperature=1.0, ignore_eos=True)
        calls = eng.counters["http_calls"]
        outs = run(eng, [(prompts(1)[0], g)] * 4)
        assert eng.counters["http_calls"] - calls == 1  # one batched /generate
        assert len({tuple(o.output_tokens) for o in outs}) > 1
        assert max(gap(served_model, o, 1.0) for o in outs) <= TOL
        greedy = run(eng, [(prompts(1)[0], GenerationConfig(max_new_tokens=16, greedy=True, ignore_eos=True))])[0]
        stop_at = greedy.output_tokens[5]
        first = greedy.output_tokens.index(stop_at)
        out = run(eng, [(prompts(1)[0], GenerationConfig(max_new_tokens=16, greedy=True, stop_token_ids=[stop_at]))])
        assert out[0].stop_reason == "stop" and out[0].output_tokens == greedy.output_tokens[: first + 1]
    finally:
        eng.destroy()


def test_pause_with_requests_in_flight_then_resume(sglang, served_model):
    """/pause_generation with requests in flight: they come back as abort with their tokens and are held
    until /continue_generation, then continue exactly. Requests of 960 tokens, tried up to 4 times until
    the pause lands mid-generation (as the update test below: a loaded machine can let SGLang finish first)."""
    eng = engine(sglang)
    n = 960
    g = GenerationConfig(max_new_tokens=n, temperature=1.0, ignore_eos=True)
    try:
        for _ in range(4):
            interrupted = eng.counters["interrupted"]
            results: list = []
            t = threading.Thread(target=lambda out=results: out.extend(run(eng, [(p, g) for p in prompts(3)])))
            t.start()
            in_flight(eng, 3, sender=t)
            eng.pause()  # /pause_generation: in-flight requests come back as abort with their tokens
            try:
                time.sleep(1.0)
                held = t.is_alive()  # the requests it interrupted wait for the resume
            finally:
                eng.resume()
            t.join(timeout=180)
            if eng.counters["interrupted"] > interrupted:
                break
        assert eng.counters["interrupted"] > interrupted and held, eng.counters
        assert [len(o.output_tokens) for o in results] == [n] * 3
        assert max(gap(served_model, o, 1.0) for o in results) <= TOL
    finally:
        eng.destroy()


@pytest.mark.parametrize("sync", ["disk", "broadcast"])
def test_a_weight_update_mid_generation_tags_every_token_with_its_version(sglang, served_model, tmp_path, sync):
    """SGLang 0.5.23 loads distributed weights only inside /begin_weight_update ... /end_weight_update. Requests
    of 960 tokens, tried up to 4 times until an update lands mid-generation: beside the main suite SGLang once
    finished 3 x 240 tokens before the update reached it (CI, 2026-11-29)."""
    eng = engine(sglang, weight_sync=sync, weight_sync_dir=str(tmp_path / "w") if sync == "disk" else "")
    new = build_tiny_model("tiny", seed=3).eval()
    n = 960
    g = GenerationConfig(max_new_tokens=n, temperature=1.0, ignore_eos=True)
    version = eng.get_version()  # the server's (an earlier test may have updated it)
    models = {version: served_model}
    try:
        for _ in range(4):
            version += 1
            models[version] = new if models[version - 1] is served_model else served_model
            results: list = []
            t = threading.Thread(target=lambda out=results: out.extend(run(eng, [(p, g) for p in prompts(3)])))
            t.start()
            in_flight(eng, 3, sender=t)
            eng.update_weights(WeightUpdate(kind="tensors", version=version, tensors=models[version].state_dict()))
            t.join(timeout=180)
            assert httpx.get(sglang.url + "/model_info", timeout=10).json()["weight_version"] == str(version)
            if any(len(set(o.output_versions)) > 1 for o in results):
                break
        check_versions(results, models, n)  # (it also asserts the update landed mid-generation)
    finally:
        version += 1
        eng.update_weights(WeightUpdate(kind="tensors", version=version, tensors=served_model.state_dict()))
        eng.destroy()
    assert httpx.get(sglang.url + "/model_info", timeout=10).json()["weight_version"] == str(version)


def test_a_refused_weight_load_is_an_error(sglang, tmp_path):
    """SGLang answers 400 {"success": false} when it cannot load weights (here: a dir with none)."""
    (tmp_path / "empty").mkdir()
    eng = engine(sglang, weight_sync="disk", weight_sync_dir=str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="400"):
            eng._sync("disk").push(eng.servers[0], str(tmp_path / "empty"), 7)  # noqa: SLF001
        assert httpx.get(sglang.url + "/model_info", timeout=10).json()["weight_version"] != "7"
    finally:
        eng.destroy()


def test_the_version_a_load_with_a_refused_flush_did_not_set_is_set_by_update_weight_version(sglang):
    """``load_flushed``'s last call: SGLang 0.5.23 leaves the reported version unchanged when a load's
    cache flush is refused; ``/update_weight_version`` (no abort) sets it, and new tokens carry it."""
    eng = engine(sglang)
    try:
        v0, srv = eng.get_version(), eng.servers[0]
        for v in (v0 + 50, v0):  # set, then put back for the tests after this one
            eng.admin(srv, Call("POST", "/update_weight_version", {"new_version": str(v), "abort_all_requests": False}))
            assert httpx.get(sglang.url + "/model_info", timeout=10).json()["weight_version"] == str(v)
            (res,) = run(eng, [(prompts(1)[0], GenerationConfig(max_new_tokens=2, greedy=True))])
            assert res.output_versions == [v, v]
    finally:
        eng.destroy()


def test_kill_9_and_readmission_over_broadcast(sglang, served_model):
    """The only server is SIGKILLed; an update while it is gone waits for it (server_wait_timeout); once back,
    it is re-admitted: a new weight group is built with it and it serves the trainer's version."""
    eng = engine(sglang, weight_sync="broadcast", max_retries=40, server_wait_timeout=600)
    new = build_tiny_model("tiny", seed=5).eval()
    try:
        eng.update_weights(WeightUpdate(kind="tensors", version=1, tensors=served_model.state_dict()))
        sglang.kill9()
        done: list = []
        t = threading.Thread(
            target=lambda: done.append(
                eng.update_weights(WeightUpdate(kind="tensors", version=2, tensors=new.state_dict()))
            )
        )
        t.start()
        sglang.restart()
        t.join(timeout=180)
        assert done == [None], "update_weights did not complete after the server came back"
        assert eng.live_servers() == [sglang.url] and eng.counters["readmissions"] >= 1
        assert httpx.get(sglang.url + "/model_info", timeout=10).json()["weight_version"] == "2"
        g = GenerationConfig(max_new_tokens=8, temperature=1.0, ignore_eos=True)
        out = run(eng, [(prompts(1)[0], g)])[0]
        assert gap(new, out, 1.0) <= TOL and out.output_versions == [2] * 8
    finally:
        eng.destroy()


def serve_the_reference(server, model, tmp_path) -> None:
    """Put ``model``'s weights back on the module's server (earlier tests leave others there)."""
    eng = engine(server, weight_sync="disk", weight_sync_dir=str(tmp_path / "reset"))
    try:
        eng.update_weights(WeightUpdate(kind="tensors", version=eng.get_version() + 1, tensors=model.state_dict()))
    finally:
        eng.destroy()


def test_a_distillation_teacher_on_sglang_gives_the_forward_top_k(sglang, served_model, tmp_path):
    serve_the_reference(sglang, served_model, tmp_path)
    check_teacher_server(sglang.url, "sglang", served_model)


def test_the_trainer_distills_from_a_teacher_on_sglang_as_from_the_same_teacher_loaded_locally(
    sglang, tiny_dir, served_model, tmp_path
):
    """``actor.loss=distill actor.teacher.url=<SGLang> actor.teacher.top_k=5``: the student (the tiny model
    at another seed) samples locally and the served model scores its tokens. The run is the run with the
    same model as a local teacher (``actor.teacher.path``, top 5): the same KL at both steps, to the
    server's 1e-5 logprob gap."""
    import json

    from relayrl.api.config import RunConfig, load_config
    from relayrl.trainer import train

    def distill(teacher: str, run_dir) -> list[float]:
        over = [f"run_dir={run_dir}", "seed=1", "actor.loss=distill", teacher, "actor.teacher.top_k=5",
                "rollout.batch_size=4", "rollout.group_size=2", "gconfig.max_new_tokens=6", "data.n_train=32",
                "data.n_eval=4", "total_steps=2", "train.optimizer.lr=1e-4", "logging.tensorboard=false",
                "logging.progress=off", "checkpoint.save_final=false", "eval.gconfig.max_new_tokens=6"]  # fmt: skip
        train(load_config(RunConfig, None, over))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["actor/distill_kl"] for r in rows if "actor/distill_kl" in r]

    serve_the_reference(sglang, served_model, tmp_path)  # tiny_dir's weights
    served = distill(f"actor.teacher.url={sglang.address}", tmp_path / "served")
    local = distill(f"actor.teacher.path={tiny_dir}", tmp_path / "local")
    print(f"distilling from SGLang (top 5): actor/distill_kl per step {served}; from the local teacher {local}")
    assert len(served) == 2 and served[0] > 0.01
    assert served == pytest.approx(local, rel=1e-3)


@pytest.mark.timeout(400)
def test_a_server_frozen_mid_generation_stops_the_wait_with_one_line_then_comes_back(sglang, tmp_path):
    """#40: SGLang SIGSTOPped (every process of it) with requests running
    (servers.check_freeze_mid_generation)."""
    eng = engine(sglang, **FREEZE)
    try:
        took = check_freeze_mid_generation(sglang, eng, 900)
    finally:
        eng.destroy()
    print(f"sglang frozen mid-generation: Stalled {took:.1f}s after the freeze")
    assert took < 120  # health_timeout 5 s + server_wait_timeout 10 s, far from the test's own timeout


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("sync", "path"), [("disk", "/update_weights_from_disk"), ("broadcast", "/update_weights_from_distributed")]
)
def test_a_server_frozen_during_a_weight_update_stops_the_update_with_one_line_then_comes_back_with_the_weights(
    sglang, tmp_path, sync, path
):
    """#40: SGLang SIGSTOPped as its disk load or its broadcast bucket is sent (servers.check_freeze_during_update);
    SGLang is not health-probed during an update (its probe blocks then): the call's request_timeout evicts it."""
    eng = engine(
        sglang, weight_sync=sync, weight_sync_dir=str(tmp_path / "w") if sync == "disk" else "", **FREEZE_UPDATE
    )
    try:
        took = check_freeze_during_update(sglang, eng, build_tiny_model("tiny", seed=7).eval(), path)
    finally:
        eng.destroy()
    print(f"sglang frozen during a {sync} weight update: Stalled {took:.1f}s after the freeze")
    assert took < 120  # request_timeout 5 s + server_wait_timeout 5 s, far from the test's own timeout
