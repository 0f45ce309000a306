"""The watchdog: a run whose reward function never returns writes where it waits.

``watchdog.stall_s`` is short here; ``rollout.reward_timeout`` long, so the step cannot finish
until the test lets the reward return (``faults.STUCK``) after the report was written.
"""

from __future__ import annotations

import threading
import time

import faults
import pytest
from audit import FAST, start_cli

from relayrl.api.config import RunConfig, load_config
from relayrl.trainer import Trainer
from relayrl.utils.deadline import Stalled
from relayrl.utils.watchdog import EXIT_CODE

STUCK_RUN = [
    *FAST,
    "total_steps=2",
    "reward_fn=faults:stuck_reward",
    "rollout.reward_timeout=600",
    "watchdog.stall_s=1",
]


@pytest.mark.timeout(120)
def test_a_reward_that_never_returns_is_reported_and_the_run_goes_on(tmp_path):
    faults.STUCK.clear()
    faults.STUCK_CALLS.clear()
    trainer = Trainer(load_config(RunConfig, None, [f"run_dir={tmp_path / 'run'}", *STUCK_RUN]))
    seen: list[float] = []
    reports: list = []

    def release_after_report() -> None:
        """Released after the first report written once all four episodes wait in the reward (a loaded
        machine may still be generating at the first one, a second after the step began)."""
        deadline = time.monotonic() + 90
        while len(faults.STUCK_CALLS) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        before = len(trainer.watchdog.dumps)
        while len(trainer.watchdog.dumps) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        seen.append(time.monotonic())
        reports.extend(trainer.watchdog.dumps[before:])
        faults.STUCK.set()

    helper = threading.Thread(target=release_after_report, daemon=True)
    t0 = time.monotonic()
    helper.start()
    try:
        trainer.fit()  # watchdog.action=dump: it goes on once the reward returns
    finally:
        faults.STUCK.set()
        trainer.close()
    helper.join()
    assert trainer.step == 2 and reports
    report = reports[0]
    assert report.name.startswith("stall_000000")  # written during the first step
    text = report.read_text()
    summary = text.splitlines()[0]
    print(f"reward never returns: reported {seen[0] - t0:.1f}s after fit started: {summary}")
    assert summary.startswith("watchdog: no training step finished for ")
    assert "rollout/executor.py" in summary and "in prepare_batch" in summary  # the trainer waits for a batch
    assert "0 of 2 groups ready" in summary and "rollout/workflows/rlvr.py" in summary  # ... its episodes for rewards
    assert "in _in_thread (x4)" in summary  # the four episodes wait for the reward thread
    assert "in stuck_reward" in text and "STUCK.wait(600)" in text  # the stuck function, in its thread's stack
    assert "== rollout loop tasks ==" in text and "engine: " in text


@pytest.mark.timeout(120)
def test_watchdog_action_exit_ends_the_process_after_the_report(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    proc = start_cli(["train", f"run_dir={run_dir}", *STUCK_RUN, "watchdog.action=exit"], log)
    proc.join(100)
    assert proc.exitcode == EXIT_CODE, log.read_text()[-3000:]
    assert (run_dir / "stall_000000.txt").exists()
    lines = [line for line in log.read_text().splitlines() if "watchdog: no training step finished" in line]
    assert len(lines) == 1 and "exiting (watchdog.action=exit)" in lines[0], lines


@pytest.mark.timeout(120)
def test_a_batch_that_never_fills_stops_the_run_within_rollout_batch_timeout(tmp_path):
    faults.STUCK.clear()
    cfg = load_config(
        RunConfig, None, [f"run_dir={tmp_path / 'run'}", *STUCK_RUN, "watchdog.stall_s=0", "rollout.batch_timeout=2"]
    )
    trainer = Trainer(cfg)
    t0 = time.monotonic()
    try:
        with pytest.raises(Stalled) as err:
            trainer.fit()
        waited = time.monotonic() - t0
    finally:
        faults.STUCK.set()
        trainer.close()
    msg = str(err.value)
    print(f"batch never fills: stopped {waited:.1f}s after fit started: {msg}")
    assert msg.startswith("the trainer waited 2s for a batch: 0 of 2 groups ready, 2 running")
    assert "rollout.batch_timeout" in msg and "\n" not in msg
