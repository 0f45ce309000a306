"""Stats tracker: scopes, masked averages, reduce types, timing, and a real 2-rank gloo all-reduce."""

from __future__ import annotations

import multiprocessing as mp
import threading
import types

import pytest
import torch

from relayrl.utils import dist as dist_utils
from relayrl.utils import stats
from relayrl.utils.stats import StatsTracker


def _ref(values: list[torch.Tensor], masks: list[torch.Tensor]) -> dict[str, float]:
    """Plain-loop reference over every selected element of every record."""
    picked = [
        float(v)
        for x, m in zip(values, masks, strict=True)
        for v, keep in zip(x.flatten(), m.flatten(), strict=True)
        if keep
    ]
    return {
        "avg": sum(picked) / len(picked),
        "sum": sum(picked),
        "min": min(picked),
        "max": max(picked),
        "n": len(picked),
    }


def test_masked_average_min_max_sum_match_plain_loop():
    g = torch.Generator().manual_seed(0)
    tr = StatsTracker()
    xs, ms = [], []
    for shape in [(3, 7), (2, 5), (4, 9)]:  # three micro-batches of different shapes
        x = torch.randn(shape, generator=g)
        m = torch.rand(shape, generator=g) < 0.6
        m[0, 1] = True
        xs.append(x)
        ms.append(m)
        tr.denominator(n_tokens=m)
        tr.stat(denominator="n_tokens", loss=x, reduce=("avg", "min", "max", "sum"))
        tr.stat(denominator="n_tokens", plain=x * 2)
    out = tr.export()
    ref = _ref(xs, ms)
    assert out["n_tokens"] == ref["n"]
    for r in ("avg", "sum", "min", "max"):
        assert out[f"loss/{r}"] == pytest.approx(ref[r], rel=1e-12, abs=1e-12)
    assert out["plain"] == pytest.approx(2 * ref["avg"], rel=1e-12)  # one reduce -> plain key name
    assert set(out) == {"n_tokens", "loss/avg", "loss/min", "loss/max", "loss/sum", "plain"}
    # The average is over tokens, not over micro-batch averages.
    mb_mean = sum(float(x[m].mean()) for x, m in zip(xs, ms, strict=True)) / 3
    assert out["plain"] != pytest.approx(2 * mb_mean, rel=1e-6)


def test_unselected_values_do_not_leak_even_when_nan():
    tr = StatsTracker()
    mask = torch.tensor([[False, True, True, False]])
    tr.denominator(mask=mask)
    tr.stat(denominator="mask", reduce=("avg", "min", "max"), x=torch.tensor([[float("nan"), 1.0, 3.0, -1e9]]))
    assert tr.export() == {"mask": 2.0, "x/avg": 2.0, "x/min": 1.0, "x/max": 3.0}


def test_nested_scopes_prefix_keys_and_denominators_resolve_in_scope():
    tr = StatsTracker()
    mask = torch.tensor([True, False, True])
    with tr.scope("actor"):
        tr.denominator(n_seqs=mask)
        with tr.scope("kl"):
            tr.scalar(coef=0.5)
            assert tr.full_key("x") == "actor/kl/x"
        tr.stat(denominator="n_seqs", reward=torch.tensor([1.0, 100.0, 0.0]))
    tr.scalar(top=1)
    assert tr.export() == {"actor/kl/coef": 0.5, "actor/n_seqs": 2.0, "actor/reward": 0.5, "top": 1.0}
    named = StatsTracker("rollout")
    with named.scope("grp"):
        named.scalar(a=2)
    assert named.export() == {"rollout/grp/a": 2.0}


def test_scopes_are_per_thread():
    tr = StatsTracker()
    started, release = threading.Event(), threading.Event()

    def worker() -> None:
        with tr.scope("rollout"):
            started.set()
            release.wait(5)
            tr.scalar(reward=1.0)

    t = threading.Thread(target=worker)
    t.start()
    started.wait(5)
    with tr.scope("actor"):  # the other thread is inside its own scope right now
        tr.scalar(loss=2.0)
    release.set()
    t.join()
    assert tr.export() == {"actor/loss": 2.0, "rollout/reward": 1.0}


def test_scalars_reduce_over_records():
    tr = StatsTracker()
    for v in (1.0, 4.0, 7):
        tr.scalar(lr=v)
        tr.scalar(reduce="sum", samples=v)
        tr.scalar(reduce=["min", "max"], gnorm=torch.tensor(v))
    assert tr.export() == {"lr": 4.0, "samples": 12.0, "gnorm/min": 1.0, "gnorm/max": 7.0}


def test_record_timing_sums_entries_under_timing_prefix(monkeypatch):
    now = [0.0]  # a clock that moves only where the test says: exact sums on any machine
    monkeypatch.setattr(stats, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    tr = StatsTracker()
    for _ in range(2):
        with tr.record_timing("rollout"):
            now[0] += 0.25  # binary fractions: the sums are exact
    with tr.scope("actor"), tr.record_timing("fwd"):
        now[0] += 0.125
    with pytest.raises(RuntimeError), tr.record_timing("failing"):
        now[0] += 2.0
        raise RuntimeError("boom")
    out = tr.export()
    assert out == {"timing/rollout": 0.5, "timing/actor/fwd": 0.125, "timing/failing": 2.0}


def test_export_reset_and_empty_keys():
    tr = StatsTracker()
    tr.denominator(m=torch.zeros(3, dtype=torch.bool))
    tr.stat(denominator="m", x=torch.ones(3))
    tr.denominator(ints=torch.tensor([0, 1, 1]))  # 0/1 integer masks (loss_mask may be int) are fine
    tr.stat(denominator="ints", y=torch.tensor([5.0, 1.0, 2.0]))
    # no selected element: the stat is left out, the denominator exports 0
    assert tr.export(reset=False) == {"ints": 2.0, "m": 0.0, "y": 1.5}
    assert tr.export() == {"ints": 2.0, "m": 0.0, "y": 1.5}
    assert tr.export() == {}


def test_bad_input_errors_name_the_key():
    tr = StatsTracker()
    with pytest.raises(TypeError, match="denominator 'm'.*float"):
        tr.denominator(m=torch.ones(3))
    with pytest.raises(KeyError, match="denominator 'actor/nope' was not recorded"), tr.scope("actor"):
        tr.stat(denominator="nope", x=torch.ones(3))
    tr.denominator(m=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"stat 'x' has shape \[3\].*'m' has shape \[2, 3\]"):
        tr.stat(denominator="m", x=torch.ones(3))
    with pytest.raises(ValueError, match="stats key 'x'.*reduce must be"):
        tr.stat(denominator="m", reduce="median", x=torch.ones(2, 3))
    tr.scalar(lr=1.0)
    with pytest.raises(ValueError, match="stats key 'lr' was recorded as scalar"):
        tr.scalar(reduce="max", lr=2.0)
    with pytest.raises(TypeError, match="scalar 'name' must be a number"):
        tr.scalar(name="abc")


def test_module_level_default_tracker_without_torch_distributed():
    assert not dist_utils.is_distributed() and dist_utils.rank() == 0 and dist_utils.world_size() == 1
    stats.reset()
    with stats.record_timing("step"), stats.scope("actor"):
        stats.denominator(n=torch.tensor([True, True, False]))
        stats.stat(denominator="n", ratio=torch.tensor([1.0, 2.0, 9.0]))
        stats.scalar(lr=0.1)
    out = stats.export()
    assert {k: v for k, v in out.items() if not k.startswith("timing/")} == {
        "actor/lr": 0.1,
        "actor/n": 2.0,
        "actor/ratio": 1.5,
    }
    assert "timing/step" in out and stats.export() == {}


# --------------------------------------------------------------------------------------
# Two real gloo ranks: the export equals one process computing on the concatenated data.
# --------------------------------------------------------------------------------------

SLEEP = {0: 0.05, 1: 0.2}


def _rank_data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Different micro-batch shapes and counts per rank, so a mean of means would be wrong."""
    g = torch.Generator().manual_seed(100 + rank)
    shapes = [(2, 5), (3, 11)] if rank == 0 else [(1, 4), (5, 8), (2, 3)]
    out = []
    for shape in shapes:
        x = torch.randn(shape, generator=g) * (rank + 1) + rank
        m = torch.rand(shape, generator=g) < 0.5
        m[0, 0] = True
        out.append((x, m))
    return out


def _record(tr: StatsTracker, rank: int) -> None:
    """Rank ``rank``'s step; its timing is ``SLEEP[rank]`` exactly (a clock that moves only here)."""
    now = [0.0]
    stats.time = types.SimpleNamespace(perf_counter=lambda: now[0])  # a spawned child's own module
    with tr.record_timing("step"):
        now[0] += SLEEP[rank]
        with tr.scope("actor"):
            for x, m in _rank_data(rank):
                tr.denominator(n_tokens=m)
                tr.stat(denominator="n_tokens", reduce=("avg", "min", "max", "sum"), loss=x)
                tr.stat(denominator="n_tokens", ratio=x.exp())
            tr.scalar(lr=1e-3 * (rank + 1))
            tr.scalar(reduce="sum", n_seqs=4 + rank)
            tr.scalar(reduce=("min", "max"), grad_norm=10.0 + rank)
        if rank == 1:  # a key only one rank recorded still reduces correctly
            tr.scalar(only_on_rank1=7.0)


def _worker(rank: int, port: int, queue: mp.Queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        assert dist_utils.is_distributed() and dist_utils.world_size() == 2 and dist_utils.rank() == rank
        tr = StatsTracker()
        _record(tr, rank)
        out = tr.export()
        again = tr.export()  # reset worked everywhere; the empty export is still a valid collective
        local = StatsTracker()
        local.scalar(x=float(rank))
        queue.put((rank, out, again, local.export(local=True)))
    finally:
        dist.destroy_process_group()


def test_two_rank_gloo_export_equals_single_process_on_concatenated_data():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = dist_utils.free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(2):
            rank, out, again, local = queue.get(timeout=60)
            results[rank] = (out, again, local)
    finally:
        for p in procs:
            p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]
    out0, out1 = results[0][0], results[1][0]
    assert out0 == out1  # every rank gets the same numbers
    assert results[0][1] == results[1][1] == {}
    assert results[0][2] == {"x": 0.0} and results[1][2] == {"x": 1.0}

    data = _rank_data(0) + _rank_data(1)
    xs, ms = [x for x, _ in data], [m for _, m in data]
    ref = _ref(xs, ms)
    ratio = _ref([x.exp() for x in xs], ms)
    assert out0["actor/n_tokens"] == ref["n"]
    for r in ("avg", "sum", "min", "max"):
        assert out0[f"actor/loss/{r}"] == pytest.approx(ref[r], rel=1e-12, abs=1e-12)
    assert out0["actor/ratio"] == pytest.approx(ratio["avg"], rel=1e-12)
    assert out0["actor/lr"] == pytest.approx((1e-3 + 2e-3) / 2)
    assert out0["actor/n_seqs"] == 9.0
    assert out0["actor/grad_norm/min"] == 10.0 and out0["actor/grad_norm/max"] == 11.0
    assert out0["only_on_rank1"] == 7.0
    # timing: the slowest rank's wall time, not a sum or mean over ranks
    assert out0["timing/step"] == SLEEP[1]

    # And exactly what one process records when it sees both ranks' data.
    single = StatsTracker()
    with single.scope("actor"):
        for x, m in data:
            single.denominator(n_tokens=m)
            single.stat(denominator="n_tokens", reduce=("avg", "min", "max", "sum"), loss=x)
            single.stat(denominator="n_tokens", ratio=x.exp())
    expected = single.export()
    for key, value in expected.items():
        assert out0[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_gauge_reported_twice_in_a_step_is_an_error_not_an_overwrite():
    """Two parts exporting the same key (once, the executor's rollout/staleness_* replaced the
    trainer's) fail loudly; after an export the key is free again for the next step."""
    t = StatsTracker()
    with t.scope("rollout"):
        t.gauge(staleness_max=1.0, reward=0.5)
        with pytest.raises(
            ValueError, match=r"stats key 'rollout/staleness_max' reported twice in one step \(1.0 then 2.0\)"
        ):
            t.gauge(staleness_max=2.0)
    with pytest.raises(ValueError, match="recorded as gauge"):
        t.scalar(**{"rollout/reward": 1.0})
    assert t.export() == {"rollout/reward": 0.5, "rollout/staleness_max": 1.0}
    t.gauge(**{"rollout/staleness_max": -3.0})
    assert t.export() == {"rollout/staleness_max": -3.0}
