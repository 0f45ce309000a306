"""The trainer end to end: the four modes, recovery, plots, progress output."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relayrl.api.config import RunConfig, load_config
from relayrl.trainer import train
from tests.reliability.audit import run_cli, start_cli

WARM = Path(__file__).parent / "data" / "demo_sft"  # an SFT warm start that answers some sums right

FAST = [
    "rollout.batch_size=2",
    "rollout.group_size=2",
    "gconfig.max_new_tokens=6",
    "data.n_train=64",
    "data.n_eval=4",
    # A random model earns no reward, so advantages are 0: the entropy bonus keeps gradients non-zero.
    "train.optimizer.lr=1e-3",
    "actor.entropy_coef=0.01",
    "logging.tensorboard=false",
    "logging.progress=lines",
    "eval.gconfig.max_new_tokens=6",
]


def _cfg(tmp_path: Path, *overrides: str) -> RunConfig:
    return load_config(RunConfig, None, [f"run_dir={tmp_path / 'run'}", *FAST, *overrides])


def _metrics(run_dir: str | Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "mode",
    [
        ["rollout.max_staleness=0", "inference.backend=local"],
        ["rollout.max_staleness=2", "inference.backend=local", "actor.loss=decoupled_ppo"],
        # launched servers serve the policy's model, overrides included (a vocab they did not have once),
        # ... and take the weights by collective broadcast (gloo)
        pytest.param(
            [
                "rollout.max_staleness=0",
                "inference.backend=remote",
                "inference.n_servers=1",
                "model.vocab_size=128",
                "inference.weight_sync=broadcast",
            ],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["rollout.max_staleness=1", "inference.backend=remote", "inference.n_servers=2"], marks=pytest.mark.slow
        ),
    ],
    ids=["sync-colocated", "async-colocated", "sync-disaggregated", "async-disaggregated"],
)
def test_modes_train_and_respect_staleness(tmp_path: Path, mode: list[str]) -> None:
    cfg = _cfg(tmp_path, "total_steps=3", "eval.every_n_steps=3", "checkpoint.every_n_steps=2", *mode)
    last = train(cfg)
    rows = _metrics(cfg.run_dir)
    steps = [r["step"] for r in rows]
    assert steps == [1, 2, 3]
    eta = cfg.rollout.max_staleness
    assert all(r["rollout/staleness_max"] <= eta for r in rows), [r["rollout/staleness_max"] for r in rows]
    assert [r["version"] for r in rows] == [1.0, 2.0, 3.0]
    # step 3 evaluated all 4 held-out prompts, none failed; random weights answer none of them (as in rollout)
    assert {k: v for k, v in rows[-1].items() if k.startswith("eval/")} == {
        "eval/accuracy": 0.0,
        "eval/reward": 0.0,
        "eval/n_prompts": 4.0,
        "eval/rejected": 0.0,
        "eval/failed": 0.0,
    }
    assert all(r["rollout/reward"] == 0.0 for r in rows) and all("eval/accuracy" not in r for r in rows[:-1])
    assert all(r["timing/rollout"] > 0 and r["timing/ppo_update"] > 0 for r in rows)
    assert last["version"] == 3.0
    run = Path(cfg.run_dir)
    assert (run / "config.yaml").exists()
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000002", "step_000003"]
    saved = (run / "rollouts" / "step_000003.jsonl").read_text().splitlines()
    assert saved and {"prompt", "completion", "reward", "versions"} <= set(json.loads(saved[0]))


def _run_cli(run_dir: Path, *extra: str, kill_in_commit: int | None = None) -> subprocess.CompletedProcess[str] | None:
    """``relayrl train`` in a real process (forked with the trainer imported), to its end, or SIGKILLed by
    itself (tests/reliability/signal_hooks.py) as step ``kill_in_commit``'s checkpoint is written: its files
    are in place, not yet committed, so the step before's is the latest (a point of the run, not of the clock)."""
    argv = [
        "train",
        f"run_dir={run_dir}",
        *FAST,
        "total_steps=4",
        "checkpoint.every_n_steps=1",
        "checkpoint.keep_last=5",
        "rollout.max_staleness=0",
        *extra,
    ]
    if kill_in_commit is None:
        p = run_cli(argv, timeout=400)
        assert p.returncode == 0, p.stderr[-3000:]
        return p
    log = run_dir.parent / f"{run_dir.name}.log"
    env = {"RELAYRL_SIGNAL": "SIGKILL", "RELAYRL_SIGNAL_IN": "commit", "RELAYRL_SIGNAL_AT": str(kill_in_commit)}
    proc = start_cli([*argv, "imports=[tests.reliability.signal_hooks]"], log, env=env)
    proc.join(timeout=300)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
    assert proc.exitcode == -signal.SIGKILL, f"trainer not killed in its checkpoint write:\n{log.read_text()[-3000:]}"
    return None


def _weights(run_dir: Path, step: int = 4) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "actor" / "model.safetensors"))


@pytest.mark.slow
def test_sigkill_and_recover_is_bitwise_equal_in_sync_mode(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    out = _run_cli(straight)
    assert out is not None and "step 4/4" in out.stderr  # plain progress lines off a TTY
    assert "\r" not in out.stderr
    killed = tmp_path / "killed"
    _run_cli(killed, kill_in_commit=3)  # step 3 logged, its checkpoint written and not committed
    assert sorted(p.name for p in (killed / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]
    assert [r["step"] for r in _metrics(killed)] == [1, 2, 3]
    _run_cli(killed, "--recover")
    a, b = _weights(straight), _weights(killed)
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], _weights(straight, 1)[k]) for k in a), "training did not change the weights"
    for k in a:
        assert torch.equal(a[k], b[k]), f"weights differ after recover: {k}"
    assert [r["step"] for r in _metrics(killed)][-2:] == [3, 4]


@pytest.mark.slow
def test_ctrl_c_saves_a_final_checkpoint_and_stops_the_servers(tmp_path: Path) -> None:
    import psutil

    run = tmp_path / "run"
    argv = [
        "train",
        f"run_dir={run}",
        *FAST,
        "total_steps=10000",
        "checkpoint.every_n_steps=0",
        "rollout.max_staleness=1",
        "inference.backend=remote",
        "inference.n_servers=1",
    ]
    log = tmp_path / "train.log"
    proc = start_cli(argv, log)  # a real process (forked with the trainer imported); SIGINT raises KeyboardInterrupt
    deadline = time.monotonic() + 240
    while proc.exitcode is None and time.monotonic() < deadline:
        if (run / "metrics.jsonl").exists() and len(_metrics(run)) >= 2:
            break
        time.sleep(0.1)
    assert proc.exitcode is None, log.read_text()[-3000:]
    servers = psutil.Process(proc.pid).children(recursive=True)
    assert any("serve" in " ".join(c.cmdline()) for c in servers)
    os.kill(proc.pid, signal.SIGINT)
    proc.join(timeout=120)
    out = log.read_text()
    assert proc.exitcode == 130 and "relayrl train: stopped by SIGINT after step" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    step = int(out.split("stopped by SIGINT after step ")[1].split(";")[0])
    assert step >= 2 and (run / "checkpoints" / f"step_{step:06d}" / "actor" / "model.safetensors").exists()
    gone, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, [c.cmdline() for c in alive]  # no orphan server left behind


def test_async_recover_keeps_staleness_bound(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "total_steps=2", "rollout.max_staleness=1", "checkpoint.every_n_steps=1")
    train(cfg)
    resumed = _cfg(tmp_path, "total_steps=4", "rollout.max_staleness=1", "recover=auto", "checkpoint.every_n_steps=1")
    train(resumed)
    rows = _metrics(resumed.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)


def test_plot_and_show(tmp_path: Path) -> None:
    from relayrl.utils.plot import KL_FALLBACK, PANELS, figure

    cfg = _cfg(tmp_path, "total_steps=2")
    other = load_config(RunConfig, None, [f"run_dir={tmp_path / 'b' / 'run'}", *FAST, "total_steps=3", "seed=7"])
    train(cfg)
    train(other)
    png = tmp_path / "curves.png"
    res = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "plot", cfg.run_dir, other.run_dir, "--out", str(png)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert png.exists() and png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG", res.stderr
    fig = figure([cfg.run_dir, other.run_dir])  # what the PNG draws: both runs overlaid, told apart
    panels = {ax.get_title(): ax for ax in fig.axes}
    # no KL term in these runs: the KL panel shows, and says it shows, the generator-trainer gap
    assert set(panels) == {title for title, _ in PANELS} - {"KL to reference"} | {KL_FALLBACK[0]}
    reward = {line.get_label(): list(line.get_ydata()) for line in panels["reward"].get_lines()}
    assert reward == {  # both are named run: each is labelled by the last path parts that tell them apart
        f"{tmp_path.name}/run": [r["rollout/reward"] for r in _metrics(cfg.run_dir)],
        "b/run": [r["rollout/reward"] for r in _metrics(other.run_dir)],
    }
    shown = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "show", cfg.run_dir, "--step", "2"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "completion:" in shown and "reward" in shown


def test_evaluation_never_perturbs_training(tmp_path: Path) -> None:
    """A synchronous run samples and trains exactly the same with or without evaluations between
    steps (the executor stays paused until generation is reseeded for the next step)."""
    rows = {}
    for name, every in (("with_eval", "1"), ("without", "0")):
        cfg = load_config(
            RunConfig,
            None,
            [
                f"run_dir={tmp_path / name}",
                *FAST,
                "total_steps=3",
                "rollout.batch_size=4",
                "rollout.group_size=4",
                f"eval.every_n_steps={every}",
                "eval.n_samples=3",
                "eval.gconfig.greedy=false",
                "data.n_eval=8",
            ],
        )
        train(cfg)
        rows[name] = _metrics(cfg.run_dir)
    assert "eval/accuracy" in rows["with_eval"][0] and "eval/accuracy" not in rows["without"][0]
    keys = ("prompt_ids", "rollout/reward", "rollout/completion_len", "actor/loss", "actor/entropy", "actor/grad_norm")
    for a, b in zip(rows["with_eval"], rows["without"], strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
    a, b = _weights(tmp_path / "with_eval", 3), _weights(tmp_path / "without", 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_eval_cli_scores_a_run_directorys_latest_checkpoint(tmp_path: Path) -> None:
    """``relayrl eval RUN_DIR`` scores the last checkpoint exactly as the run's own (greedy) eval of that
    step did, with the checkpoint's own tokenizer (the model directory the run started from is gone by
    then); a warm start that answers some prompts right makes the number tell weights apart."""
    base = tmp_path / "base"
    shutil.copytree(WARM, base)
    cfg = _cfg(tmp_path, f"model.path={base}", "total_steps=2", "data.n_eval=6", "eval.every_n_steps=2")
    train(cfg)
    in_run = {k: v for k, v in _metrics(cfg.run_dir)[-1].items() if k.startswith("eval/")}
    shutil.rmtree(base)
    out = run_cli(["eval", cfg.run_dir])  # a real process, forked with the trainer imported
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result.pop("model").endswith("checkpoints/step_000002/actor")  # the trained policy, not the start
    assert result == in_run and result["eval/n_prompts"] == 6.0 and result["eval/failed"] == 0.0
    assert 1 / 6 <= result["eval/accuracy"] <= 3 / 6  # measured 2/6: the warm start's skill, not a random model's 0
    bad = run_cli(["eval", cfg.run_dir, "eval.n_samples=0"])
    assert bad.returncode == 2 and "eval.n_samples=0 is out of range" in bad.stderr


@pytest.mark.slow
def test_torchrun_two_ranks_train_like_one_process(tmp_path: Path) -> None:
    """``torchrun --nproc_per_node 2 -m relayrl.cli train`` (FSDP2 over gloo): rank 0 generates and
    broadcasts each batch, both ranks train their share of it. The run trains on the same prompts
    with the same rewards as one process, writes one run directory, and ends with the same
    weights up to summation order."""
    args = [
        *FAST,
        "total_steps=3",
        "rollout.batch_size=4",
        "rollout.group_size=2",
        "checkpoint.every_n_steps=2",
        "train.optimizer.warmup_steps=2",
        "train.optimizer.lr_schedule=cosine",
        "train.optimizer.min_lr_ratio=0.1",
    ]
    env = {"OMP_NUM_THREADS": "1"}
    one = run_cli(["train", f"run_dir={tmp_path / 'one'}", *args], env=env, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "relayrl.cli",
            "train",
            f"run_dir={tmp_path / 'two'}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert len([line for line in two.stdout.splitlines() if line.startswith("{")]) == 1  # the driver's summary only
    a, b = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [r["step"] for r in b] == [1, 2, 3]
    # `relayrl train` follows the LR schedule, in one process and under torchrun: warmup, then cosine decay
    assert [r["actor/lr"] for r in a] == [r["actor/lr"] for r in b] == pytest.approx([5e-4, 1e-3, 1e-4])
    for ra, rb in zip(a, b, strict=True):
        assert ra["prompt_ids"] == rb["prompt_ids"] and ra["rollout/reward"] == rb["rollout/reward"]
        assert rb["actor/loss"] == pytest.approx(ra["actor/loss"], abs=1e-5)
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    wa, wb = _weights(tmp_path / "one", 3), _weights(tmp_path / "two", 3)
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-5


def test_relayrl_train_follows_the_lr_schedule(tmp_path: Path) -> None:
    """The trainer's optimizer steps advance the schedule: warmup over 2 steps, then linear decay
    to min_lr_ratio at the last of total_steps x n_minibatches optimizer steps."""
    cfg = _cfg(
        tmp_path,
        "total_steps=3",
        "actor.n_minibatches=2",
        "train.optimizer.warmup_steps=2",
        "train.optimizer.lr_schedule=linear",
        "train.optimizer.min_lr_ratio=0.2",
        "checkpoint.save_final=false",
    )
    train(cfg)
    f = [1e-3 * x for x in (0.5, 1.0, 1 - 0.8 * 1 / 4, 1 - 0.8 * 2 / 4, 1 - 0.8 * 3 / 4, 0.2)]  # 6 optimizer steps
    assert [r["actor/lr"] for r in _metrics(cfg.run_dir)] == pytest.approx(
        [(f[0] + f[1]) / 2, (f[2] + f[3]) / 2, (f[4] + f[5]) / 2]
    )


def test_checkpoints_are_due_every_n_steps_or_every_n_minutes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl.api.config import CheckpointConfig
    from relayrl.utils import checkpoint
    from relayrl.utils.checkpoint import CheckpointManager

    now = [1000.0]  # a clock that moves only where the test says, whatever the machine's load
    monkeypatch.setattr(checkpoint, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    by_steps = CheckpointManager(tmp_path / "a", CheckpointConfig(every_n_steps=3))
    assert [s for s in range(1, 10) if by_steps.due(s)] == [3, 6, 9]
    by_time = CheckpointManager(tmp_path / "b", CheckpointConfig(every_n_steps=0, every_minutes=2))
    now[0] += 119
    assert not by_time.due(1)
    now[0] += 1
    assert by_time.due(2)
    by_time.commit(2, by_time.begin(2), {})
    assert not by_time.due(3)  # the clock restarts at each save
    now[0] += 120
    assert by_time.due(4)
    assert [p.name for p in by_time.complete()] == ["step_000002"]


def test_every_part_reports_its_own_metrics_once(tmp_path: Path) -> None:
    """The critic's value loss is exported (it was dropped) and the trainer's per-token staleness
    is no longer overwritten by the executor's per-group one (each has its own key); the values
    are what the batch gives."""
    # rewards shaped to 1 (a random model earns none) so the zero-initialised value head has something to fit
    cfg = _cfg(tmp_path, "total_steps=2", "actor.adv_estimator=gae", "actor.reward_bias=1", "rollout.max_staleness=1")
    train(cfg)
    rows = _metrics(cfg.run_dir)
    for r in rows:
        assert 0.4 < r["critic/loss"] <= 0.5 and "critic/vf_clip_frac" in r  # 0.5 * (V=0 - return=1)^2 at first
        assert r["critic/optimizer_steps"] == 1.0
        assert {"rollout/staleness_max", "rollout/group_staleness_max"} <= set(r)
        assert 0 <= r["rollout/staleness_mean"] <= r["rollout/staleness_max"] <= 1


def test_train_called_from_python_gives_the_callers_signal_handlers_back(tmp_path):
    """``relayrl.cli.main(["train", ...])`` in a Python process (a notebook, a script, a test) left SIGINT
    ignored after a finished run and SIGTERM raising: Ctrl-C then no longer stopped the caller."""
    from relayrl.cli import main

    def handlers() -> dict[int, object]:
        return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    before = handlers()
    assert before[signal.SIGINT] is signal.default_int_handler  # pytest's own: what a Python process has
    argv = ["train", f"run_dir={tmp_path / 'run'}", *FAST, "total_steps=1", "eval.every_n_steps=0"]
    assert main(argv) == 0
    assert handlers() == before
    assert main(["train", f"run_dir={tmp_path / 'bad'}", "model.path=/nonexistent/model"]) == 2  # a config error
    assert handlers() == before
