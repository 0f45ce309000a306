"""The README's code runs, and every relative link in the docs points at a file that exists."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_tour_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The tour's code as it stands (20 steps, its own workflow, grpo.yaml's warm start) reaches the
    sampled held-out accuracy the README states under it."""
    from tests.test_recipes import check_outcome

    readme = (ROOT / "README.md").read_text()
    tour = readme.split("## A 60-second tour", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", tour, re.S).group(1)
    assert '["total_steps=20",' in code
    monkeypatch.chdir(ROOT)  # the tour names recipes/ relative to the repository
    quiet = f'["run_dir={tmp_path}", "logging.tensorboard=false", "checkpoint.save_final=false", "total_steps=20",'
    exec(compile(code.replace('["total_steps=20",', quiet), "README.md", "exec"), {"__name__": "readme_tour"})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "rollout/reward" in r]) == 20
    acc = [r["eval/accuracy_mean"] for r in rows if "eval/accuracy_mean" in r]  # MyWorkflow, 4 samples a prompt
    assert len(acc) == 2
    check_outcome(tour.split("```", 2)[2], acc[0], acc[1], 20)


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


TINY = [
    "total_steps=1",
    "rollout.batch_size=2",
    "rollout.group_size=2",
    "gconfig.max_new_tokens=4",
    "eval.gconfig.max_new_tokens=4",
    "data.n_train=8",
    "data.n_eval=2",
    "logging.tensorboard=false",
    "logging.progress=off",
    "checkpoint.save_final=false",
]


# what shows that the doc's own code ran: a metric only it produces, or a resolved config value
PROOF = {
    "write_a_workflow.md": lambda row, cfg: "rollout/solved" in row,
    "write_a_loss.md": lambda row, cfg: "actor/clip_frac" in row and cfg["actor"]["loss"] == "clipped_reinforce",
    "extend.md": lambda row, cfg: cfg["reward_fn"] == "yes_no" and cfg["actor"]["loss_norm_len"] == 4,
}


@pytest.mark.parametrize("doc", sorted(PROOF))
def test_yaml_route_examples_run(doc: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Each doc's YAML route, as a user follows it: its ``# file:`` blocks written out, then its
    ``relayrl train`` command run through the real CLI (one tiny step instead of 20)."""
    from relayrl.cli import main

    text = (ROOT / "docs" / doc).read_text()
    blocks = re.findall(r"```(python|yaml|bash)\n(.*?)```", text, re.S)
    files = {m.group(1): code for _, code in blocks if (m := re.match(r"# file: (\S+)\n", code))}
    assert any(name.endswith(".yaml") for name in files) and any(name.startswith("my_pkg/") for name in files)
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    commands = [line.split("#")[0].split() for _, code in blocks for line in code.splitlines()]
    commands = [c for c in commands if c[:2] == ["relayrl", "train"]]
    assert commands, f"{doc} shows no relayrl train command"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    _forget_my_pkg()  # another test's my_pkg
    try:
        for cmd in commands:
            args = [a for a in cmd[2:] if not a.startswith("total_steps=")]
            assert main(["train", *args, *TINY, f"run_dir={tmp_path / 'run'}"]) == 0, cmd
            rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
            cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
            assert rows[-1]["step"] == 1 and PROOF[doc](rows[-1], cfg), (rows[-1], cfg)
    finally:
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
