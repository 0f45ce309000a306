"""Every recipe runs: a few steps on the tiny model (smoke tests of the user-facing examples)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from relayrl.api.config import RunConfig, load_config
from relayrl.trainer import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["total_steps=2", "rollout.batch_size=2", "rollout.group_size=2", "gconfig.max_new_tokens=6",
        "data.n_train=32", "data.n_eval=4", "logging.tensorboard=false", "logging.progress=lines",
        "eval.gconfig.max_new_tokens=6", "checkpoint.save_final=false"]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_colocated_lowlevel():
    metrics = _load_script("colocated_lowlevel").main(TINY)
    assert "timing/rollout" in metrics and "actor/loss" in metrics


def test_separate_producer(tmp_path: Path):
    result = _load_script("separate_producer").main([*TINY, "total_steps=4", "eval.every_n_steps=2"])
    assert result["step"] == 4 and result["staleness_max"] <= 2 and "eval/accuracy" in result


def test_remax_with_user_written_reinforce_actor():
    rewards = _load_script("remax_reinforce").main([*TINY, "rollout.group_size=1"])
    assert len(rewards) == 2


def test_colocated_highlevel_cli(tmp_path: Path):
    out = subprocess.run([sys.executable, "recipes/colocated_highlevel.py", f"run_dir={tmp_path}", *TINY],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "metrics.jsonl").exists()


ALGORITHMS = sorted(p.stem for p in (ROOT / "recipes" / "algorithms").glob("*.yaml"))
YAMLS = ["multi_turn", "tool_agent", "gsm8k_grpo"]


@pytest.mark.parametrize("name", ALGORITHMS + YAMLS)
def test_yaml_recipe_trains(tmp_path: Path, name: str):
    path = ROOT / "recipes" / ("algorithms" if name in ALGORITHMS else "") / f"{name}.yaml"
    extra = ["data.train_path=tests/data/gsm8k_sample.jsonl", "data.eval_path=tests/data/gsm8k_sample.jsonl",
             "gconfig.max_new_tokens=6", "eval.gconfig.max_new_tokens=6"] if name == "gsm8k_grpo" else []
    cfg = load_config(RunConfig, path, [f"run_dir={tmp_path}", *TINY, *extra])
    if cfg.rollout.max_staleness > 2:
        cfg.rollout.max_staleness = 2  # keep the smoke run short; eta itself is tested elsewhere
    old = Path.cwd()
    try:
        import os

        os.chdir(ROOT)
        # an untrained model never solves the task, so every DAPO group would be filtered:
        # a reward of coin flips (a fixed function of the completion) gives the filter work
        coin = {"reward_fn": lambda completions, **_: float(zlib.crc32(completions.encode()) % 2)}
        last = train(cfg, **(coin if cfg.rollout.dynamic_filter else {}))
    finally:
        os.chdir(old)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert last["version"] == 2.0
