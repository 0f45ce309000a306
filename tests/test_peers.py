"""RemoteEngine against the SGLang and vLLM stand-ins (``tests/peers/``) and against `relayrl serve`.

Each stand-in is a real process on 127.0.0.1 that reproduces, from the peer's own source, what
RemoteEngine depends on (see the module docstrings for versions and files). The first tests pin
one defect each of issue #17 (each fails on the RemoteEngine before it); the parametrized ones
run the end-to-end paths (weights by disk and broadcast, kill and re-admit) on every peer.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig, ModelRequest, WeightUpdate
from relayrl.data.models import build_tiny_model
from relayrl.inference.local import LocalEngine
from relayrl.inference.remote import RemoteEngine
from relayrl.inference.remote.protocol import UnsupportedServer
from relayrl.inference.server.launcher import launch_servers

sys.path.insert(0, str(Path(__file__).parent))
from peers import Peer, start  # noqa: E402

from tests.test_remote import greedy, prompts, reference, run_all  # noqa: E402

PROCESSED = ("--logprobs-mode", "processed_logprobs")
DEV = {"VLLM_SERVER_DEV_MODE": "1"}


def engine(protocol: str, addresses: list[str], **kw) -> RemoteEngine:
    cfg = InferenceConfig(
        **{
            "backend": "remote",
            "protocol": protocol,
            "health_interval": 0.2,
            "request_timeout": 60,
            "max_retries": 10,
            "batch_window_ms": 0,
            **kw,
        }
    )
    eng = RemoteEngine(cfg, addresses=addresses)
    eng.initialize()
    return eng


@pytest.fixture
def stopper():
    peers: list[Peer] = []
    yield peers
    for p in peers:
        p.stop()


def started(stopper, kind, *args, env=None) -> Peer:
    p = start(kind, *args, env=env)
    stopper.append(p)
    return p


# ---------------------------------------------------------------------------- one defect each
def test_vllm_requests_name_the_served_model_and_logprobs_follow_the_temperature(stopper, tiny_model):
    """#17.1 and #17.7: vLLM answers 404 for a model name it does not serve; with processed
    logprobs the reported logprob is the sampling distribution's (the same as LocalEngine's)."""
    p = started(stopper, "vllm", "--served-model-name", "Qwen/Qwen3-0.6B", *PROCESSED)
    eng = engine("vllm", [p.address])
    try:
        ps = prompts(3)
        assert [o.output_tokens for o in run_all(eng, ps, greedy(6))] == [
            r.output_tokens for r in reference(tiny_model, ps, greedy(6))
        ]
        g = GenerationConfig(max_new_tokens=6, temperature=0.7, ignore_eos=True)
        out = run_all(eng, ps[:1], g)[0]
        local = LocalEngine(InferenceConfig(), model=tiny_model)
        local.initialize()
        try:  # the logprob of each sampled token under T=0.7, recomputed from the model
            import torch

            with torch.inference_mode():
                logits = tiny_model(torch.tensor([ps[0] + out.output_tokens])).logits[0, len(ps[0]) - 1 : -1] / 0.7
            want = torch.log_softmax(logits.float(), -1)[torch.arange(6), torch.tensor(out.output_tokens)]
        finally:
            local.destroy()
        assert torch.allclose(torch.tensor(out.output_logprobs), want, atol=1e-4)
    finally:
        eng.destroy()


def test_vllm_with_raw_logprobs_is_refused_at_start_up(stopper):
    p = started(stopper, "vllm")  # vLLM's default --logprobs-mode raw_logprobs
    with pytest.raises(UnsupportedServer, match="--logprobs-mode processed_logprobs"):
        engine("vllm", [p.address])


def test_vllm_disk_sync_without_dev_mode_is_refused_at_start_up(stopper, tmp_path):
    """#17.6: /collective_rpc and the RL routes exist only with VLLM_SERVER_DEV_MODE=1."""
    p = started(stopper, "vllm", *PROCESSED)
    with pytest.raises(UnsupportedServer, match="VLLM_SERVER_DEV_MODE=1"):
        engine("vllm", [p.address], weight_sync="disk", weight_sync_dir=str(tmp_path))
    with pytest.raises(
        UnsupportedServer, match=r"--weight-transfer-config '\{\"backend\": \"nccl\"\}' and VLLM_SERVER_DEV_MODE=1"
    ):
        engine("vllm", [p.address], weight_sync="broadcast")


def test_vllm_tokens_keep_the_version_that_generated_them_across_a_reload(stopper, tmp_path, tiny_model):
    """#17.7: vLLM replies carry no version: a reload pauses with mode=abort, so the tokens before
    it come back (tagged with the version they were sent under) and the rest continue on the new weights.
    The stand-in holds both requests 20 tokens in (``--hold-after-tokens``: paused as mode=keep) until the
    reload's pause, so it lands mid-generation however loaded the machine is."""
    p = started(stopper, "vllm", *PROCESSED, "--hold-rows", "2", "--hold-after-tokens", "20", env=DEV)
    eng = engine("vllm", [p.address], weight_sync="disk", weight_sync_dir=str(tmp_path))
    new = build_tiny_model("tiny", seed=3).eval()
    ps = prompts(2)
    try:
        results = []
        t = threading.Thread(target=lambda: results.extend(run_all(eng, ps, greedy(200))))
        t.start()
        deadline = time.monotonic() + 60
        while not p.get("/is_paused").json()["is_paused"]:  # held mid-generation: tokens out, most still to come
            assert time.monotonic() < deadline and t.is_alive(), "the stand-in never held the requests"
            time.sleep(0.005)
        eng.update_weights(WeightUpdate(kind="tensors", version=1, tensors=new.state_dict()))
        t.join(timeout=120)
        assert eng.counters["interrupted"] >= 1
        old_ref = reference(tiny_model, ps, greedy(200))
        for p_ids, r, ref in zip(ps, results, old_ref, strict=True):
            k = r.output_versions.count(0)
            assert r.output_versions == [0] * k + [1] * (200 - k) and 0 < k < 200, r.output_versions
            assert r.output_tokens[:k] == ref.output_tokens[:k]  # the old weights' tokens
            cont = reference(new, [p_ids + r.output_tokens[:k]], greedy(200 - k))[0]
            assert r.output_tokens[k:] == cont.output_tokens  # the new weights' continuation
    finally:
        eng.destroy()


def test_concurrent_requests_of_one_episode_get_distinct_rids(stopper):
    """#17.5: ReMax sends its sampled and greedy requests at once under one rid; SGLang refuses a
    rid already in flight (400 'Duplicate request ID detected')."""
    p = started(stopper, "sglang")
    eng = engine("sglang", [p.address])
    try:

        async def remax_like():
            g = GenerationConfig(max_new_tokens=24, temperature=1.0, ignore_eos=True)
            return await asyncio.gather(
                eng.agenerate(ModelRequest("ep", [3, 20, 21], g)),
                eng.agenerate(ModelRequest("ep", [3, 20, 21], g.new(greedy=True))),
            )

        a, b = asyncio.run(remax_like())
        assert a.output_len == b.output_len == 24
    finally:
        eng.destroy()


def test_sglang_without_get_weight_version_reads_model_info(stopper, tmp_path, tiny_model):
    """#17.4: newer SGLang moved the weight version into /model_info (no /get_weight_version)."""
    p = started(stopper, "sglang", "--version", "0.5.15")
    assert p.get("/get_weight_version").status_code == 404
    eng = engine("sglang", [p.address], weight_sync="disk", weight_sync_dir=str(tmp_path))
    try:
        eng.update_weights(WeightUpdate(kind="tensors", version=4, tensors=tiny_model.state_dict()))
        assert p.get("/model_info").json()["weight_version"] == "4" and eng.get_version() == 4
    finally:
        eng.destroy()


@pytest.mark.parametrize("sync", ["disk", "broadcast"])
def test_an_update_whose_cache_flush_was_refused_waits_for_the_flush(stopper, tmp_path, tiny_model, sync):
    """SGLang >= 0.5.23 fails a weight load whose cache flush found requests still winding down
    (weights loaded, the reported version unchanged); relayrl then waits on /flush_cache, which answers
    plain text, and sets the version with /update_weight_version. Before: the disk update failed with a
    JSONDecodeError, the broadcast with the 400; then the confirm read the old version (seen on real SGLang)."""
    p = started(stopper, "sglang", "--version", "0.5.23", "--refuse-flush", "1")
    eng = engine("sglang", [p.address], weight_sync=sync, weight_sync_dir=str(tmp_path))
    try:
        eng.update_weights(WeightUpdate(kind="tensors", version=3, tensors=tiny_model.state_dict()))
        assert eng.get_version() == 3 and eng.counters["evictions"] == 0
    finally:
        eng.destroy()


def test_old_sglang_is_refused_at_start_up_naming_the_version(stopper):
    p = started(stopper, "sglang", "--version", "0.4.6")
    with pytest.raises(UnsupportedServer, match=r"SGLang 0\.4\.6; relayrl needs SGLang >= 0\.5\.0"):
        engine("sglang", [p.address])


def test_a_weight_load_longer_than_the_probe_timeout_evicts_no_server(stopper, tmp_path, tiny_model):
    """#17.3: SGLang's /health generates one token and blocks while weights load; a 6 s load must
    neither evict the servers nor fail the update."""
    ps = [started(stopper, "sglang", "--load-delay", "6") for _ in range(2)]
    eng = engine("sglang", [p.address for p in ps], weight_sync="disk", weight_sync_dir=str(tmp_path))
    try:
        t0 = time.monotonic()
        eng.update_weights(WeightUpdate(kind="tensors", version=1, tensors=tiny_model.state_dict()))
        assert time.monotonic() - t0 > 6
        assert eng.counters["evictions"] == 0 and len(eng.live_servers()) == 2
        time.sleep(1.0)  # probes resume after the update, and find both alive
        assert eng.counters["evictions"] == 0
    finally:
        eng.destroy()


@pytest.mark.parametrize("tp", [1, 2])
def test_broadcast_to_sglang_in_buckets_with_tensor_parallel_ranks(stopper, tiny_model, tp):
    """#17.2: the SGLang-built weight group (ranks rank_offset + tp_rank), bounded buckets; tensor
    parallelism does not run on CPU, so SGLang 0.5.23 (weight-update sessions) is its stand-in here."""
    ps = [started(stopper, "sglang", "--tp-size", str(tp), "--version", "0.5.23") for _ in range(2)]
    eng = engine("sglang", [p.address for p in ps], weight_sync="broadcast", weight_bucket_mb=1.0)
    new = build_tiny_model("tiny", seed=4).eval()
    try:
        eng.update_weights(WeightUpdate(kind="tensors", version=2, tensors=new.state_dict()))
        n_bytes = sum(t.numel() * t.element_size() for t in new.state_dict().values())
        for p in ps:
            info = p.get("/server_info").json()
            assert info["weight_version"] == "2" and info["tp_size"] == tp
            assert info["stand_in_counts"]["buckets"] >= n_bytes // (1 << 20)  # one call per bounded bucket
        qs = prompts(4)
        assert [o.output_tokens for o in run_all(eng, qs, greedy(8))] == [
            r.output_tokens for r in reference(new, qs, greedy(8))
        ]
    finally:
        eng.destroy()


def test_broadcast_to_vllm_through_its_weight_transfer_api_in_packed_buffers(stopper, tiny_model):
    """#17.6: vLLM's own RL route (the transfer API of the router at 1ace43ed: no sessions, no version
    route): its group construction, every tensor in one /update_weights call, packed buffers of the bucket."""
    p = started(
        stopper,
        "vllm",
        *PROCESSED,
        "--weight-transfer-config",
        '{"backend": "nccl"}',
        "--rl-router",
        "1ace43ed",
        env=DEV,
    )
    routes = set(p.get("/openapi.json").json()["paths"])
    assert "/init_weight_transfer_engine" in routes and "/start_weight_update" not in routes
    eng = engine("vllm", [p.address], weight_sync="broadcast", weight_bucket_mb=0.25)
    new = build_tiny_model("tiny", seed=4).eval()
    try:
        for version, model in ((1, new), (2, tiny_model)):
            eng.update_weights(WeightUpdate(kind="tensors", version=version, tensors=model.state_dict()))
            qs = prompts(3)
            outs = run_all(eng, qs, greedy(6), prefix=f"v{version}")
            assert [o.output_tokens for o in outs] == [r.output_tokens for r in reference(model, qs, greedy(6))]
            assert all(o.output_versions == [version] * 6 for o in outs)
        counts = p.get("/stand_in").json()["counts"]
        assert (counts["init"], counts["updates"], counts["packed"]) == (1, 2, 2)  # one group, one call per update
        want, total = 0, 0  # vLLM's packing: a buffer closes once it holds more than the limit
        for _, t in sorted(new.state_dict().items()):
            total += t.numel() * t.element_size()
            if total > 1 << 18:
                want, total = want + 1, 0
        want += total > 0
        assert counts["broadcasts"] == 2 * want and want < len(new.state_dict())  # buffers, not a tensor each
    finally:
        eng.destroy()


# ---------------------------------------------------------------------------- every peer, end to end
NCCL = (
    "--weight-transfer-config",
    '{"backend": "nccl"}',
)  # vLLM 0.32's flag  # the stand-in builds vLLM's transfer group with gloo on CPU
PEERS = {  # name: (kind, args, weight_sync)
    "relayrl": ("relayrl", (), "broadcast"),
    "sglang-0.5.2": ("sglang", ("--version", "0.5.2"), "broadcast"),
    "sglang-0.5.15": ("sglang", ("--version", "0.5.15"), "broadcast"),
    "vllm-0100a212": ("vllm", (*PROCESSED, *NCCL), "broadcast"),
    "vllm-disk": ("vllm", (*PROCESSED, "--weight-transfer-backend", "disk"), "disk"),
}


class _Group:
    """Two servers of one kind with kill(i) / restart(i)."""

    def __init__(self, name: str, shared: Path) -> None:
        kind, args, self.sync = PEERS[name]
        self.protocol, self.token = kind, ""
        if kind == "relayrl":
            self.g = launch_servers(2, overrides=[f"allowed_weight_roots=['{shared}']"])
            self.addresses, self.token = self.g.addresses, self.g.admin_token  # launched servers always have one
        else:
            self.peers = [start(kind, *args, env=DEV) for _ in range(2)]
            self.addresses = [p.address for p in self.peers]

    def kill(self, i: int) -> None:
        self.g.kill(i) if self.protocol == "relayrl" else self.peers[i].kill()

    def restart(self, i: int) -> None:
        self.g.restart(i) if self.protocol == "relayrl" else self.peers[i].restart()

    def stop(self) -> None:
        if self.protocol == "relayrl":
            self.g.shutdown()
        else:
            for p in self.peers:
                p.stop()


# sglang-0.5.2 (the oldest protocol kept) is long: sglang-0.5.15 runs the same broadcast path in CI, and the
# real-peer suite kills and re-admits real SGLang 0.5.23 and vLLM 0.32
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.long] if n == "sglang-0.5.2" else []) for n in PEERS]
)
def test_weights_kill_and_readmit_on_every_peer(name, tmp_path, tiny_model):
    group = _Group(name, tmp_path)
    eng = engine(
        group.protocol, group.addresses, weight_sync=group.sync, weight_sync_dir=str(tmp_path), admin_token=group.token
    )
    new = build_tiny_model("tiny", seed=5).eval()
    ps = prompts(12)
    try:
        eng.update_weights(WeightUpdate(kind="tensors", version=1, tensors=new.state_dict()))
        refs = reference(new, ps, greedy(8))
        outs = run_all(eng, ps, greedy(8))
        assert [o.output_tokens for o in outs] == [r.output_tokens for r in refs]
        assert all(o.output_versions == [1] * 8 for o in outs)

        group.kill(1)  # requests complete on the survivor
        outs = run_all(eng, ps, greedy(8), prefix="k")
        assert [o.output_tokens for o in outs] == [r.output_tokens for r in refs]
        assert eng.live_servers() == [f"http://{group.addresses[0]}"]

        group.restart(1)  # back with its start-up weights: re-admitted once given version 1
        deadline = time.monotonic() + 60
        while len(eng.live_servers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(eng.live_servers()) == 2 and eng.counters["readmissions"] >= 1
        outs = run_all(eng, ps, greedy(8), prefix="back")  # both servers serve version 1 (none its start-up weights)
        assert [o.output_tokens for o in outs] == [r.output_tokens for r in refs]
        eng.update_weights(WeightUpdate(kind="tensors", version=2, tensors=tiny_model.state_dict()))
        outs = run_all(eng, ps, greedy(8), prefix="b")
        assert [o.output_tokens for o in outs] == [r.output_tokens for r in reference(tiny_model, ps, greedy(8))]
        assert all(o.output_versions == [2] * 8 for o in outs)
        served = {
            httpx.post(
                f"http://{a}/v1/completions" if group.protocol == "vllm" else f"http://{a}/generate",
                json=_probe_body(group.protocol, eng),
                timeout=30,
            ).status_code
            for a in group.addresses
        }
        assert served == {200}  # both serve after the re-admission
    finally:
        eng.destroy()
        group.stop()


def _probe_body(protocol: str, eng: RemoteEngine) -> dict:
    if protocol == "vllm":
        return {"model": eng.backend.model, "prompt": [3, 4], "max_tokens": 2}  # type: ignore[union-attr]
    return {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}


def test_a_restarted_trainer_builds_its_group_on_servers_that_still_hold_one(stopper, tiny_model):
    """SGLang refuses a second group of the same name: a new engine has the servers leave the old one first."""
    p = started(stopper, "sglang")
    new = build_tiny_model("tiny", seed=6).eval()
    for version, model in ((1, new), (2, tiny_model)):
        eng = engine("sglang", [p.address], weight_sync="broadcast")
        try:
            eng.update_weights(WeightUpdate(kind="tensors", version=version, tensors=model.state_dict()))
            assert p.get("/get_weight_version").json()["weight_version"] == str(version)
            qs = prompts(2)
            assert [o.output_tokens for o in run_all(eng, qs, greedy(6))] == [
                r.output_tokens for r in reference(model, qs, greedy(6))
            ]
        finally:
            eng.destroy()


def test_a_failed_vllm_broadcast_closes_the_weight_update_session_it_opened(stopper, tiny_model):
    """A broadcast that fails on a server (here: a tensor of the wrong shape) closes the weight-update
    session it opened there; before, every later /start_weight_update answered 'A weight update is
    already active' and the server took no update again."""
    p = started(stopper, "vllm", *PROCESSED, "--weight-transfer-config", '{"backend": "nccl"}', env=DEV)
    import torch

    eng = engine("vllm", [p.address], weight_sync="broadcast")
    bad = dict(tiny_model.state_dict())
    bad["lm_head.weight"] = torch.zeros(3, 3)
    try:
        with pytest.raises(RuntimeError, match="update_weights failed"):
            eng.update_weights(WeightUpdate(kind="tensors", version=1, tensors=bad))
        new = build_tiny_model("tiny", seed=4).eval()
        eng.update_weights(WeightUpdate(kind="tensors", version=2, tensors=new.state_dict()))
        qs = prompts(2)
        assert [o.output_tokens for o in run_all(eng, qs, greedy(6))] == [
            r.output_tokens for r in reference(new, qs, greedy(6))
        ]
    finally:
        eng.destroy()
