"""What a new user meets at the command line: environment errors in one line (exit 2, the field or
value named, a traceback only with --debug), usage for a bare ``relayrl train``, user code imported
from the working directory, ``relayrl show`` on a directory of runs and into a closed pipe, and the
curves' KL panel."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

RELAYRL = str(Path(sys.executable).with_name("relayrl"))  # the console script, as a user runs it
FAST = [
    "total_steps=1",
    "rollout.batch_size=2",
    "rollout.group_size=2",
    "gconfig.max_new_tokens=4",
    "data.n_train=8",
    "data.n_eval=2",
    "logging.tensorboard=false",
    "logging.progress=off",
]


def _run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RELAYRL, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _forked(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``relayrl ARGS`` as ``_run``, in a process forked with the trainer already imported (the same
    ``relayrl.cli.main`` the console script calls; the tests of what the script itself does use ``_run``)."""
    from tests.reliability.audit import run_cli

    return run_cli(args, cwd=cwd, timeout=timeout)


def _one_line(p: subprocess.CompletedProcess[str], *names: str) -> None:
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("relayrl ")]
    assert len(lines) == 1, p.stderr[-3000:]
    for name in names:
        assert name in lines[0], lines[0]


def test_bare_train_prints_usage_and_exits_2(tmp_path):
    p = _run(["train"], tmp_path, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("usage: relayrl train CONFIG.yaml"), p.stderr
    assert not (tmp_path / "runs").exists()  # nothing was trained


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (
            ["train", "model.path=checkpoints/missing/actor"],
            ["model.path='checkpoints/missing/actor'", "no such directory"],
        ),
        (["train", "data.task=file", "data.train_path=nope.jsonl"], ["data.train_path='nope.jsonl'", "does not exist"]),
        (["train", "inference.device=cuda"], ["inference.device='cuda'", "no CUDA device", "inference.device=auto"]),
        (["sft", "model.path=./nowhere"], ["model.path='./nowhere'"]),
        (["eval", "model.path=/no/such/dir"], ["model.path='/no/such/dir'"]),
        (["serve", "--model", "/no/such/dir"], ["model.path='/no/such/dir'"]),
    ],
)
def test_environment_errors_are_one_line(tmp_path, args, names):
    if "cuda" in " ".join(args):
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA device")
    _one_line(_forked(args, tmp_path, timeout=120), *names)


def test_bad_yaml_names_line_and_column(tmp_path):
    (tmp_path / "run.yaml").write_text("total_steps: 3\nrollout: {batch_size: 2\nseed: 1\n")
    _one_line(_forked(["train", "run.yaml"], tmp_path, timeout=60), "run.yaml", "line 3, column 5")


def test_busy_port_names_the_port(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _one_line(_forked(["serve", "--model", "tiny", "--port", str(port)], tmp_path, 120), f"port={port}", "--port")


def test_filter_exhaustion_is_one_line_and_debug_shows_the_traceback(tmp_path):
    # A random model never answers 2-digit sums: every group has equal rewards and is filtered.
    args = ["train", *FAST, "rollout.dynamic_filter=true", "rollout.filter_patience=1", f"run_dir={tmp_path / 'r'}"]
    _one_line(_forked(args, tmp_path), "groups in a row were filtered", "rollout.filter_patience")
    p = _forked([*args, "--debug"], tmp_path)
    assert p.returncode == 1 and "Traceback" in p.stderr and "FilterExhausted" in p.stderr


def test_user_code_imports_from_the_working_directory(tmp_path):
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(
        "CALLS = []\n\ndef score(completions, **_):\n    return 1.0 if completions.strip() else 0.0\n"
    )
    p = _run(["train", *FAST, "reward_fn=my_pkg.scoring:score", "run_dir=r"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["run_dir"] == "r"
    # set-up says what it is doing before the first step
    setup = [ln.split("relayrl.trainer: ")[1] for ln in p.stderr.splitlines() if "relayrl.trainer: set-up:" in ln]
    assert setup[0] == "set-up: loading the model tiny" and setup[-1].startswith("set-up: done in"), p.stderr


def test_demo_sft_reports_progress_between_probes(tmp_path, capfd):
    """The demo's SFT probes its accuracy every 100 steps but logs a line every 20."""
    import dataclasses

    from relayrl.data.tasks import make_task
    from relayrl.demo import DemoSettings, warm_start
    from relayrl.utils.logging import MetricLogger

    s = dataclasses.replace(DemoSettings.quick(), sft_steps=40, sft_probe_every=100, sft_batch_size=8)
    train_rows, held_out = make_task("arithmetic", 64, 8, 2, 1)
    logger = MetricLogger(tmp_path, tensorboard=False)
    try:
        warm_start(s, train_rows, held_out, tmp_path, 1, logger)
    finally:
        logger.close()
    err = capfd.readouterr().err
    assert "sft step 20/40" in err and "sft step 40/40" in err, err
    assert "probe greedy accuracy" not in err  # no probe before step 100


def _rollouts(run: Path, n: int) -> None:
    (run / "rollouts").mkdir(parents=True)
    row = {"prompt": "1+2=", "completion": "3", "reward": 1.0, "versions": [0]}
    (run / "rollouts" / "step_000001.jsonl").write_text((json.dumps(row) + "\n") * n)


def test_show_finds_the_run_inside_a_directory_of_runs(tmp_path):
    _rollouts(tmp_path / "demo" / "grpo", 2)
    (tmp_path / "demo" / "sft").mkdir()
    p = _run(["show", "demo"], tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("completion: '3'") == 2 and "grpo" in p.stdout.splitlines()[0]
    _rollouts(tmp_path / "demo" / "other", 1)  # two runs: say which there are
    p = _run(["show", "demo"], tmp_path, timeout=60)
    assert p.returncode == 2 and "demo/grpo" in p.stderr and "demo/other" in p.stderr


def test_show_into_head_is_quiet(tmp_path):
    _rollouts(tmp_path / "run", 20000)
    p = subprocess.run(f"{RELAYRL} show run | head -2", shell=True, cwd=tmp_path, capture_output=True, text=True)
    assert len(p.stdout.splitlines()) == 2
    assert p.stderr == "", p.stderr


def test_curves_kl_panel_is_the_kl_to_the_reference(tmp_path):
    from relayrl.utils.plot import figure

    rows = [{"step": s, "actor/kl_loss": 0.01 * s, "actor/behav_kl": 0.5, "actor/approx_kl": 0.2} for s in (1, 2, 3)]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ax = next(a for a in figure([tmp_path / "a"]).axes if "KL" in a.get_title())
    assert ax.get_title() == "KL to reference"
    assert list(ax.lines[0].get_ydata()) == [0.01, 0.02, 0.03]
    # Without a KL term the panel says it shows the generator-trainer gap.
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text(json.dumps({"step": 1, "actor/behav_kl": 0.5}) + "\n")
    ax = next(a for a in figure([tmp_path / "b"]).axes if "behav_kl" in a.get_title() or "KL" in a.get_title())
    assert ax.get_title() == "generator-trainer gap (behav_kl)"


@pytest.mark.parametrize(
    "args",
    [
        ["train", "model.path=checkpoints/missing/actor"],
        ["train", "data.task=file", "data.train_path=nope.jsonl"],
        ["train", "run.yaml"],  # bad YAML
        ["eval", "model.path=/no/such/dir"],
        ["sft", "model.path=./nowhere"],
    ],
)
def test_config_errors_are_reported_before_the_model_code_is_imported(tmp_path, args):
    """A wrong path or bad YAML is one line without importing transformers (~10 s of CPU on this
    machine): preflight runs before the trainer is imported, and the CLI classifies an error without
    importing the modules that define the other error types."""
    (tmp_path / "run.yaml").write_text("rollout: {batch_size: 2\n")
    probe = (
        "import sys; from relayrl.cli import main; rc = main(sys.argv[1:]); print(rc, 'transformers' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", probe, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["2", "False"], (p.stdout, p.stderr[-2000:])
    assert len([ln for ln in p.stderr.splitlines() if ln.startswith("relayrl ")]) == 1, p.stderr
