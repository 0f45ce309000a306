"""recipes/vlm_grpo.py: GRPO on the count-the-squares pictures raises the sampled reward (CPU, tiny Qwen2-VL).

Starts from the shipped warm start (``tests/data/vlm_count_warm``: made by the recipe's own
``warm_start(dir, target=0.5, seed=0)``, 160 supervised steps, 0.65 MB); the warm start
itself is exercised by ``test_warm_start_stops_at_its_target``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARM_START = ROOT / "tests" / "data" / "vlm_count_warm"


def _recipe():
    spec = importlib.util.spec_from_file_location("vlm_grpo", ROOT / "recipes" / "vlm_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_raises_the_reward_on_pictures(tmp_path):
    final = _recipe().main([f"warm_start={WARM_START}", f"run_dir={tmp_path}"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward"] for r in rows if "rollout/reward" in r]
    assert len(rewards) == 30 and final["rollout/failed"] == 0
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.5  # the warm start guesses about half the time (its p(right count) is 0.5)
    assert last > first + 0.15


def test_warm_start_stops_at_its_target(tmp_path):
    """A low target is reached after a few steps: the checkpoint loads as a vision model with its processor."""
    from relayrl.api.config import ModelConfig
    from relayrl.data.models import load_model, vision_processor

    out = _recipe().warm_start(tmp_path / "warm", target=0.2, max_steps=10)
    cfg = ModelConfig(path=str(out), tokenizer_path="tiny-vl")
    assert load_model(cfg).config.model_type == "qwen2_vl"
    from relayrl.data.vision import build_image_processor

    assert vision_processor(cfg).to_dict() == build_image_processor().to_dict()  # the processor it trained with
