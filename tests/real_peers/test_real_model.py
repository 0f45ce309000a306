"""A real pretrained model through real servers: SmolLM2-135M-Instruct (``relayrl models pull``, fp32)
served by real SGLang 0.5.23 and vLLM 0.32 that ``recipes/smollm2_grpo.py`` launches itself.

In CI (the real-peer suite), per server: two GRPO steps on the recipe's chat prompts, the server synced
after each (SGLang by broadcast, vLLM from disk). Every step generates with the trainer's own version and
every generated token's logprob is within 1e-4 of the trainer's teacher-forced one at that version
(``mismatch/abs_diff_max``; measured 2.6e-5 and 4.0e-5 through 30 fp32 layers), which can only hold if
the server holds exactly the weights the trainer just pushed, tied embeddings included.

Marked ``long`` (``scripts/test.sh --all``): ten GRPO steps through each server whose reward rises, and
the served greedy output following the trainer's weights through every sync mode each peer supports;
the figures they print are in docs/real_models.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from relayrl.data.real_models import pull
from tests.real_peers.servers import ROOT, peer_env, peer_environ
from tests.real_peers.test_train import TOKEN, launch, watch_versions

pytestmark = [pytest.mark.real_peers, pytest.mark.timeout(2400)]

NAME = "smollm2-135m-instruct"
FP32_TOL = 1e-4  # per token, fp32 server vs the trainer's fp32 forward, 30 layers (measured <= 4.0e-5)
SHORT = [
    "total_steps=2",
    "rollout.batch_size=4",
    "rollout.group_size=4",
    "eval.before_training=false",
    "eval.every_n_steps=0",
    "torch_threads=1",
    "checkpoint.save_final=false",
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The pulled model (the user's cache, ``RELAYRL_CACHE`` or ~/.cache/relayrl: converted once a machine)."""
    return Path(pull(NAME))


def recipe(kind: str, model: Path, tmp_path: Path, *overrides: str) -> tuple[list[dict], list[str], str]:
    """``python recipes/smollm2_grpo.py`` with the recipe's server launched: its metrics rows, the weight
    versions the server reported while it ran, and the server's log."""
    route, update_route, args = launch(kind, peer_env(kind), tmp_path)
    update_route = "/end_weight_update" if kind == "sglang" else update_route  # SGLang: a call per bucket, one end
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "recipes" / "smollm2_grpo.py"), f"model.path={model}", f"run_dir={run_dir}",
           "inference.backend=remote", "inference.n_servers=1", "inference.launch_timeout=600",
           "logging.tensorboard=false", "logging.progress=lines", *args, *overrides]  # fmt: skip
    env = {**peer_environ(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["RELAYRL_ADMIN_TOKEN"] = TOKEN
    log = tmp_path / "logs" / "server-0.log"
    seen: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=watch_versions, args=(log, route, seen, stop))
    watcher.start()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=2300, env=env, cwd=tmp_path)
    finally:
        stop.set()
        watcher.join()
    server_log = log.read_text(errors="replace") if log.exists() else "(no server log)"
    assert done.returncode == 0, f"{done.stderr[-4000:]}\nserver log:\n{server_log[-3000:]}"
    assert "Task was destroyed but it is pending" not in done.stderr, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert server_log.count(f'{update_route} HTTP/1.1" 200') == 1 + rows[-1]["version"]  # launch push + one a step
    return rows, seen, server_log


def check_synced(rows: list[dict], seen: list[str], steps: int) -> None:
    """``steps`` steps, each generated at the trainer's version by a server holding exactly its weights."""
    assert [r["step"] for r in rows if "step" in r and "actor/loss" in r] == list(range(1, steps + 1))
    numeric = [v for v in seen if v.isdigit()]
    assert numeric == [str(v) for v in range(len(numeric))] and len(numeric) >= steps, seen
    for r in rows:
        if "actor/loss" not in r:
            continue
        assert r["actor/staleness_mean"] == 0.0, r["step"]
        assert r["mismatch/abs_diff_max"] <= FP32_TOL, (r["step"], r["mismatch/abs_diff_max"])
        assert r["mismatch/tokens"] >= 4 * 4, r["step"]


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_the_recipe_runs_through_a_launched_real_server_in_sync(kind, smollm2, tmp_path):
    rows, seen, log = recipe(kind, smollm2, tmp_path, *SHORT)
    check_synced(rows, seen, 2)
    assert "--dtype float32" in log.splitlines()[0] and str(smollm2) in log.splitlines()[0]
    gaps = [(round(r["mismatch/abs_diff_mean"], 7), round(r["mismatch/abs_diff_max"], 7)) for r in rows]
    print(f"{kind} serving SmolLM2 (fp32): |Δ logprob| (mean, max) per step {gaps}")


@pytest.mark.long
@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_grpo_through_a_real_server_raises_the_reward(kind, smollm2, tmp_path):
    """The recipe's first ten steps (8 prompts x 8 samples) through the real server: the training reward of
    the last three steps is above that of the first three, every step in sync; sampled held-out accuracy
    before and after is printed (and recorded in docs/real_models.md), not asserted: 50 prompts x 4
    samples move by a few points between seeds."""
    quiet = ["total_steps=10", "checkpoint.save_final=false", "eval.every_n_steps=10"]
    rows, seen, _ = recipe(kind, smollm2, tmp_path, *quiet)
    check_synced(rows, seen, 10)
    reward = [r["rollout/reward"] for r in rows if "actor/loss" in r]
    acc = [r["eval/accuracy_mean"] for r in rows if "eval/accuracy_mean" in r]
    print(f"{kind}: reward per step {[round(x, 3) for x in reward]}; held-out accuracy {acc}")
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.1, reward
