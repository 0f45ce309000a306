"""What the reliability tests check after a run, and how they run (and kill) trainers.

``audit_prompts`` is the "nothing lost, nothing trained twice" check: every row the
dataloader handed out was trained on exactly once (the ``prompt_ids`` of metrics.jsonl), is
still pending in the executor's saved state, or ended as failed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from relayrl.api.config import RunConfig, load_config
from relayrl.api.engine import DataItem
from relayrl.data.datasets import RLDataLoader

FAST = [
    "rollout.batch_size=2",
    "rollout.group_size=2",
    "gconfig.max_new_tokens=6",
    "data.n_train=400",
    "data.n_eval=4",
    # A random model earns no reward, so advantages are 0: the entropy bonus keeps gradients non-zero.
    "train.optimizer.lr=1e-3",
    "actor.entropy_coef=0.01",
    "logging.tensorboard=false",
    "logging.progress=lines",
    "logging.rollouts_per_step=0",
]
TOKEN = "reliability-token"


def remote_cfg(run_dir: str | Path, addresses: list[str], *extra: str) -> RunConfig:
    """A fast asynchronous run (eta=1) generating on the servers at ``addresses``."""
    return load_config(
        RunConfig,
        None,
        [
            f"run_dir={run_dir}",
            *FAST,
            "inference.backend=remote",
            f"inference.addresses={addresses}",
            f"inference.admin_token={TOKEN}",
            "inference.health_interval=0.2",
            "inference.max_retries=12",
            "inference.request_timeout=60",
            "rollout.max_staleness=1",
            "gconfig.max_new_tokens=16",
            *extra,
        ],
    )


def metrics_rows(run_dir: str | Path) -> list[dict]:
    """The rows of metrics.jsonl that belong to training steps, in order."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["step"] > 0]


def latest_state(run_dir: str | Path) -> dict:
    """trainer_state.json of the newest complete checkpoint."""
    ckpts = sorted((Path(run_dir) / "checkpoints").glob("step_*/trainer_state.json"))
    assert ckpts, f"no complete checkpoint in {run_dir}"
    return json.loads(ckpts[-1].read_text())


def train_rows_of(run_dir: str | Path) -> list[DataItem]:
    """The training rows of a run, rebuilt from its saved config.yaml."""
    from relayrl import wiring
    from relayrl.data.models import load_tokenizer

    cfg = load_config(RunConfig, Path(run_dir) / "config.yaml")
    return wiring.load_rows(cfg, load_tokenizer(cfg.model))[0]


def pulled_ids(rows: list[DataItem], batch_size: int, seed: int, loader_state: dict) -> Counter:
    """Row ids a fresh ``RLDataLoader`` hands out until it reaches ``loader_state``."""
    loader = RLDataLoader(rows, batch_size=batch_size, shuffle=True, seed=seed)
    out: Counter = Counter()
    while loader.state_dict() != loader_state:
        assert loader.epoch <= loader_state["epoch"], f"loader never reaches {loader_state}"
        out.update(r["id"] for r in next(loader))
    return out


def audit_prompts(
    rows: list[DataItem], metric_rows: list[dict], state: dict, batch_size: int, seed: int
) -> tuple[Counter, Counter, Counter]:
    """(trained, pending, dropped) row ids; fails if a prompt was trained twice or appeared from nowhere.

    Counted as multisets: after the dataloader wraps into its next epoch a row id is handed
    out (and may be trained) once per epoch.

    ``state`` holds ``dataloader`` and ``executor`` states (a checkpoint's trainer_state.json).
    ``dropped`` are prompts handed out but neither trained nor pending: they must all be
    prompts whose every episode failed (the caller checks which).
    """
    trained = Counter(i for r in metric_rows for i in r["prompt_ids"])
    pending = Counter(p["data"]["id"] for p in state["executor"]["pending"])
    pulled = pulled_ids(rows, batch_size, seed, state["dataloader"])
    extra = (trained + pending) - pulled
    assert not extra, f"trained twice, or pending after training, or never handed out: {dict(extra)}"
    return trained, pending, pulled - trained - pending


def check_steps(metric_rows: list[dict], total_steps: int, eta: int, batch_size: int) -> None:
    """One row per step 1..T, weights at version T, every batch full, staleness within eta."""
    assert [r["step"] for r in metric_rows] == list(range(1, total_steps + 1))
    assert [r["version"] for r in metric_rows] == [float(s) for s in range(1, total_steps + 1)]
    assert all(len(r["prompt_ids"]) == batch_size for r in metric_rows)
    worst = max(r["rollout/staleness_max"] for r in metric_rows)
    assert worst <= eta, f"staleness {worst} > eta={eta}"


# ----------------------------------------------------------------------------------------
# Trainer processes: `relayrl train` run in a child of a forkserver that has already
# imported relayrl (saves ~10 s of imports per start); SIGKILL reaches it like any process.
# ----------------------------------------------------------------------------------------

_CTX = mp.get_context("forkserver")
# (the same preload as tests/peers' stand-ins: one forkserver per process serves both)
_CTX.set_forkserver_preload(["relayrl.trainer", "relayrl.cli", "relayrl.inference.local", "fastapi", "uvicorn"])


def _cli_main(
    argv: list[str], log: str, err: str | None, cwd: str | None, env: dict[str, str] | None, session: bool
) -> None:
    import signal

    # As a terminal starts a command: SIGINT raises KeyboardInterrupt (the forkserver's children inherit
    # SIG_IGN when the suite runs in the background), in its own session if asked (Ctrl-C to the group).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if session:
        os.setsid()
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(env or {})
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_APPEND) if err else fd, 2)
    from relayrl.cli import main

    sys.exit(main(argv))


def start_cli(
    argv: list[str],
    log: Path,
    *,
    err: Path | None = None,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    session: bool = False,
) -> mp.Process:
    """``relayrl ARGV`` in a fresh process, stdout and stderr appended to ``log`` (stderr to ``err`` if given),
    run from ``cwd`` with ``env`` added to the environment, in a new session if ``session``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    for f in (log, err):  # there from the start, for a caller that polls them
        if f is not None:
            f.touch()
    args = (argv, str(log), err and str(err), cwd and str(cwd), env, session)
    proc = _CTX.Process(target=_cli_main, args=args)
    proc.start()
    return proc


def run_cli(
    argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None, timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """``relayrl ARGV`` run to its end by ``start_cli``: its exit status, stdout and stderr, as ``subprocess.run``
    gives them (stdout and stderr go through files, removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix="relayrl-cli.") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        proc = start_cli(argv, out, err=err, cwd=cwd, env=env)
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["relayrl", *argv], timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(["relayrl", *argv], proc.exitcode, out.read_text(), err.read_text())
