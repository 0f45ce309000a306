"""``relayrl doctor``: each cause of a generator–trainer gap injected into a real run (or its
record), and the doctor names it first; a healthy fp32 run is called healthy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relayrl.api.config import RunConfig, load_config
from relayrl.data.families import build_tiny_family
from relayrl.data.models import build_tokenizer
from relayrl.doctor.replay import diagnose
from relayrl.trainer import train

FAST = [
    "rollout.batch_size=2",
    "rollout.group_size=2",
    "gconfig.max_new_tokens=8",
    "data.n_train=64",
    "data.n_eval=4",
    "train.optimizer.lr=1e-3",
    "actor.entropy_coef=0.01",
    "logging.tensorboard=false",
    "logging.progress=off",
    "logging.doctor_every=1",
    "eval.every_n_steps=0",
    "eval.before_training=false",
]


def run(tmp_path: Path, name: str, *overrides: str) -> str:
    cfg = load_config(RunConfig, None, [f"run_dir={tmp_path / name}", *FAST, *overrides])
    train(cfg)
    return cfg.run_dir


def gpt2_dir(tmp_path: Path, family: str = "gpt2") -> str:
    """A tiny GPT-2 (config dropout 0.1; or another family) with the offline tokenizer, as a checkpoint directory."""
    path = tmp_path / family
    build_tiny_family(family, seed=1).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def test_healthy_fp32_run_via_the_cli(tmp_path):
    run_dir = run(tmp_path, "ok", "total_steps=2")
    out = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "doctor", run_dir, "--step", "2"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "healthy" in out.stdout
    rep = json.loads((Path(run_dir) / "doctor" / "report_step_2.json").read_text())
    assert rep["healthy"] and rep["top_cause"] is None and rep["observed_abs_diff_mean"] < 1e-4
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mismatch/abs_diff_max"] < 1e-4 and r["mismatch/ess"] > 0.999 for r in rows)
    bad = subprocess.run([sys.executable, "-m", "relayrl.cli", "doctor", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and "no doctor records" in bad.stderr


@pytest.mark.parametrize(
    "cause, overrides",
    [
        ("dropout", ["train.dropout=true"]),
        ("dtype / autocast", ["model.dtype=bfloat16"]),
        ("sampling renormalisation", ["gconfig.top_k=4"]),
        ("sampling renormalisation", ["gconfig.top_p=0.6"]),
        ("staleness", ["rollout.max_staleness=1", "actor.loss=ppo", "train.optimizer.lr=0.02", "total_steps=3"]),
    ],
)
def test_injected_cause_is_named_first(tmp_path, cause, overrides):
    args = [f"model.path={gpt2_dir(tmp_path)}"] if cause in ("dropout", "dtype / autocast") else []
    run_dir = run(tmp_path, cause.split()[0], "total_steps=2", *args, *overrides)
    rep = diagnose(run_dir)
    assert not rep["healthy"], rep
    assert rep["top_cause"] == cause, rep["causes"]
    assert rep["causes"][cause]["share"] > 0.5, rep["causes"]


def test_token_drift_is_named_first(tmp_path):
    """A workflow that edits the completion after sampling: the trainer scores tokens the generator
    never produced (injected into the record of a healthy GPT-2 run: a third of the completion
    tokens replaced, the trainer's logprobs those of the edited tokens)."""
    from transformers import AutoModelForCausalLM

    from relayrl.doctor.replay import _Scorer

    run_dir = run(tmp_path, "drift", "total_steps=1", f"model.path={gpt2_dir(tmp_path)}")
    path = Path(run_dir) / "doctor" / "step_1" / "record.pt"
    rec = torch.load(path, weights_only=False)
    b = rec["batch"]
    rows, cols = b["loss_mask"].bool().nonzero(as_tuple=True)
    pick = torch.arange(0, len(rows), 3)
    b["input_ids"][rows[pick], cols[pick]] = (b["input_ids"][rows[pick], cols[pick]] + 7) % 100 + 3
    model = AutoModelForCausalLM.from_pretrained(str(path.parent / "model"))
    scorer = _Scorer(model, b, 1.0)
    rec["trainer_logp"] = scorer.logp(scorer.logits()).float()
    torch.save(rec, path)
    rep = diagnose(run_dir)
    assert rep["top_cause"] == "token drift", rep["causes"]
    assert rep["drifted_tokens"] > 0


def _inject(run_dir: str, generator) -> dict:  # noqa: ANN001
    """Replace the record's generator logprobs by ``generator(scorer, batch)``: a generator with one defect."""
    from transformers import AutoModelForCausalLM

    from relayrl.doctor.replay import _Scorer

    path = Path(run_dir) / "doctor" / "step_1" / "record.pt"
    rec = torch.load(path, weights_only=False)
    scorer = _Scorer(AutoModelForCausalLM.from_pretrained(str(path.parent / "model")), rec["batch"], 1.0)
    mask = rec["batch"]["loss_mask"].bool()
    rec["batch"]["logprobs"] = torch.where(mask, generator(scorer, rec["batch"]).float(), 0.0)
    torch.save(rec, path)
    return diagnose(run_dir)


def test_lm_head_precision_is_named_first(tmp_path):
    """A generator whose LM head computes the logits in bf16 (the body in fp32)."""
    run_dir = run(tmp_path, "head", "total_steps=1", f"model.path={gpt2_dir(tmp_path)}")
    rep = _inject(run_dir, lambda s, b: s.logp(s.logits(), round_to=torch.bfloat16))
    assert rep["top_cause"] == "LM-head precision", rep["causes"]


def test_moe_routing_is_named_first(tmp_path):
    """A Mixtral generator that routed tokens to other experts than the trainer's router picks (as
    bf16 rounding flips near-tied top-k choices); the trainer does not replay them."""
    run_dir = run(
        tmp_path, "moe", "total_steps=1", f"model.path={gpt2_dir(tmp_path, 'mixtral')}", "actor.replay_routing=false"
    )

    def generator(s, b):  # noqa: ANN001
        experts = b["routed_experts"]
        b["routed_experts"] = torch.where(experts >= 0, (experts + 1) % 4, experts)  # every choice moved
        return s.logp(s.logits(experts=True))

    rep = _inject(run_dir, generator)
    assert rep["top_cause"] == "MoE routing", rep["causes"]


def test_raw_logprobs_at_temperature_are_named_first(tmp_path):
    """A generator that samples at temperature 0.7 but reports the raw distribution's logprobs
    (temperature 1, as a server returning unprocessed logprobs does): the doctor names the
    temperature and the one the logprobs come from."""
    run_dir = run(tmp_path, "raw", "total_steps=1", f"model.path={gpt2_dir(tmp_path)}", "gconfig.temperature=0.7")
    rep = _inject(run_dir, lambda s, b: s.logp(s.logits()))  # the scorer's temperature is 1.0
    assert rep["settings"]["temperature"] == 0.7
    assert rep["top_cause"] == "temperature", rep["causes"]
    assert rep["causes"]["temperature"]["share"] > 0.9, rep["causes"]
    assert rep["generator_temperature"] == 1.0


def test_trainer_at_another_temperature_is_named_first(tmp_path):
    """The trainer scores at temperature 1 (an actor built from code with its own temperature) while
    the generator sampled and reported at 0.7: named, with 0.7 as the generator's temperature."""
    from transformers import AutoModelForCausalLM

    from relayrl.doctor.replay import _Scorer

    run_dir = run(tmp_path, "t", "total_steps=1", f"model.path={gpt2_dir(tmp_path)}", "gconfig.temperature=0.7")
    path = Path(run_dir) / "doctor" / "step_1" / "record.pt"
    rec = torch.load(path, weights_only=False)
    assert rec["gconfig"]["temperature"] == 0.7
    scorer = _Scorer(AutoModelForCausalLM.from_pretrained(str(path.parent / "model")), rec["batch"], 1.0)
    rec["trainer_logp"], rec["temperature"] = scorer.logp(scorer.logits()).float(), 1.0
    torch.save(rec, path)
    rep = diagnose(run_dir)
    assert rep["top_cause"] == "temperature", rep["causes"]
    assert rep["causes"]["temperature"]["share"] > 0.9, rep["causes"]
    assert rep["generator_temperature"] == 0.7


@pytest.mark.parametrize("entropy_coef", [0.01, 0.0])
def test_saved_rollouts_carry_the_trainers_per_token_entropy(tmp_path, entropy_coef):
    """The update's forward records each token's entropy in the batch (with the entropy bonus on or
    off): it equals the softmax entropy of the trainer's logits at the weights before the update
    (the doctor record's), within 1e-5, and the saved rollouts carry it (4 decimals)."""
    from transformers import AutoModelForCausalLM

    from relayrl.trainer import Trainer
    from relayrl.utils.rollouts import read_step

    cfg = load_config(
        RunConfig,
        None,
        [f"run_dir={tmp_path / 'ent'}", *FAST, "total_steps=2", "gconfig.temperature=0.8"],
    )
    cfg.actor.entropy_coef = entropy_coef
    trainer = Trainer(cfg)
    seen: list[dict] = []
    update = trainer.actor.ppo_update
    trainer.actor.ppo_update = lambda batch: (seen.append(batch), update(batch))[1]  # type: ignore[method-assign]
    trainer.fit()
    trainer.close()
    for step, batch in enumerate(seen, 1):
        where = Path(cfg.run_dir) / "doctor" / f"step_{step}"
        model = AutoModelForCausalLM.from_pretrained(str(where / "model"), dtype=torch.float32).eval()
        ids, am = batch["input_ids"], batch["attention_mask"].long()
        with torch.no_grad():
            pos = (am.cumsum(1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits.double() / 0.8
        logp = logits.log_softmax(-1)
        ref = torch.zeros(ids.shape, dtype=torch.float64)
        ref[:, 1:] = -(logp.exp() * logp).sum(-1)[:, :-1]  # token t: the distribution it was drawn from
        gen = batch["loss_mask"].bool()
        got = batch["entropy"].double()
        assert float((got - ref)[gen].abs().max()) < 1e-5
        assert float(ref[gen].min()) > 0.1  # a real distribution, not zeros
        rows = list(read_step(Path(cfg.run_dir), step))
        assert rows
        for r in rows:
            i, n = r["i"], len(r["tokens"]["ids"])
            end = int(am[i].nonzero().max()) + 1
            assert r["tokens"]["ent"] == [round(float(v), 4) for v in batch["entropy"][i, end - n : end]]
