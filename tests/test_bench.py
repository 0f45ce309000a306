"""The benchmark harness: the docs table renders from the recorded results, the compute clock
counts nested calls once, and one new benchmark runs end to end with --quick (no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))


def test_docs_table_renders_every_recorded_result(tmp_path: Path) -> None:
    import run_all

    results = sorted(p for p in (BENCH / "results").glob("*.json") if p.stem != "run_all")
    assert results, "bench/results holds no recorded results"
    for p in results:
        r = json.loads(p.read_text())
        assert r["name"] == p.stem and ("ratio" in r or "figure" in r), p
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# Benchmarks\n\nintro\n\n{run_all.START}\nold table\n{run_all.END}\n\noutro\n")
    run_all.write_docs(BENCH / "results", docs)
    text = docs.read_text()
    assert "old table" not in text and text.startswith("# Benchmarks\n\nintro") and text.rstrip().endswith("outro")
    for p in results:
        assert f"| `{p.stem}` |" in text


def test_compute_clock_counts_the_outermost_call_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import overhead
    from overhead import ComputeClock

    now = [0.0]  # a clock that moves only inside inner(): the sums are exact whatever the machine's load
    monkeypatch.setattr(overhead, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    class Model:
        def inner(self) -> None:
            now[0] += 1.0

        def outer(self) -> None:
            self.inner()
            self.inner()

    clock = ComputeClock()
    clock.wrap(Model, "inner", "forward")
    clock.wrap(Model, "outer", "generation")
    Model().outer()
    Model().inner()
    assert clock.seconds == {"generation": 2.0, "forward": 1.0}


@pytest.mark.long
def test_weight_sync_quick_prints_a_json_result(tmp_path: Path) -> None:
    env = dict(os.environ, BENCH_RESULTS_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, str(BENCH / "weight_sync.py"), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["name"] == "weight_sync" and result["quick"] is True
    assert set(result["seconds"]) == {"local", "server_http", "server_disk", "server_broadcast"}
    assert json.loads((tmp_path / "weight_sync.json").read_text()) == result


@pytest.mark.long
def test_grpo_vs_trl_count_quick_prints_a_json_result(tmp_path: Path) -> None:
    import common
    import trl  # noqa: F401 - installed by scripts/setup.sh (the bench extra): fail, never skip, without it

    env = dict(os.environ, BENCH_RESULTS_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, str(BENCH / "grpo_vs_trl.py"), "--task", "count", "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["name"] == "grpo_vs_trl_count" and result["task"] == "count" and result["quick"] is True
    assert result["settings"]["max_new_tokens"] == 192 and result["settings"]["sides"] == ["relayrl", "trl"]
    # --quick starts from the cached SFT warm start (held-out accuracy ~0.45), or, in a fresh clone, from the
    # untrained model, which answers nothing right (measured: 0.0 before, 0.0 after, rewards 0 on both sides)
    before, untrained = result["held_out_accuracy_before"], "using the untrained model" in out
    assert before == 0.0 if untrained else 0.2 < before < 0.8
    acc = {}
    for side in ("relayrl", "trl"):
        curve, held_out = result[side]["reward_curves"][0], result[side]["held_out_accuracy"]
        assert len(curve) == 3 and (max(curve) == 0.0 if untrained else 0.0 < min(curve))
        assert result[side]["final_reward"]["median"] == pytest.approx(common.tail_mean(curve), abs=1e-3)
        assert held_out["values"] == [held_out["median"]]  # one repeat
        assert abs(held_out["median"] - before) <= 0.1, side  # 3 small steps barely move the warm start
        acc[side] = held_out["median"]
    assert result["reward_no_worse"] == {"relayrl": acc["relayrl"] >= acc["trl"] - 0.03}
    assert set(result["relayrl"]["phase_s_per_step"]) >= {"rollout", "ppo_update"}
    assert json.loads((tmp_path / "grpo_vs_trl_count.json").read_text()) == result


@pytest.mark.long
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs 2 cores")
def test_async_vs_sync_quick_runs_pinned_and_unpinned(tmp_path: Path) -> None:
    """The pinned mode really puts the trainer and its server on separate cores, and the result has both ratios."""
    env = dict(os.environ, BENCH_RESULTS_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, str(BENCH / "async_vs_sync.py"), "--task", "count", "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["name"] == "async_vs_sync_count" and result["pinned"] is True and result["quick"] is True
    assert result["ratio"] > 0 and result["ratio_unpinned"] > 0 and "goal_met" in result
    assert result["ratio_of_ceiling"] == pytest.approx(result["ratio"] / result["overlap_ceiling"]["median"], rel=1e-3)
    assert {"sync", "async", "sync_unpinned", "async_unpinned"} <= set(result)


def test_pinning_moves_every_thread_of_a_process(tmp_path: Path) -> None:
    import threading

    sys.path.insert(0, str(BENCH))
    import common

    cores = sorted(os.sched_getaffinity(0))
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, time; [threading.Thread(target=time.sleep, args=(30,), daemon=True).start() for _ in range(3)]; time.sleep(30)",
        ]
    )
    ev = threading.Event()
    t = threading.Thread(target=ev.wait, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60  # the child's three threads have started (however busy the machine)
        while len(os.listdir(f"/proc/{child.pid}/task")) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        if len(cores) < 2:
            pytest.skip("pinning needs 2 cores")
        assert common.pin_trainer_and_servers() == (cores[0], cores[1])
        assert {os.sched_getaffinity(int(tid)) == {cores[0]} for tid in os.listdir("/proc/self/task")} == {True}
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert len(tids) == 4 and all(os.sched_getaffinity(int(tid)) == {cores[1]} for tid in tids)
    finally:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), set(cores))
        ev.set()
        child.kill()


@pytest.mark.long  # two processes importing the trainer (~40 s); CI: test_roofline_flop_count_by_hand
def test_roofline_tiny_config_measures_both_sides(tmp_path: Path) -> None:
    """bench/roofline.py end to end on a 2-layer model: both sides' FLOP/s, peak RSS and the torch.mm peak."""
    out = tmp_path / "roofline.json"
    subprocess.run(
        [sys.executable, str(BENCH / "roofline.py"), "--config", "tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    r = json.loads(out.read_text())
    assert r["peak_gflop_s"] > 0 and r["ratio"] > 0
    for side in ("relayrl", "hf"):
        s = r[side]
        assert s["tokens"] == 64 * 36 + 64 * 8 and s["gflop_s"] > 0 and s["peak_rss_mb"] > 0
        assert 0 < s["useful_fraction_of_peak"] <= s["fraction_of_peak"]
    # relayrl computes the LM head at the 8 loss positions of each row, HF (logits_to_keep) at the last 9
    assert r["relayrl"]["lm_head_positions"] == 64 * 8 and r["hf"]["lm_head_positions"] == 64 * 9
    assert r["relayrl"]["positions_computed"] == r["relayrl"]["tokens"] < r["hf"]["positions_computed"]


def test_roofline_flop_count_by_hand() -> None:
    import roofline

    s = {"h": 4, "layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 2, "inter": 8, "vocab": 10}
    # per token: q 2*4*4 + k,v 2*2*4*2 + o 2*4*4 + mlp 3*2*4*8 = 32 + 32 + 32 + 192 = 288
    # attention of a 3-token document: 2 * 2 * heads 2 * head_dim 2 * 6 pairs = 96
    body = 2 * (3 * 288 + 96)
    assert roofline.count_flops(s, 3, [3], 2, 4) == 3 * body + 4 * 2 * 2 * 4 * 10


def test_generation_real_model_path_stops_on_the_chat_templates_end_of_turn(tmp_path: Path) -> None:
    """generation.py --model on a saved tiny chat model: both sides stop on the template's end-of-turn
    token, generate samples the raw logits (no top-k), and every completion ends on it or at the cap."""
    from relayrl.data.models import build_tiny_model, build_tokenizer

    model_dir = tmp_path / "tinychat"
    build_tiny_model("tiny", seed=0).save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "gen.json"
    subprocess.run(
        [sys.executable, str(BENCH / "generation.py"), "--model", str(model_dir), "--repeats", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    r = json.loads(out.read_text())
    assert r["name"] == "generation_tinychat" and r["ratio"] > 0 and r["generate_samples_raw_logits"] is True
    assert r["stop_token_ids"] == [r["end_of_turn_id"]] == [1]
    run = r["runs"][0]
    assert run["ended_otherwise"] == {"generate": 0, "engine": 0}
    for side in ("generate", "engine"):
        assert run["ended_on_end_of_turn"][side] + run["hit_cap"][side] == 64
