"""WorkflowExecutor: the asynchronous producer of trajectories (AReaL-lite style).

A background thread runs its own uvloop event loop. Prompts wait in a queue; the loop starts
as many as the staleness window (``staleness.rollout_capacity``) and
``max_concurrent_rollouts`` allow, runs ``group_size`` episodes of each concurrently
(``workflow.arun_episode``), and parks accepted groups in a ready list. The trainer takes
groups with ``wait`` / ``prepare_batch``; at that moment groups whose oldest token lags the
engine's version by more than ``max_staleness`` are expired, so no trained-on token is ever
staler than eta. ``rollout_batch`` is the synchronous path (its prompts bypass the window).

Every episode ends as exactly one ``SampleStatus``: completed (consumed), filtered (the
workflow returned None, or the group accept function / DAPO filter dropped its group),
failed (raised, or returned an invalid trajectory), aborted (cancelled at shutdown) or
expired. A group keeps the episodes that produced a trajectory; a group with none left is
dropped. Aborted and expired prompts follow the tail-batch policy (discard / requeue at once /
requeue after ``tail_batch_trigger`` pile up).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from relayrl.api.config import RolloutConfig
from relayrl.api.engine import DataItem, InferenceEngine, TensorDict
from relayrl.api.workflow import (
    RolloutWorkflow,
    SampleStatus,
    StatusCounter,
    Trajectory,
    TrajectoryError,
    concat_trajectories,
    validate_trajectory,
)
from relayrl.rollout.loop_thread import LoopThread
from relayrl.rollout.staleness import default_max_concurrent, is_expired, rollout_capacity
from relayrl.utils import stats
from relayrl.utils.deadline import Stalled

logger = logging.getLogger("relayrl.rollout")

AcceptFn = Callable[[Trajectory], bool]
_Outcome = tuple[SampleStatus, Trajectory | None, str]


@dataclass
class _Prompt:
    index: int  # position counter of the data row (the batch's ``prompt_index``)
    data: DataItem
    workflow: RolloutWorkflow | None
    sync: bool = False  # rollout_batch prompts bypass the staleness window


@dataclass
class _Group:
    prompt: _Prompt
    traj: Trajectory
    oldest: int  # version of the group's oldest generated token
    episodes: int


class FilterExhausted(RuntimeError):
    """Dynamic filtering rejected ``rollout.filter_patience`` batches' worth of groups in a row."""


class WorkflowExecutor:
    """Runs workflows on a background event loop with bounded staleness (see module doc).

    ``accept_group(traj) -> bool`` sees a whole group (rows of one prompt) and may reject it.
    """

    def __init__(self, config: RolloutConfig, engine: InferenceEngine, accept_group: AcceptFn | None = None) -> None:
        self.config = config
        self.engine = engine
        self.accept_group = accept_group
        self.status = StatusCounter()
        self._lock = threading.Condition()
        self._queue: deque[_Prompt] = deque()  # stream prompts waiting for capacity
        self._sync_queue: deque[_Prompt] = deque()  # rollout_batch prompts
        self._tail: list[_Prompt] = []  # requeue_after: aborted/expired prompts piling up
        self._restored: list[_Prompt] = []  # pending prompts of a loaded state, re-run on next prepare_batch
        self._running: dict[int, _Prompt] = {}
        self._ready: list[_Group] = []  # accepted stream groups, not consumed yet
        self._sync_done: dict[int, _Group | None] = {}
        self._window: deque[bool] = deque(maxlen=config.failure_window)
        self._error: RuntimeError | None = None  # what stopped the rollout (raised to the trainer)
        self._last_error = ""
        self._logged: set[tuple[str, str]] = set()
        self._paused = False
        self._closing = False
        self._waiting = 0
        self._consumed = 0  # stream prompts handed out since the version base
        self._version0: int | None = None
        self._next_index = 0
        self._next_group = 0
        self._discarded = 0
        self._filtered_groups = 0  # groups rejected by the dynamic filter / accept fn, ever
        self._src: Iterable[list[DataItem]] | None = None
        self._src_iter: Iterator[list[DataItem]] | None = None
        self._src_done = False
        self.staleness_counts: Counter[int] = Counter()
        self.last_staleness: list[int] = []
        self.last_prompt_ids: list[object] = []  # row ``id`` of each group of the last batch taken
        self._bg = LoopThread("rollout-executor", self._schedule)  # re-checks capacity: it grows with the version

    # ------------------------------------------------------------------ lifecycle
    @property
    def max_concurrent_rollouts(self) -> int:
        c = self.config
        return default_max_concurrent(c.batch_size, c.max_staleness, c.max_concurrent_rollouts)

    def initialize(self) -> None:
        """Start the background thread and its uvloop event loop."""
        if self._bg.loop is None:
            self._closing = False
            self._bg.start()

    def destroy(self) -> None:
        """Cancel running episodes (aborted) and stop the loop. Safe to call twice."""
        if self._bg.loop is None:
            return
        self._closing = True  # start nothing new while the episodes are cancelled
        self._bg.stop()
        with self._lock:
            for p in list(self._running.values()):  # a task the cancel did not reach in time
                self.status.finish(SampleStatus.ABORTED, self.config.group_size)
                self._tail_policy(p)
            self._running.clear()
            for g in self._ready:  # accepted but never consumed
                self.status.finish(SampleStatus.ABORTED, g.episodes)
                self._tail_policy(g.prompt)
            self._ready = []
            self._lock.notify_all()

    def pause(self) -> None:
        """Start no new prompts (running episodes go on)."""
        with self._lock:
            self._paused = True

    @property
    def paused(self) -> bool:
        return self._paused

    def resume(self) -> None:
        with self._lock:
            self._paused = False
        self._wake()

    # ------------------------------------------------------------------ producer side
    def _wake(self) -> None:
        self._bg.call_soon(self._schedule)

    def _version(self) -> int:
        v = self.engine.get_version()
        if self._version0 is None:
            self._version0 = v
        return max(0, v - self._version0)

    def _schedule(self) -> None:
        """Start queued prompts as capacity allows (runs on the loop thread)."""
        with self._lock:
            if self._paused or self._closing or self._error is not None:
                return
            maxc = self.max_concurrent_rollouts
            while self._sync_queue and len(self._running) < maxc:
                self._start(self._sync_queue.popleft())
            if not self._queue:
                return
            stream_running = sum(not p.sync for p in self._running.values())
            cap = rollout_capacity(
                max_staleness=self.config.max_staleness,
                batch_size=self.config.batch_size,
                version=self._version(),
                consumed=self._consumed,
                accepted=len(self._ready),
                running=stream_running,
                max_concurrent=maxc,
                waiting=self._waiting,
            )
            cap = min(cap, maxc - len(self._running))
            for _ in range(min(cap, len(self._queue))):
                self._start(self._queue.popleft())

    def _start(self, p: _Prompt) -> None:
        self.status.submit(self.config.group_size)
        self._running[p.index] = p
        self._bg.spawn(self._run_group(p))

    async def _run_group(self, p: _Prompt) -> None:
        try:
            outs = await asyncio.gather(*(self._run_episode(p) for _ in range(self.config.group_size)))
        except asyncio.CancelledError:
            with self._lock:
                self._running.pop(p.index, None)
                self.status.finish(SampleStatus.ABORTED, self.config.group_size)
                self._tail_policy(p)
                self._lock.notify_all()
            raise
        self._finish_group(p, list(outs))
        self._schedule()

    async def _run_episode(self, p: _Prompt) -> _Outcome:
        assert p.workflow is not None
        try:
            traj = await p.workflow.arun_episode(self.engine, p.data)
            if traj is None:
                return SampleStatus.FILTERED, None, ""
            validate_trajectory(traj)
        except Stalled as e:  # a deadline passed (every server out, ...): the run cannot go on
            self._stop(e)
            return SampleStatus.FAILED, None, f"{type(e).__name__}: {e}"
        except Exception as e:  # one episode's failure never stops the batch
            return SampleStatus.FAILED, None, self._log_failure(p, e)
        return SampleStatus.COMPLETED, traj, ""

    def _stop(self, e: Stalled) -> None:
        """Stop the rollout with ``e`` (its one line): ``wait`` / ``prepare_batch`` raise it."""
        with self._lock:
            if self._error is None:
                self._error = e
                logger.error("%s", e)
            self._lock.notify_all()

    def _log_failure(self, p: _Prompt, e: Exception) -> str:
        """Log the traceback once per kind of error (type + message); repeats go to debug."""
        msg = f"{type(e).__name__}: {e}"
        key = (type(e).__name__, str(e)[:200])
        if key not in self._logged:
            self._logged.add(key)
            tb = "".join(traceback.format_exception(e))
            logger.error(
                "rollout episode of prompt %d failed (later identical errors are not re-logged):\n%s", p.index, tb
            )
        else:
            logger.debug("rollout episode of prompt %d failed: %s", p.index, msg)
        return msg

    def _finish_group(self, p: _Prompt, outs: list[_Outcome]) -> None:
        ok = [t for s, t, _ in outs if s is SampleStatus.COMPLETED and t is not None]
        group: _Group | None = None
        n_bad = 0
        if ok:
            try:
                traj = concat_trajectories(ok)
            except TrajectoryError as e:
                outs = [(SampleStatus.FAILED, None, self._log_failure(p, e))] * len(outs)
            else:
                if self._accepts(traj, p):
                    traj["prompt_index"] = torch.full((traj["input_ids"].shape[0],), p.index, dtype=torch.int64)
                    versions = traj["versions"]
                    group = _Group(p, traj, int(versions[versions >= 0].min()), len(ok))
                else:
                    n_bad = len(ok)
        with self._lock:
            self._running.pop(p.index, None)
            for s, _, err in outs:
                self._window.append(s is SampleStatus.FAILED)
                if s is not SampleStatus.COMPLETED:  # completed ones count when consumed
                    self.status.finish(s)
                if s is SampleStatus.FAILED:
                    self._last_error = err
            if n_bad:
                self.status.finish(SampleStatus.FILTERED, n_bad)
                self._filtered_groups += 1
            if p.sync:
                self._sync_done[p.index] = group
            elif group is not None:
                self._ready.append(group)
            self._check_failure_rate()
            self._lock.notify_all()

    def _accepts(self, traj: Trajectory, p: _Prompt) -> bool:
        r = traj["rewards"]
        if self.config.dynamic_filter and bool((r == r[0]).all()):  # DAPO: equal rewards, no learning signal
            return False
        if self.accept_group is None:
            return True
        try:
            return bool(self.accept_group(traj))
        except Exception as e:
            self._log_failure(p, e)
            return False

    def _check_failure_rate(self) -> None:
        w = self._window
        if self._error is None and len(w) == w.maxlen and sum(w) / len(w) > self.config.max_failure_rate:
            self._error = RuntimeError(
                f"rollout stopped: {sum(w)} of the last {len(w)} episodes failed, over "
                f"rollout.max_failure_rate={self.config.max_failure_rate}; last error: {self._last_error} "
                f"(full traceback logged above; counts: {self.status.as_dict()})"
            )
            logger.error(str(self._error))

    def _tail_policy(self, p: _Prompt) -> None:
        """What happens to an aborted or expired prompt (lock held)."""
        policy = self.config.tail_batch
        if policy == "discard":
            self._discarded += 1
            if p.sync:
                self._sync_done[p.index] = None
        elif p.sync:
            self._sync_queue.appendleft(p)
        elif policy == "requeue":
            self._queue.appendleft(p)
        else:
            self._tail.append(p)
            if len(self._tail) >= self.config.tail_batch_trigger:
                self._flush_tail()

    def _flush_tail(self) -> None:
        self._queue.extendleft(reversed(self._tail))
        self._tail = []

    # ------------------------------------------------------------------ consumer side
    def _enqueue(self, data: DataItem, workflow: RolloutWorkflow, sync: bool = False) -> int:
        if not isinstance(data, dict):
            raise TypeError(f"a data row must be a dict (id, messages, answer, ...), got {type(data).__name__}")
        if not isinstance(workflow, RolloutWorkflow):
            raise TypeError(f"workflow must be a RolloutWorkflow, got {type(workflow).__name__}")
        if self._bg.loop is None:
            raise RuntimeError("WorkflowExecutor is not running: call initialize() first")
        with self._lock:
            p = _Prompt(self._next_index, data, workflow, sync)
            self._next_index += 1
            (self._sync_queue if sync else self._queue).append(p)
        self._wake()
        return p.index

    def submit(self, data: DataItem, workflow: RolloutWorkflow) -> None:
        """Queue one prompt (``group_size`` episodes) on the stream taken by ``wait``."""
        self._enqueue(data, workflow)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _expire_ready(self) -> None:
        """Expire ready groups that are too stale for the current version (lock held)."""
        version, eta = self.engine.get_version(), self.config.max_staleness
        keep = []
        for g in self._ready:
            if is_expired(g.oldest, version, eta):
                self.status.finish(SampleStatus.EXPIRED, g.episodes)
                self._tail_policy(g.prompt)
            else:
                keep.append(g)
        self._ready = keep

    def _take(self, groups: list[_Group]) -> TensorDict:
        """Consume ``groups`` as one batch, in prompt order (not completion order, which depends on
        timing): a synchronous run then trains on bitwise the same batch every time."""
        groups = sorted(groups, key=lambda g: g.prompt.index)
        for g in groups:
            g.traj["group_id"] = torch.full_like(g.traj["prompt_index"], self._next_group)
            self._next_group += 1
        version = self.engine.get_version()
        # per group, by its oldest token: the measure expiry bounds (token-level: staleness.token_staleness)
        self.last_staleness = [version - g.oldest for g in groups]
        self.last_prompt_ids = [g.prompt.data.get("id", g.prompt.index) for g in groups]
        self.staleness_counts.update(self.last_staleness)
        for g in groups:
            self.status.finish(SampleStatus.COMPLETED, g.episodes)
        return concat_trajectories([g.traj for g in groups])

    def _take_ready(self, count: int) -> TensorDict:
        groups, self._ready = self._ready[:count], self._ready[count:]
        self._consumed += len(groups)
        return self._take(groups)

    def _counts_text(self, count: int) -> str:
        return (
            f"{len(self._ready)} of {count} groups ready, {len(self._running)} running, {len(self._queue)} queued, "
            f"{len(self._tail)} in the tail batch; episodes {self.status.as_dict()}"
        )

    def wait(self, count: int, timeout: float | None = None) -> TensorDict:
        """Block until ``count`` accepted groups are ready; return them concatenated."""
        if count < 1:
            raise ValueError(f"wait(count) needs count >= 1, got {count}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            try:
                self._waiting = count
                while True:
                    self._raise_if_failed()
                    self._expire_ready()
                    if len(self._ready) >= count:
                        return self._take_ready(count)
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"wait({count}) timed out after {timeout}s: {self._counts_text(count)}")
                    self._wake()
                    self._lock.wait(0.1 if remaining is None else min(remaining, 0.1))
            finally:
                self._waiting = 0

    def rollout_batch(self, data: list[DataItem], workflow: RolloutWorkflow) -> TensorDict:
        """Run these prompts now (synchronously) and return their accepted groups."""
        if not data:
            raise ValueError("rollout_batch needs at least one data row")
        indices = [self._enqueue(row, workflow, sync=True) for row in data]
        with self._lock:
            while not all(i in self._sync_done for i in indices):
                self._raise_if_failed()
                self._lock.wait(0.1)
            groups = [g for g in (self._sync_done.pop(i) for i in indices) if g is not None]
            if not groups:
                raise RuntimeError(
                    f"rollout_batch: none of the {len(data)} prompts gave an accepted group "
                    f"(episodes {self.status.as_dict()}; last error: {self._last_error or 'none'})"
                )
            return self._take(groups)

    def prepare_batch(self, dataloader: Iterable[list[DataItem]], workflow: RolloutWorkflow) -> TensorDict:
        """The next batch of ``batch_size`` groups, producing ahead while the trainer trains.

        ``dataloader`` yields lists of rows (an iterator is used as is, an iterable is
        iterated once). When it runs out, what is left comes as a last smaller batch, then
        ``StopIteration``.
        """
        if self._src is not dataloader:
            self._src, self._src_iter, self._src_done = dataloader, iter(dataloader), False
        self._adopt_restored(workflow)
        bs = self.config.batch_size
        filtered0 = self._filtered_groups
        deadline = time.monotonic() + self.config.batch_timeout
        while True:
            with self._lock:
                self._raise_if_failed()
                if time.monotonic() > deadline:
                    raise Stalled(
                        f"the trainer waited {self.config.batch_timeout:.0f}s for a batch: {self._counts_text(bs)}; "
                        "episodes are stuck or very slow (see the watchdog's stall report); give them longer "
                        "with rollout.batch_timeout"
                    )
                self._check_filter_patience(self._filtered_groups - filtered0)
                self._expire_ready()
                if len(self._ready) >= bs:
                    batch = self._take_ready(bs)
                    break
                idle = not (self._queue or self._running or self._tail or self._sync_queue)
                if self._src_done and self._tail:
                    self._flush_tail()
                elif self._src_done and idle:
                    if not self._ready:
                        raise StopIteration("prepare_batch: the dataloader is exhausted")
                    batch = self._take_ready(len(self._ready))
                    break
                hungry = len(self._queue) < self.max_concurrent_rollouts and not self._src_done
                if not hungry:
                    self._waiting = bs
                    self._lock.wait(0.05)
                    self._waiting = 0
            if hungry:
                self._pull(workflow)
        self._fill(workflow)  # keep producing while the trainer trains
        return batch

    def _check_filter_patience(self, filtered: int) -> None:
        """Over-sampling has a bound: a task where every group is filtered would loop forever."""
        patience = self.config.filter_patience
        if patience and filtered >= patience * self.config.batch_size:
            raise FilterExhausted(
                f"prepare_batch: {filtered} groups in a row were filtered (all rewards equal, or rejected by "
                f"accept_group) while filling one batch of {self.config.batch_size}; rollout.filter_patience="
                f"{patience}. The task gives this policy no learning signal: make it easier, warm the model up "
                f"(relayrl sft), or turn off rollout.dynamic_filter. Episodes: {self.status.as_dict()}"
            )

    def _pull(self, workflow: RolloutWorkflow) -> None:
        assert self._src_iter is not None
        try:
            rows = next(self._src_iter)
        except StopIteration:
            self._src_done = True
            return
        if isinstance(rows, dict):
            raise TypeError("the dataloader must yield lists of row dicts, got a dict (a collated batch?)")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise TypeError(
                    f"dataloader batch row {i} is a {type(row).__name__}, expected a dict (id, messages, answer)"
                )
            self._enqueue(row, workflow)

    def _fill(self, workflow: RolloutWorkflow) -> None:
        while not self._src_done and len(self._queue) < self.max_concurrent_rollouts:
            self._pull(workflow)

    def _adopt_restored(self, workflow: RolloutWorkflow) -> None:
        with self._lock:
            for p in reversed(self._restored):
                p.workflow = workflow
                self._queue.appendleft(p)
            self._restored = []
        self._wake()

    # ------------------------------------------------------------------ state and stats
    def stats(self) -> dict[str, float]:
        """Episode counts by status plus prompt counts and the last batch's staleness."""
        with self._lock:
            out: dict[str, float] = {k: float(v) for k, v in self.status.as_dict().items()}
            out.update(
                in_flight=float(self.status.in_flight),
                running_prompts=float(len(self._running)),
                ready_prompts=float(len(self._ready)),
                queued_prompts=float(len(self._queue) + len(self._sync_queue)),
                tail_prompts=float(len(self._tail)),
                consumed_prompts=float(self._consumed),
                discarded_prompts=float(self._discarded),
                group_staleness_mean=sum(self.last_staleness) / max(1, len(self.last_staleness)),
                group_staleness_max=float(max(self.last_staleness, default=0)),
            )
            return out

    def describe(self) -> str:
        """One line for the watchdog's stall report; read without the lock (a stuck holder never blocks it)."""
        return (
            f"{len(self._ready)} of {self.config.batch_size} groups ready, {len(self._running)} prompts running "
            f"({self.status.in_flight} episodes in flight), {len(self._queue)} queued, {len(self._tail)} in the tail "
            f"batch{', paused' if self._paused else ''}; engine v{self.engine.get_version()}"
            + (f"; stopped: {self._error}" if self._error is not None else "")
        )

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the episodes run on (None before ``initialize``)."""
        return self._bg.loop

    def report(self) -> None:
        """``stats()`` through the stats tracker, as ``rollout/*`` gauges (once per step)."""
        with stats.scope("rollout"):
            stats.gauge(**self.stats())

    def state_dict(self) -> dict[str, object]:
        """What was taken from the dataloader and not yet trained on, to be re-run on resume.

        ``pending`` holds every stream prompt queued, in flight, ready or in the tail batch
        (with its row); everything below ``next_index`` and not pending is done. The episode
        counts are saved without the in-flight ones (they are re-run after a resume).
        """
        with self._lock:
            prompts = [
                *self._restored,
                *(g.prompt for g in self._ready),
                *(p for p in self._running.values() if not p.sync),
                *self._tail,
                *self._queue,
            ]
            status = self.status.state_dict()
            status["submitted"] = self.status.finished
            return {
                "next_index": self._next_index,
                "next_group_id": self._next_group,
                "pending": [{"prompt_index": p.index, "data": p.data} for p in prompts],
                "status": status,
                "discarded": self._discarded,
                "staleness_counts": dict(self.staleness_counts),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore before producing; pending prompts re-run with the next ``prepare_batch``."""
        with self._lock:
            if self._running or self._ready or self._queue:
                raise RuntimeError("load_state_dict must be called before any rollout (work is already queued)")
            self._next_index = int(state["next_index"])
            self._next_group = int(state["next_group_id"])
            pending = state["pending"]
            assert isinstance(pending, list)
            self._restored = [_Prompt(int(d["prompt_index"]), d["data"], None) for d in pending]
            self.status.load_state_dict(state["status"])
            self._discarded = int(state.get("discarded", 0))
            self.staleness_counts = Counter({int(k): int(v) for k, v in state.get("staleness_counts", {}).items()})
            self._version0, self._consumed = None, 0
