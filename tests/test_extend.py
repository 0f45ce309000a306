"""Extension points: user code from YAML / the command line, and registry declarations acted on."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from relayrl.api.config import ActorConfig
from relayrl.train import algorithms as A
from relayrl.train.actor import PPOActor
from tests.test_actor import make_batch, make_engine

ROOT = Path(__file__).resolve().parents[1]

AGENTS = '''
from relayrl.rollout.workflows import RLVRWorkflow


class Solver(RLVRWorkflow):
    """RLVR that records each episode it runs (tag) in a file: proof the user class ran."""

    def __init__(self, reward_fn, gconfig, tokenizer, reward_pool=None, tag="", marker=""):
        super().__init__(reward_fn, gconfig, tokenizer, reward_pool=reward_pool)
        self.tag, self.marker = tag, marker

    async def arun_episode(self, engine, data):
        with open(self.marker, "a") as fh:
            fh.write(f"{self.tag} {data['id']}\\n")
        return await super().arun_episode(engine, data)


def constant_reward(prompt, completions, prompt_ids, completion_ids, value=0.0, **row):
    return value


NOT_A_WORKFLOW = 3
'''

EXTRAS = """
from relayrl.data.tasks import make_task, register_task


@register_task("tiny_add")
def tiny_add(n_train, n_eval, difficulty, seed):
    train, held_out = make_task("arithmetic", n_train, n_eval, 1, seed)
    for row in train + held_out:
        row["id"] = "tiny-" + str(row["id"])
    return train, held_out
"""


@pytest.fixture
def user_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A package ``my_pkg`` (agents.py, extras.py) outside the repository, on sys.path."""
    pkg = tmp_path / "user" / "my_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "agents.py").write_text(textwrap.dedent(AGENTS))
    (pkg / "extras.py").write_text(textwrap.dedent(EXTRAS))
    _forget_my_pkg()  # another test's my_pkg (tests/test_docs.py writes its own)
    monkeypatch.syspath_prepend(str(pkg.parent))
    yield pkg.parent
    _forget_my_pkg()


def _forget_my_pkg() -> None:
    """Unload the user package ``my_pkg`` and unregister what it registered (tests write their own)."""
    from relayrl.data.tasks import TASKS
    from relayrl.rewards.registry import REWARDS
    from relayrl.rollout.workflows import WORKFLOWS
    from relayrl.train.registry import ADVANTAGES, LOSSES

    for name in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        del sys.modules[name]
    for registry in (TASKS, REWARDS, WORKFLOWS, ADVANTAGES, LOSSES):
        for key, entry in list(registry.items()):
            if str(getattr(getattr(entry, "fn", entry), "__module__", "")).startswith("my_pkg"):
                del registry[key]


def test_relayrl_train_runs_a_user_workflow_reward_and_task_with_no_script(user_pkg: Path, tmp_path: Path):
    """``relayrl train my.yaml workflow=my_pkg.agents:Solver`` in a real subprocess: the user class
    generates every episode with its YAML kwargs, the user reward (with reward_kwargs) scores them,
    and a task registered by a module named in ``imports`` supplies the rows."""
    marker = tmp_path / "episodes.txt"
    cfg = tmp_path / "my.yaml"
    cfg.write_text(
        textwrap.dedent(
            f"""\
            run_dir: {tmp_path / "run"}
            total_steps: 1
            imports: [my_pkg.extras]
            workflow_kwargs: {{tag: solver-ran, marker: {marker}}}
            reward_fn: my_pkg.agents:constant_reward
            reward_kwargs: {{value: 0.25}}
            data: {{task: tiny_add, n_train: 16, n_eval: 2}}
            rollout: {{batch_size: 2, group_size: 2}}
            gconfig: {{max_new_tokens: 4}}
            eval: {{gconfig: {{max_new_tokens: 4}}}}
            logging: {{tensorboard: false, progress: off}}
            checkpoint: {{save_final: false}}
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": f"{user_pkg}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "train", str(cfg), "workflow=my_pkg.agents:Solver"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = marker.read_text().splitlines()
    assert len(lines) >= 4 and all(line.startswith("solver-ran tiny-") for line in lines), lines
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["rollout/reward"] == 0.25  # the user reward, with its YAML argument
    assert all(str(i).startswith("tiny-") for i in rows[-1]["prompt_ids"])  # the registered user task's rows


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "workflow=my_pkg.agents:Solvr",
            "workflow='my_pkg.agents:Solvr': module 'my_pkg.agents' has no attribute 'Solvr'",
        ),
        ("workflow=no_such_pkg.mod:Solver", "workflow='no_such_pkg.mod:Solver': module 'no_such_pkg.mod' not found"),
        (
            "workflow=my_pkg.agents:NOT_A_WORKFLOW",
            "workflow='my_pkg.agents:NOT_A_WORKFLOW' is of type int, expected a RolloutWorkflow subclass",
        ),
        ("workflow=rlvx", "workflow='rlvx' is not registered; did you mean 'rlvr'?"),
        ("workflow_kwargs.bogus=1", "workflow_kwargs.bogus: workflow='rlvr' takes no argument 'bogus'"),
        ("reward_fn=gsm9k", "reward_fn='gsm9k' is not registered; did you mean 'gsm8k'?"),
        ("reward_fn=my_pkg.agents:nope", "reward_fn='my_pkg.agents:nope': module 'my_pkg.agents' has no attribute"),
        ("data.task=aritmetic", "data.task='aritmetic' is not registered; did you mean 'arithmetic'?"),
        ("data.task=my_pkg.extras:tiny_add", "reward_fn is empty and data.task='my_pkg.extras:tiny_add' has no"),
        ("imports=[no_such_module]", "imports[0]='no_such_module': module not found"),
        ("actor.loss=my_pkg.agents:NOT_A_WORKFLOW", "actor.loss='my_pkg.agents:NOT_A_WORKFLOW' is of type int"),
        ("actor.adv_estimator=my_pkg:gae", "actor.adv_estimator='my_pkg:gae': module 'my_pkg' has no attribute 'gae'"),
    ],
)
def test_bad_extension_values_fail_in_one_line_naming_field_and_path(user_pkg, tmp_path, capsys, override, message):
    from relayrl.cli import main

    assert main(["train", f"run_dir={tmp_path / 'run'}", override]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"relayrl train: {message}"), err
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing was built


def test_sft_task_by_path(user_pkg):
    from relayrl.api.commands import SFTDataConfig
    from relayrl.sft import sft_rows

    train, held_out = sft_rows(SFTDataConfig(task="my_pkg.extras:tiny_add", n_train=3, n_eval=1), seed=0)
    assert all(str(r["id"]).startswith("tiny-") for r in train + held_out)
    assert len(train) == 3 and len(held_out) == 1 and all(r["correct"] for r in train)


# ------------------------------------------------------------------ declarations, not names


def _copy_of_decoupled(**kw: object):
    """A user loss with the same math as decoupled_ppo (another function, another name)."""
    return A.decoupled_ppo_loss(**kw)


def _stale_batch(eng, tokenizer):
    batch = make_batch(eng, tokenizer, seed=2)
    g = torch.Generator().manual_seed(0)
    batch["logprobs"] = (batch["logprobs"] - 0.8 * torch.rand(batch["logprobs"].shape, generator=g)) * batch[
        "loss_mask"
    ]
    eng.set_version(3)
    batch["versions"] = torch.where(batch["loss_mask"], torch.randint(1, 4, batch["versions"].shape, generator=g), -1)
    return batch


def _run(loss: str, tiny_model, tokenizer) -> tuple[list[dict[str, float]], dict[str, torch.Tensor], list]:
    eng = make_engine(tiny_model)
    batch = _stale_batch(eng, tokenizer)
    cfg = ActorConfig(loss=loss, behav_imp_weight_cap=1.5, n_minibatches=2)
    actor = PPOActor(cfg, eng, seed=0)
    actor.prepare(batch)
    stats = actor.ppo_update(batch)
    return stats, batch, [p.detach().clone() for p in eng.model.parameters()]


def test_user_loss_declaring_needs_prox_logp_gets_exactly_what_decoupled_ppo_gets(tiny_model, tokenizer):
    A.register_loss("user_decoupled", needs_prox_logp=True, reads=A.loss_entry("decoupled_ppo").reads)(
        _copy_of_decoupled
    )
    try:
        ref_stats, ref_batch, ref_params = _run("decoupled_ppo", tiny_model, tokenizer)
        stats, batch, params = _run("user_decoupled", tiny_model, tokenizer)
        # named by path, the registered function keeps its declaration
        assert A.loss_entry(f"{__name__}:_copy_of_decoupled").needs_prox_logp
    finally:
        del A.LOSSES["user_decoupled"]
    assert "prox_logp" in batch and torch.equal(batch["prox_logp"], ref_batch["prox_logp"])
    assert stats == ref_stats and 0 < stats[0]["behav_capped_frac"] < 1
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    assert not A.loss_entry(f"{__name__}:_copy_of_decoupled").needs_prox_logp  # unregistered: no needs declared


def test_without_the_declaration_the_user_loss_gets_no_proximal_policy(tiny_model, tokenizer):
    """The same function registered without ``needs_prox_logp`` gets no ``prox_logp``: the
    declaration, not the name, is what the actor acts on."""
    A.register_loss("user_plain")(_copy_of_decoupled)
    try:
        with pytest.raises(ValueError, match="decoupled_ppo needs prox_logp"):
            _run("user_plain", tiny_model, tokenizer)
    finally:
        del A.LOSSES["user_plain"]


def test_a_loss_is_given_the_actor_fields_it_reads_by_name(tiny_model, tokenizer):
    seen: list[dict[str, object]] = []

    @A.register_loss("user_reads", reads=("kl_coef", "eps_clip"))
    def user_reads(logp, advantages, loss_mask, cu_seqlens, **kw):
        seen.append({k: v for k, v in kw.items() if k in ActorConfig.__dataclass_fields__})
        return -(logp * advantages)[loss_mask].mean(), {}

    try:
        eng = make_engine(tiny_model)
        actor = PPOActor(ActorConfig(loss="user_reads", eps_clip=0.3), eng)
        actor.ppo_update(actor.prepare(make_batch(eng, tokenizer)))
        assert seen and all(s == {"kl_coef": 0.0, "eps_clip": 0.3} for s in seen)
    finally:
        del A.LOSSES["user_reads"]


def test_user_group_estimator_is_checked_for_group_ids(tiny_model, tokenizer):
    @A.register_advantage("user_group_mean", needs_groups=True, reads=("adv_eps",))
    def user_group_mean(rewards, loss_mask, group_id, **_):
        return A.grpo_advantage(rewards, loss_mask, group_id, adv_norm=False)

    try:
        eng = make_engine(tiny_model)
        batch = make_batch(eng, tokenizer)
        actor = PPOActor(ActorConfig(adv_estimator="user_group_mean"), eng)
        out = actor.compute_advantages(dict(batch))
        ref = PPOActor(ActorConfig(adv_estimator="dr_grpo"), eng).compute_advantages(dict(batch))
        assert torch.equal(out["advantages"], ref["advantages"])
        del batch["group_id"]
        with pytest.raises(ValueError, match="adv_estimator='user_group_mean' needs the sequence-level batch key"):
            actor.compute_advantages(batch)
        with pytest.raises(ValueError, match=r"declares reads=\['not_a_field'\]"):
            A.register_advantage("user_group_mean", needs_groups=True, reads=("not_a_field",))(user_group_mean)
            PPOActor(ActorConfig(adv_estimator="user_group_mean"), eng)
    finally:
        del A.ADVANTAGES["user_group_mean"]


def test_needs_critic_and_needs_ref_are_declarations():
    from relayrl.train.actor import needs_critic, needs_reference

    assert needs_critic(ActorConfig(adv_estimator="gae")) and not needs_critic(ActorConfig())
    assert not needs_reference(ActorConfig()) and needs_reference(ActorConfig(kl_coef=0.1))

    @A.register_loss("user_ref_loss", needs_ref=True)
    def user_ref_loss(**kw):
        return A.ppo_loss(**kw)

    try:
        assert needs_reference(dataclasses.replace(ActorConfig(), loss="user_ref_loss"))
    finally:
        del A.LOSSES["user_ref_loss"]
