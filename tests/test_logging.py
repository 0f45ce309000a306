"""Metric sinks (JSONL, TensorBoard, W&B error), the text logger, and seeding / RNG resume."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import math
import random
import sys
import time

import numpy as np
import pytest
import torch

from relayrl.api.config import LoggingConfig
from relayrl.utils.logging import MetricLogger, StderrHandler, get_logger
from relayrl.utils.seeding import rng_state, seed_everything, set_rng_state


def test_jsonl_has_one_object_per_step(tmp_path):
    with MetricLogger(tmp_path / "run", tensorboard=False) as ml:
        ml.log({"actor/loss": 0.5, "rollout/reward": 1, "n": torch.tensor(3.0), "np": np.float32(0.25)}, step=1)
        ml.log({"actor/loss": float("nan"), "note": "hello"}, step=2)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert {k: v for k, v in rows[0].items() if k != "time"} == {
        "step": 1,
        "actor/loss": 0.5,
        "rollout/reward": 1.0,
        "n": 3.0,
        "np": 0.25,
    }
    assert math.isnan(rows[1]["actor/loss"]) and rows[1]["note"] == "hello"
    assert all(isinstance(r["time"], float) for r in rows)
    assert not (tmp_path / "run" / "tensorboard").exists()
    # appending (a resumed run) keeps earlier rows
    with MetricLogger(tmp_path / "run", tensorboard=False) as ml:
        ml.log({"actor/loss": 0.1}, step=3)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ml = MetricLogger.from_config(LoggingConfig(tensorboard=True, wandb=False), tmp_path)
    for step in range(3):
        ml.log({"actor/loss": 1.0 / (step + 1), "rollout/reward": step * 0.5, "bad": float("inf"), "s": "x"}, step=step)
    ml.close()
    ml.close()  # twice is fine
    tb_dir = tmp_path / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"actor/loss", "rollout/reward"}  # non-finite / text skipped
    loss = acc.Scalars("actor/loss")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3])
    assert [e.value for e in acc.Scalars("rollout/reward")] == pytest.approx([0.0, 0.5, 1.0])


def test_wandb_missing_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: `import wandb` raises
    with pytest.raises(ImportError, match=r"pip install relayrl\[wandb\]"):
        MetricLogger(tmp_path, tensorboard=False, wandb=True, wandb_mode="offline")
    # disabled mode never imports wandb
    MetricLogger(tmp_path, tensorboard=False, wandb=True, wandb_mode="disabled").close()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline_writes_a_local_run(tmp_path):
    with MetricLogger(tmp_path, tensorboard=False, wandb=True, wandb_mode="offline", config=LoggingConfig()) as ml:
        ml.log({"actor/loss": 0.5}, step=1)
        ml.log({"actor/loss": 0.125}, step=2)
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1  # no network needed; `wandb sync` uploads it later
    deadline = time.monotonic() + 30  # wandb's service process writes the log after finish() returns
    while b"0.125" not in runs[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.1)
    record = runs[0].read_bytes()  # the run's protobuf log holds the keys and JSON-encoded values
    assert b"actor/loss" in record and b"0.125" in record


def test_get_logger_format_and_namespace():
    log = get_logger("rollout")
    assert log.name == "relayrl.rollout" and get_logger("relayrl.train").name == "relayrl.train"
    root = logging.getLogger("relayrl")

    def ours() -> list[logging.Handler]:  # pytest attaches capture handlers of its own
        return [h for h in root.handlers if isinstance(h, StderrHandler)]

    assert len(ours()) == 1 and not root.propagate
    get_logger("again")
    assert len(ours()) == 1  # configured once
    stream = io.StringIO()
    with contextlib.redirect_stderr(stream):  # the handler follows sys.stderr as it is now
        log.warning("reward pool restarted %d workers", 2)
    line = stream.getvalue().strip()
    assert line.endswith("WARNING relayrl.rollout: reward pool restarted 2 workers"), line
    assert line[2] == ":" and line[5] == ":"  # HH:MM:SS prefix


def _draw() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_seed_everything_is_deterministic():
    seed_everything(123)
    a = _draw()
    seed_everything(123)
    b = _draw()
    seed_everything(124)
    c = _draw()
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])
    assert a[0] != c[0] and not torch.equal(a[2], c[2])
    with pytest.raises(TypeError, match="seed must be an int"):
        seed_everything("1")  # type: ignore[arg-type]


def test_rng_state_round_trip_through_torch_save(tmp_path):
    seed_everything(7)
    _draw()
    np.random.randn()  # leaves a cached gaussian in numpy's legacy state
    state = rng_state()
    expected = [_draw() for _ in range(3)] + [(np.random.randn(), random.gauss(0, 1), torch.randn(2))]
    torch.save(state, tmp_path / "rng.pt")
    seed_everything(999)  # scramble everything
    _draw()
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = [_draw() for _ in range(3)] + [(np.random.randn(), random.gauss(0, 1), torch.randn(2))]
    for e, g in zip(expected, got, strict=True):
        assert e[0] == g[0] and e[1] == g[1] and torch.equal(e[2], g[2])
    with pytest.raises(KeyError, match="'numpy'"):
        set_rng_state({"python": state["python"], "torch": state["torch"]})


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_progress_is_a_live_bar_on_a_terminal_and_plain_lines_otherwise(tty):
    from relayrl.utils.progress import Progress

    stream = _Terminal() if tty else io.StringIO()
    p = Progress(total=4, stream=stream)
    p.update(1, {"rollout/reward": 0.25, "perf/samples_per_s": 100.0})
    p.update(2, {"rollout/reward": 0.5, "eval/accuracy": 0.75})  # values not given again stay shown
    p.close()
    out = stream.getvalue()
    if tty:
        frames = out.split("\r")[1:]
        assert len(frames) == 2 and out.endswith("\n") and "\n" not in "".join(frames)[:-1]
        assert frames[1].startswith(
            "[###############...............] step 2/4 | reward 0.5 | eval 0.75 | samples/s 100"
        )
    else:
        lines = out.splitlines()
        assert "\r" not in out and len(lines) == 2
        assert lines[0].startswith("step 1/4 | reward 0.25 | samples/s 100 | eta ")
        assert lines[1].startswith("step 2/4 | reward 0.5 | eval 0.75 | samples/s 100 | eta ")
    quiet = io.StringIO()
    off = Progress(total=4, mode="off", stream=quiet)
    off.update(1, {"rollout/reward": 1.0})
    off.close()
    assert quiet.getvalue() == ""
