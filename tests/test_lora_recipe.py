"""recipes/algorithms/grpo_lora.yaml learns on the demo task from its shipped SFT warm start,
with a KL reference that is the policy's own base (one model on the train side), and
``relayrl eval RUN_DIR`` evaluates the run's adapter checkpoint merged into its base; a stopped
LoRA run recovers exactly."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch
from transformers import PreTrainedModel

from relayrl import cli
from relayrl.api.config import RunConfig, load_config
from relayrl.trainer import Trainer, train

ROOT = Path(__file__).resolve().parents[1]


def _models() -> dict[int, PreTrainedModel]:
    gc.collect()
    return {id(o): o for o in gc.get_objects() if isinstance(o, PreTrainedModel)}


def _param_bytes(models: list[PreTrainedModel]) -> int:
    """Bytes of the distinct parameter tensors of ``models`` (a shared tensor counts once)."""
    return sum({p.data_ptr(): p.numel() * p.element_size() for m in models for p in m.parameters()}.values())


def test_grpo_lora_recipe_uses_one_model_for_policy_and_reference(tmp_path, monkeypatch):
    """With a KL reference (actor.kl_coef > 0) the recipe's train side holds one base model: the
    reference is the policy with its adapters off. Step 1 trains fresh adapters (B = 0), so the
    policy is its reference exactly; from step 2 on they part."""
    monkeypatch.chdir(ROOT)  # the recipe names its warm start relative to the repository
    overrides = [
        f"run_dir={tmp_path}",
        "total_steps=3",
        "actor.kl_coef=0.001",  # a KL reference, so that it must not cost a second model
        "rollout.batch_size=8",
        "eval.before_training=false",
        "eval.every_n_steps=0",
        "logging.tensorboard=false",
        "logging.progress=off",
        "checkpoint.save_final=false",
    ]
    cfg = load_config(RunConfig, ROOT / "recipes" / "algorithms" / "grpo_lora.yaml", overrides)
    assert cfg.model.lora.rank == 16
    before = _models()
    trainer = Trainer(cfg)
    try:
        # parameters of the models built since: the policy's base (adapters off: the KL reference) plus its
        # adapters, and the LocalEngine's generation copy; a separate reference model would add a third base
        new = [m for k, m in _models().items() if k not in before]
        base = _param_bytes([trainer.engine.model])
        adapters = sum(p.numel() * p.element_size() for p in trainer.actor_engine.model.parameters() if p.requires_grad)
        assert _param_bytes(new) == 2 * base + adapters
        assert trainer.actor.ref_engine.model is trainer.actor_engine.model
        trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kls = [r["actor/kl_loss"] for r in rows if "actor/kl_loss" in r]
    assert len(kls) == 3 and abs(kls[0]) <= 1e-6 and kls[-1] > 1e-6, kls


def test_grpo_lora_recipe_learns_and_eval_applies_its_adapter(tmp_path, monkeypatch, capsys):
    """The recipe as shipped reaches the sampled held-out accuracy its header states for step 25;
    ``relayrl eval RUN_DIR`` says it applied the run's adapter, and scores like the trained policy
    (the base alone would score the stated start)."""
    from tests.test_recipes import check_outcome, stated

    monkeypatch.chdir(ROOT)
    recipe = ROOT / "recipes" / "algorithms" / "grpo_lora.yaml"
    quiet = ["logging.tensorboard=false", "logging.progress=off"]
    train(load_config(RunConfig, recipe, [f"run_dir={tmp_path}", "total_steps=25", *quiet]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    acc = [r["eval/accuracy_mean"] for r in rows if "eval/accuracy_mean" in r]
    assert len(acc) == 2
    check_outcome(recipe.read_text(), acc[0], acc[1], 25)

    capsys.readouterr()
    assert cli.main(["eval", str(tmp_path), "logging.progress=off"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    adapter = str(tmp_path / "checkpoints" / "step_000025" / "actor")
    assert out["model"] == "tests/data/demo_sft" and out["adapter"] == adapter
    assert f"applied the LoRA adapter {adapter} to tests/data/demo_sft" in captured.err
    start, points = stated(recipe.read_text())
    assert out["eval/accuracy_mean"] >= start + (points[25] - start) / 2, out  # the base alone: ~start
    assert abs(out["eval/accuracy_mean"] - acc[1]) <= 0.06, (out, acc)  # the trained policy, resampled


def test_lora_run_recovers_exactly(tmp_path):
    """A LoRA run stopped after step 2 and recovered (adapter, its optimizer state, RNG, data)
    ends at step 3 with the adapter an uninterrupted run has."""
    from safetensors.torch import load_file

    from tests.test_trainer import FAST

    def run(name: str, steps: int, *extra: str) -> Path:
        cfg = load_config(
            RunConfig,
            None,
            [
                f"run_dir={tmp_path / name}",
                *FAST,
                "logging.progress=off",
                "model.lora.rank=8",
                "actor.kl_coef=0.01",
                f"total_steps={steps}",
                "checkpoint.every_n_steps=1",
                "checkpoint.keep_last=3",
                *extra,
            ],
        )
        train(cfg)
        return tmp_path / name / "checkpoints"

    straight = run("straight", 3)
    run("stopped", 2)
    resumed = run("stopped", 3, "recover=auto")

    def adapter(ckpts: Path, step: int) -> dict:
        return load_file(str(ckpts / f"step_{step:06d}" / "actor" / "adapter_model.safetensors"))

    a, b = adapter(straight, 3), adapter(resumed, 3)
    assert a.keys() == b.keys() and len(a) == 7 * 4 * 2
    assert any(not torch.equal(a[k], adapter(straight, 2)[k]) for k in a)  # step 3 trained the adapters
    assert all(torch.equal(a[k], b[k]) for k in a)
