"""The watchdog: a run that stops making progress says where it waits.

When no training step has finished for ``watchdog.stall_s`` seconds, ``Watchdog`` writes
``RUN_DIR/stall_<step>.txt``: a one-line summary of where the time goes, the executor's and the
engine's state (prompts running and ready, paused, versions, requests in flight, each server's
health), every thread's stack and the rollout loop's asyncio tasks. The summary also goes to the
log. Then it keeps waiting (``watchdog.action=dump``; again after each further ``stall_s``) or
ends the process with exit code 75 (``exit``; ``relayrl train ... --recover`` resumes from the
last checkpoint). It runs in a daemon thread of the driver and never touches the training state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType

logger = logging.getLogger("relayrl.watchdog")

EXIT_CODE = 75  # EX_TEMPFAIL: try again (resume with --recover)
_PKG = str(Path(__file__).resolve().parents[1])  # relayrl/
_SELF = str(Path(__file__).resolve())


def _ours(frames: Iterable[FrameType]) -> str | None:
    """The innermost relayrl frame of ``frames`` (innermost first): ``rollout/executor.py:431 in wait``."""
    for f in frames:
        path = f.f_code.co_filename
        if path.startswith(_PKG) and path != _SELF:
            return f"{os.path.relpath(path, _PKG)}:{f.f_lineno} in {f.f_code.co_name}"
    return None


def where(frame: FrameType | None) -> str:
    """The innermost relayrl frame of a stack, else the innermost one."""
    if frame is None:
        return "?"
    here = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
    return _ours(f for f, _ in traceback.walk_stack(frame)) or here


def await_chain(task: asyncio.Task[object]) -> list[FrameType]:
    """The frames a task is suspended in, outermost first, following what each coroutine awaits
    (``Task.get_stack`` gives only the outermost)."""
    frames: list[FrameType] = []
    c: object = task.get_coro()
    while c is not None:
        f = getattr(c, "cr_frame", None) or getattr(c, "gi_frame", None) or getattr(c, "ag_frame", None)
        if f is not None:
            frames.append(f)
        c = getattr(c, "cr_await", None) or getattr(c, "gi_yieldfrom", None) or getattr(c, "ag_await", None)
    return frames


def task_waits(loop: asyncio.AbstractEventLoop | None) -> str:
    """Where the loop's tasks wait, most common first: ``rollout/workflows/rlvr.py:60 in _in_thread (x4)``."""
    if loop is None or loop.is_closed():
        return ""
    counts = Counter(_ours(reversed(await_chain(t))) for t in list(asyncio.all_tasks(loop)))
    counts.pop(None, None)
    return ", ".join(f"{w} (x{n})" for w, n in counts.most_common(3))


def thread_stacks() -> str:
    """Every thread's stack, named."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- thread {names.get(ident, '?')} ({ident}) ---\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


def task_stacks(loop: asyncio.AbstractEventLoop | None) -> str:
    """The asyncio tasks of ``loop`` (another thread's) and where each waits."""
    if loop is None or loop.is_closed():
        return "(no event loop)"
    try:
        tasks = list(asyncio.all_tasks(loop))
    except RuntimeError:  # the set changed while read (the loop runs on): one more try
        tasks = list(asyncio.all_tasks(loop))
    out = [f"{len(tasks)} tasks"]
    for t in tasks:
        stack = traceback.StackSummary.extract((f, f.f_lineno) for f in await_chain(t))
        out.append(f"--- {t.get_name()} ---\n" + "".join(stack.format()))
    return "\n".join(out)


class Watchdog:
    """Watches the steps of one run (see module doc). ``beat(step)`` after every step."""

    def __init__(
        self,
        run_dir: str | Path,
        stall_s: float,
        action: str,
        state: Callable[[], list[str]],
        loop: Callable[[], asyncio.AbstractEventLoop | None] = lambda: None,
    ) -> None:
        self.run_dir, self.stall_s, self.action = Path(run_dir), stall_s, action
        self.state, self.loop = state, loop
        self.step, self.last = 0, time.monotonic()
        self.dumps: list[Path] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, step: int) -> None:
        if self.stall_s <= 0 or self._thread is not None:
            return
        self.beat(step)
        self._thread = threading.Thread(target=self._run, name="relayrl-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        self.step, self.last = step, time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        quiet_since = self.last
        while not self._stop.wait(min(self.stall_s / 4, 5.0)):
            quiet_since = max(quiet_since, self.last)  # a step finished: the clock restarts
            if time.monotonic() - quiet_since >= self.stall_s:
                self.dump()
                quiet_since = time.monotonic()  # the next report after another stall_s
                if self.action == "exit":
                    logging.shutdown()
                    os._exit(EXIT_CODE)

    def dump(self) -> Path:
        """Write the stall report now; its path."""
        waited = time.monotonic() - self.last
        main = sys._current_frames().get(threading.main_thread().ident or 0)
        try:
            state = self.state()
        except Exception as e:  # noqa: BLE001 - a report with less in it beats none
            state = [f"(state unavailable: {e!r})"]
        try:
            tasks = task_waits(self.loop())
        except RuntimeError as e:  # the task set changed while read
            tasks = repr(e)
        summary = (
            f"watchdog: no training step finished for {waited:.0f}s (last: step {self.step}); the trainer waits in "
            f"{where(main)}; {state[0] if state else ''}" + (f"; episodes wait in {tasks}" if tasks else "")
        )
        path = self.run_dir / f"stall_{self.step:06d}.txt"
        if path in self.dumps:
            path = path.with_name(f"stall_{self.step:06d}_{len(self.dumps)}.txt")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        text = [summary, "", "== state ==", *state, "", "== threads ==", thread_stacks()]
        text += ["", "== rollout loop tasks ==", task_stacks(self.loop())]
        path.write_text("\n".join(text) + "\n")
        self.dumps.append(path)
        then = "exiting (watchdog.action=exit)" if self.action == "exit" else "still waiting"
        logger.error("%s; full report %s; %s (watchdog.stall_s=%s)", summary, path, then, self.stall_s)
        return path
