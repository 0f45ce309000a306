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


def test_grpo_raises_the_reward_on_pictures(tmp_path, monkeypatch, capsys):
    """The recipe as it runs by default (the shipped warm start) reaches the outcome its docstring states:
    the mean sampled reward of the first 5 steps is the stated start, the last 5 steps' has at least half
    the stated gain."""
    from tests.test_recipes import check_outcome

    monkeypatch.chdir(ROOT)  # the default warm start is named relative to the repository
    recipe = _recipe()
    assert ROOT / recipe.SHIPPED_WARM_START == WARM_START and WARM_START.is_dir()
    final = recipe.main([f"run_dir={tmp_path}"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward"] for r in rows if "rollout/reward" in r]
    assert len(rewards) == 30 and final["rollout/failed"] == 0
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert (final["reward_first5"], final["reward_last5"]) == (first, last)
    check_outcome((ROOT / "recipes" / "vlm_grpo.py").read_text(), first, last, 30)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith(f"sampled reward: {first:.3f} over the first 5 steps -> {last:.3f}"), summary


def test_warm_start_stops_at_its_target(tmp_path):
    """A low target is reached after a few steps: the checkpoint loads as a vision model with its processor."""
    from relayrl.api.config import ModelConfig
    from relayrl.data.models import load_model, vision_processor

    out = _recipe().warm_start(tmp_path / "warm", target=0.2, max_steps=10)
    cfg = ModelConfig(path=str(out), tokenizer_path="tiny-vl")
    assert load_model(cfg).config.model_type == "qwen2_vl"
    from relayrl.data.vision import build_image_processor

    assert vision_processor(cfg).to_dict() == build_image_processor().to_dict()  # the processor it trained with
