"""RemoteEngine against two real `relayrl serve` processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig, ModelRequest, WeightUpdate
from relayrl.data.models import build_tiny_model
from relayrl.inference.local import LocalEngine
from relayrl.inference.remote import RemoteEngine
from relayrl.inference.server.launcher import launch_servers

TOKEN = "tok"
TRIES = 6  # of holding generation mid-way: a try is lost only when its requests all finished before the hold


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def group(shared):
    g = launch_servers(2, admin_token=TOKEN, overrides=[f"allowed_weight_roots=['{shared}']"])
    yield g
    g.shutdown()


def make_engine(group, shared, max_retries=10, **kw) -> RemoteEngine:
    cfg = InferenceConfig(
        **{
            "backend": "remote",
            "admin_token": TOKEN,
            "health_interval": 0.2,
            "request_timeout": 60,
            "weight_sync_dir": str(shared),
            "max_retries": max_retries,
            **kw,
        }
    )
    eng = RemoteEngine(cfg, addresses=group.addresses)
    eng.initialize()
    return eng


def greedy(n: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, greedy=True, ignore_eos=True)


def prompts(k: int) -> list[list[int]]:
    return [[3, 10 + i % 50, 11 + (i * 7) % 50, 12 + (i * 3) % 40, 4] for i in range(k)]


def run_all(engine, ps, g, prefix="r"):
    async def go():
        return await asyncio.gather(*(engine.agenerate(ModelRequest(f"{prefix}{i}", p, g)) for i, p in enumerate(ps)))

    return asyncio.run(go())


def reference(model, ps, g):
    eng = LocalEngine(InferenceConfig(), model=model)
    eng.initialize()
    try:
        return run_all(eng, ps, g)
    finally:
        eng.destroy()


def model_info(group) -> list[dict]:
    return [httpx.get(f"http://{a}/get_model_info", timeout=10).json() for a in group.addresses]


def served(group) -> list[int]:
    return [info["requests_served"] for info in model_info(group)]


def tokens(group) -> list[int]:
    return [info["tokens_generated"] for info in model_info(group)]


def admin_post(group, i: int, path: str, body: dict) -> None:
    url = f"http://{group.addresses[i]}{path}"
    httpx.post(url, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).raise_for_status()


def wait_tokens(group, servers: list[int], base: list[int], n: int, sender: threading.Thread) -> None:
    """Until each of ``servers`` has generated ``n`` tokens since ``base`` (or ``sender`` has ended)."""
    deadline = time.monotonic() + 60
    while sender.is_alive() and any(tokens(group)[i] - base[i] < n for i in servers):
        assert time.monotonic() < deadline, f"servers {servers} generated nothing"
        time.sleep(0.005)


def holding(eng, group, servers: list[int], base: list[int], prefix: str, n: int) -> bool:
    """Read with generation paused in place: whether each of ``servers`` holds unfinished requests of
    ``prefix`` (fewer than n tokens apiece generated since ``base``), so that what the test does next
    lands mid-generation however loaded the machine is."""
    with eng._lock:  # the engine's rid -> server table: the server each request was sent to
        chosen = [s for rid, s in eng._affinity.items() if rid.startswith(prefix)]
    now = tokens(group)
    return all(now[i] - base[i] < n * sum(c is eng.servers[i] for c in chosen) for i in servers)


def test_generate_through_two_servers(group, shared, tiny_model):
    ps = prompts(16)
    refs = reference(tiny_model, ps, greedy(8))
    for protocol in ("relayrl", "sglang", "vllm"):  # the relayrl server speaks all three
        eng = make_engine(group, shared, protocol=protocol)
        before = served(group)
        try:
            outs = run_all(eng, ps, greedy(8))
        finally:
            eng.destroy()
        after = served(group)
        assert all(a - b >= 3 for a, b in zip(after, before, strict=True)), (protocol, before, after)
        for out, ref in zip(outs, refs, strict=True):
            assert out.output_tokens == ref.output_tokens, protocol
            assert out.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-4)
            assert out.output_versions == [0] * 8 and out.stop_reason == "length"
    # affinity: turns of one episode (same rid) go to the same server
    eng = make_engine(group, shared)
    try:
        run_all(eng, ps[:4], greedy(2), prefix="session")
        first = {rid: s.url for rid, s in eng._affinity.items()}
        run_all(eng, ps[:4], greedy(2), prefix="session")
        assert {rid: s.url for rid, s in eng._affinity.items()} == first
        assert len(set(first.values())) == 2
    finally:
        eng.destroy()


def _burst(tiny_model, k: int):
    """k greedy requests with per-item limits: different lengths, and stop tokens that end some early
    (and where each of those stops)."""
    ps = prompts(k)
    refs = reference(tiny_model, ps, greedy(8))
    gs, stops = [], []
    for i, ref in enumerate(refs):
        g = greedy(4 + i % 5)
        toks = ref.output_tokens
        k = next((k for k in range(1, len(toks)) if toks[k] not in toks[:k]), 0)
        if i % 3 == 0:  # stops at its first new token
            g = GenerationConfig(max_new_tokens=8, greedy=True, stop_token_ids=[toks[k]])
        gs.append(g)
        stops.append(k + 1)
    return ps, gs, stops


def run_each(engine, ps, gs, prefix="b"):
    async def go():
        return await asyncio.gather(
            *(
                engine.agenerate(ModelRequest(f"{prefix}{i}", p, g))
                for i, (p, g) in enumerate(zip(ps, gs, strict=True))
            ),
            return_exceptions=True,
        )

    return asyncio.run(go())


def test_a_burst_goes_out_in_few_http_calls_with_single_request_results(group, shared, tiny_model):
    ps, gs, stops = _burst(tiny_model, 30)
    for protocol in ("relayrl", "sglang", "vllm"):
        alone = make_engine(group, shared, protocol=protocol, batch_window_ms=0)
        batched = make_engine(group, shared, protocol=protocol)  # default window
        try:
            calls0 = sum(i["generate_calls"] for i in model_info(group))
            singles = run_each(alone, ps, gs)
            calls1 = sum(i["generate_calls"] for i in model_info(group))
            outs = run_each(batched, ps, gs)
            calls2 = sum(i["generate_calls"] for i in model_info(group))
        finally:
            alone.destroy()
            batched.destroy()
        assert calls1 - calls0 == alone.counters["http_calls"] == 30, protocol
        # relayrl/sglang: one call per server; vllm: one per server and distinct set of sampling params
        limit = 2 if protocol != "vllm" else 2 * len({(g.max_new_tokens, tuple(g.stop_token_ids)) for g in gs})
        assert calls2 - calls1 == batched.counters["http_calls"] <= min(limit, 20), (protocol, calls2 - calls1)
        assert batched.counters["requests"] == 30
        for o, s, g, stop in zip(outs, singles, gs, stops, strict=True):
            assert o.output_tokens == s.output_tokens and o.stop_reason == s.stop_reason, protocol
            assert o.output_logprobs == pytest.approx(s.output_logprobs, abs=1e-5)
            assert o.output_versions == s.output_versions == [0] * o.output_len
            assert o.stop_reason == ("stop" if g.stop_token_ids else "length") and o.output_len == (
                stop if g.stop_token_ids else g.max_new_tokens
            )


def test_a_bad_request_in_a_batch_fails_alone(group, shared, tiny_model):
    ps, gs, _ = _burst(tiny_model, 12)
    eng = make_engine(group, shared)
    try:
        refs = run_each(eng, ps, gs, prefix="ok")
        bad = list(ps)
        bad[5] = [3, 5000, 4]  # out of vocabulary: the server refuses it
        outs = run_each(eng, bad, gs, prefix="bad")
    finally:
        eng.destroy()
    assert isinstance(outs[5], ValueError) and "input_ids[1]=5000 is out of vocabulary" in str(outs[5])
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if i != 5:
            assert o.output_tokens == r.output_tokens and o.stop_reason == r.stop_reason


def test_no_item_of_a_batch_waits_for_the_slowest(group, shared):
    """relayrl streams a batch's items as they finish: short requests return before a long one
    that went out in the same HTTP call. Checked by order, not latency (a stalled client reads
    every line at once): the server streams the long item's line last, and the client returns the
    short requests without it (a spy on the stream holds that line back until they have returned)."""
    eng = RemoteEngine(
        InferenceConfig(backend="remote", admin_token=TOKEN, request_timeout=60), addresses=group.addresses[:1]
    )
    eng.initialize()
    gs = [greedy(150)] + [greedy(2)] * 7
    tasks: list[asyncio.Task] = []
    order: list[int] = []  # item indices, as the stream delivered them
    short_done: list[bool] = []  # at the long item's line: had every short request returned?
    stream = eng._stream

    async def spy(url, call):
        async with contextlib.aclosing(stream(url, call)) as lines:
            async for line in lines:
                if line["index"] == 0:  # without the long item's line, the short ones must still return
                    _, pending = await asyncio.wait(tasks[1:], timeout=30)
                    short_done.append(not pending)
                order.append(line["index"])
                yield line

    eng._stream = spy  # what the batcher reads batched replies with

    async def go():
        tasks.extend(
            asyncio.ensure_future(eng.agenerate(ModelRequest(f"hol{i}", p, g)))
            for i, (p, g) in enumerate(zip(prompts(8), gs, strict=True))
        )
        return await asyncio.gather(*tasks)

    try:
        outs = asyncio.run(go())
    finally:
        eng.destroy()
    assert eng.counters["http_calls"] == 1 and eng.counters["requests"] == 8
    assert [o.output_len for o in outs] == [150] + [2] * 7
    assert order[-1] == 0 and sorted(order[:-1]) == list(range(1, 8)), order
    assert short_done == [True]
    assert max(o.latency for o in outs[1:]) < outs[0].latency, [round(o.latency, 3) for o in outs]


def test_batch_size_cap_and_callers_that_give_up(group, shared):
    """batch_max_requests splits a burst; requests cancelled before their batch leaves are not sent."""
    eng = RemoteEngine(
        InferenceConfig(backend="remote", admin_token=TOKEN, batch_max_requests=4, batch_window_ms=50),
        addresses=group.addresses[:1],
    )
    eng.initialize()

    async def go():
        tasks = [
            asyncio.ensure_future(eng.agenerate(ModelRequest(f"cap{i}", p, greedy(3))))
            for i, p in enumerate(prompts(11))
        ]
        await asyncio.sleep(0)  # every request is queued: 8 left in full batches, 3 wait for the window
        tasks[9].cancel()
        tasks[10].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    served = served_by(group, 0)
    try:
        outs = asyncio.run(go())
    finally:
        eng.destroy()
    assert eng.counters["http_calls"] == 3 and served_by(group, 0) - served == 9  # 4 + 4 + the one not cancelled
    assert [isinstance(o, asyncio.CancelledError) for o in outs] == [False] * 9 + [True, True]
    assert all(o.output_len == 3 for i, o in enumerate(outs) if i not in (9, 10))


def served_by(group, i: int) -> int:
    return httpx.get(f"http://{group.addresses[i]}/get_model_info", timeout=10).json()["requests_served"]


def test_200_concurrent_requests(group, shared):
    eng = make_engine(group, shared)
    try:
        outs = run_all(eng, prompts(200), GenerationConfig(max_new_tokens=3, temperature=1.0, ignore_eos=True))
    finally:
        eng.destroy()
    assert len(outs) == 200
    assert all(
        o.output_len == 3 and len(o.output_logprobs) == 3 and all(x <= 0 for x in o.output_logprobs) for o in outs
    )


def test_weight_updates_reach_every_server(group, shared, tiny_model):
    eng = make_engine(group, shared, weight_sync="http")
    new = build_tiny_model("tiny", seed=1).eval()
    ps = prompts(6)
    try:
        # HTTP upload, with long generations in flight: they are interrupted and continued.
        # Once every server has generated some tokens, eng.pause() holds generation in place
        # (relayrl's pause); the update is sent once every server is seen holding unfinished
        # requests, so it lands mid-generation on each. A try whose requests finished before the
        # pause (the test process stalled) is run again.
        n = 200
        g = greedy(n)
        for attempt in range(TRIES):
            prefix = f"upd{attempt}-"
            base = tokens(group)
            results = []
            t = threading.Thread(target=lambda out=results, pre=prefix: out.extend(run_all(eng, ps, g, pre)))
            t.start()
            wait_tokens(group, [0, 1], base, 6, t)
            eng.pause()
            if holding(eng, group, [0, 1], base, prefix, n):
                break
            eng.resume()
            t.join()
        else:
            pytest.fail(f"generation finished before the pause on all {TRIES} tries")
        try:
            aborts = [info["aborts"] for info in model_info(group)]
            eng.update_weights(WeightUpdate(kind="tensors", version=1, tensors=new.state_dict()))
            assert all(i["aborts"] > a for i, a in zip(model_info(group), aborts, strict=True))  # interrupted
        finally:
            eng.resume()
        t.join()
        versions = [
            int(httpx.get(f"http://{a}/get_weight_version", timeout=10).json()["weight_version"])
            for a in group.addresses
        ]
        assert versions == [1, 1] and eng.get_version() == 1
        for r in results:
            assert r.output_len == n and r.output_versions == sorted(r.output_versions)
            assert set(r.output_versions) <= {0, 1}
        assert any(0 in r.output_versions and 1 in r.output_versions for r in results)
        refs = reference(new, ps, greedy(8))
        assert [o.output_tokens for o in run_all(eng, ps, greedy(8))] == [r.output_tokens for r in refs]

        # versioned safetensors dir on shared disk, then a disk checkpoint dir
        eng.config.weight_sync = "disk"
        eng.update_weights(WeightUpdate(kind="tensors", version=2, tensors=tiny_model.state_dict()))
        assert (shared / "v00000002" / "model.safetensors").exists()
        eng.update_weights(WeightUpdate(kind="disk", version=3, path=str(shared / "v00000002")))
        versions = [
            int(httpx.get(f"http://{a}/get_weight_version", timeout=10).json()["weight_version"])
            for a in group.addresses
        ]
        assert versions == [3, 3]
        outs = run_all(eng, ps, greedy(8))
        assert [o.output_tokens for o in outs] == [r.output_tokens for r in reference(tiny_model, ps, greedy(8))]
        assert all(o.output_versions == [3] * 8 for o in outs)
        eng.pause()
        assert all(httpx.get(f"http://{a}/get_model_info", timeout=10).json()["paused"] for a in group.addresses)
        eng.resume()
        assert not any(httpx.get(f"http://{a}/get_model_info", timeout=10).json()["paused"] for a in group.addresses)
        with pytest.raises(RuntimeError, match="403"):  # a dir outside the servers' allowed roots
            eng.update_weights(WeightUpdate(kind="disk", version=4, path="/etc"))
        assert eng.get_version() == 3
    finally:
        eng.destroy()


def test_killed_server_requests_complete_and_server_is_readmitted(group, shared, tiny_model):
    eng = make_engine(group, shared, max_retries=4)  # a request retried on the other server after the kill
    ps = prompts(40)
    n = 64
    g = greedy(n)
    refs = reference(tiny_model, ps, g)
    try:
        # this engine's latest weights (what a restarted server must be given before it serves)
        tiny_model.save_pretrained(shared / "kill_test_weights")
        eng.update_weights(WeightUpdate(kind="disk", version=3, path=str(shared / "kill_test_weights")))
        # Mid-run (tokens out, most still to come), server 1 is paused in place: its requests wait
        # there, unfinished, until the kill (the client sees nothing of it). A try whose requests
        # finished before the pause (the test process stalled) is run again.
        for attempt in range(TRIES):
            prefix = f"kill{attempt}-"
            base, before = tokens(group), collections.Counter(eng.counters)
            results = []
            t = threading.Thread(target=lambda out=results, pre=prefix: out.extend(run_all(eng, ps, g, pre)))
            t.start()
            wait_tokens(group, [1], base, 20, t)
            admin_post(group, 1, "/pause_generation", {"mode": "in_place"})
            if holding(eng, group, [1], base, prefix, n):
                break
            admin_post(group, 1, "/continue_generation", {})
            t.join()
        else:
            pytest.fail(f"server 1 finished before the pause on all {TRIES} tries")
        group.kill(1)  # SIGKILL mid-run
        t.join(timeout=120)
        st = eng.counters - before  # this try's
        assert len(results) == 40
        assert [r.output_tokens for r in results] == [r.output_tokens for r in refs]  # no lost or doubled tokens
        assert st["evictions"] >= 1 and st["reissued"] >= 1, dict(st)
        # the 40 went out as one call per server; every later call carries a re-issued or retried request
        assert st["http_calls"] <= 2 + st["reissued"] + st["retried"] + st["interrupted"] < st["requests"], dict(st)
        assert eng.live_servers() == [f"http://{group.addresses[0]}"]
        # the server comes back (fresh process, version 0): it is re-admitted with the current weights
        group.restart(1)
        deadline = time.monotonic() + 30
        while len(eng.live_servers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(eng.live_servers()) == 2
        v = int(httpx.get(f"http://{group.addresses[1]}/get_weight_version", timeout=10).json()["weight_version"])
        assert v == eng.get_version() == 3
    finally:
        eng.destroy()


def test_a_hung_server_times_out_is_evicted_and_comes_back(group, shared, tiny_model):
    """SIGSTOP: the server accepts connections but never answers. Requests time out and are
    retried elsewhere, the health probe evicts it; after SIGCONT it is re-admitted."""
    eng = make_engine(group, shared, request_timeout=2.0)
    ps = prompts(8)
    refs = reference(tiny_model, ps, greedy(8))
    hung = group.procs[1].pid
    try:
        eng.update_weights(WeightUpdate(kind="tensors", version=eng.get_version(), tensors=tiny_model.state_dict()))
        os.kill(hung, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            outs = run_all(eng, ps, greedy(8), prefix="hung")
            assert [o.output_tokens for o in outs] == [r.output_tokens for r in refs]  # all done, none lost or doubled
            assert time.monotonic() - t0 < 60
            deadline = time.monotonic() + 30
            while len(eng.live_servers()) > 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert eng.live_servers() == [f"http://{group.addresses[0]}"]
        finally:
            os.kill(hung, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while len(eng.live_servers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(eng.live_servers()) == 2
    finally:
        eng.destroy()


def test_weights_by_collective_broadcast_survive_a_dead_and_a_returning_server(group, shared, tiny_model):
    """weight_sync=broadcast: SGLang's weight-group protocol over gloo, with real servers."""
    eng = make_engine(group, shared, weight_sync="broadcast")
    new = build_tiny_model("tiny", seed=2).eval()
    ps = prompts(6)

    def versions(servers=(0, 1)) -> list[int]:
        return [
            int(httpx.get(f"http://{group.addresses[i]}/get_weight_version", timeout=10).json()["weight_version"])
            for i in servers
        ]

    try:
        eng.update_weights(WeightUpdate(kind="tensors", version=5, tensors=new.state_dict()))
        assert versions() == [5, 5] and eng.get_version() == 5
        assert [o.output_tokens for o in run_all(eng, ps, greedy(8))] == [
            r.output_tokens for r in reference(new, ps, greedy(8))
        ]
        eng.update_weights(
            WeightUpdate(kind="tensors", version=6, tensors=tiny_model.state_dict())
        )  # the same group again
        assert versions() == [6, 6]

        group.kill(1)  # the next update goes to the survivor through a new group
        eng.update_weights(WeightUpdate(kind="tensors", version=7, tensors=new.state_dict()))
        assert eng.live_servers() == [f"http://{group.addresses[0]}"] and versions([0]) == [7]
        assert [o.output_tokens for o in run_all(eng, ps, greedy(8))] == [
            r.output_tokens for r in reference(new, ps, greedy(8))
        ]

        group.restart(1)  # back at version 0: it rejoins (a group of both) and gets version 7
        deadline = time.monotonic() + 60
        while len(eng.live_servers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(eng.live_servers()) == 2 and versions() == [7, 7]
        eng.update_weights(WeightUpdate(kind="tensors", version=8, tensors=tiny_model.state_dict()))
        assert versions() == [8, 8]
        assert [o.output_tokens for o in run_all(eng, ps, greedy(8))] == [
            r.output_tokens for r in reference(tiny_model, ps, greedy(8))
        ]
    finally:
        eng.destroy()


@pytest.mark.slow
def test_launched_children_die_with_a_sigkilled_parent():
    code = textwrap.dedent("""
        import sys, time
        from relayrl.inference.server.launcher import launch_servers
        g = launch_servers(1)
        print(g.procs[0].pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # alive
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        _reap(child)
        time.sleep(0.1)
    pytest.fail(f"server {child} outlived its SIGKILLed parent")


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)  # only our own children can be reaped; others are reaped by init
    except ChildProcessError:
        pass
