"""The capacity rule: the staleness bound always holds and progress is always possible.

A small simulation of producer and trainer drives ``rollout_capacity`` / ``is_expired``
through random interleavings of start / finish / consume / version-bump events.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.rollout.staleness import default_max_concurrent, is_expired, rollout_capacity


class Sim:
    """Producer + consumer bookkeeping, counted in prompts, versions relative to 0."""

    def __init__(self, eta: int, batch: int, max_concurrent: int) -> None:
        self.eta, self.batch, self.maxc = eta, batch, max_concurrent
        self.version = 0
        self.consumed = 0
        self.running: list[int] = []  # start version of each running prompt, in start order
        self.accepted: list[int] = []  # oldest version of each accepted, unconsumed prompt
        self.expired = 0
        self.staleness: list[int] = []

    def capacity(self, waiting: int = 0) -> int:
        return rollout_capacity(
            max_staleness=self.eta,
            batch_size=self.batch,
            version=self.version,
            consumed=self.consumed,
            accepted=len(self.accepted),
            running=len(self.running),
            max_concurrent=self.maxc,
            waiting=waiting,
        )

    def start(self, n: int, waiting: int = 0) -> None:
        n = min(n, self.capacity(waiting))
        self.running += [self.version] * n
        assert len(self.running) <= self.maxc

    def finish(self, i: int) -> None:
        self.accepted.append(self.running.pop(i))

    def try_consume(self) -> bool:
        """The trainer asks for a batch: expire stale prompts, take ``batch`` if there."""
        keep = [v for v in self.accepted if not is_expired(v, self.version, self.eta)]
        self.expired += len(self.accepted) - len(keep)
        self.accepted = keep
        if len(self.accepted) < self.batch:
            # progress: a waiting consumer can always get its batch started
            assert len(self.accepted) + len(self.running) + self.capacity(waiting=self.batch) >= self.batch
            return False
        taken, self.accepted = self.accepted[: self.batch], self.accepted[self.batch :]
        for v in taken:
            assert self.version - v <= self.eta, (self.version, v, self.eta)
            self.staleness.append(self.version - v)
        self.consumed += self.batch
        return True


params = st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(0, 6))


@settings(max_examples=100, deadline=None)
@given(params=params, data=st.data())
def test_random_interleavings_keep_bound_and_progress(params, data):
    eta, batch, extra = params
    sim = Sim(eta, batch, default_max_concurrent(batch, eta, configured=batch + extra if extra else 0))
    events = data.draw(st.lists(st.sampled_from(["start", "finish", "consume", "bump"]), max_size=120))
    for ev in events:
        if ev == "start":
            sim.start(data.draw(st.integers(1, 8)))
        elif ev == "finish" and sim.running:
            sim.finish(data.draw(st.integers(0, len(sim.running) - 1)))
        elif ev == "consume":
            sim.try_consume()
        elif ev == "bump":
            sim.version += 1
    # liveness: a consumer that keeps asking always gets a batch within a bounded number of
    # steps, even after arbitrary version bumps and out-of-order finishes
    for _ in range(3):
        for _ in range(10 * (batch + eta + 1)):
            sim.start(batch, waiting=batch)
            if sim.running:
                sim.finish(data.draw(st.integers(0, len(sim.running) - 1)))
            if sim.try_consume():
                break
        else:
            pytest.fail(f"no batch after many steps: {vars(sim)}")
        sim.version += 1
    assert all(0 <= s <= eta for s in sim.staleness)


@settings(max_examples=100, deadline=None)
@given(params=params, data=st.data())
def test_disciplined_trainer_never_expires(params, data):
    """Finishes in start order and one version bump per consumed batch: the capacity rule
    alone keeps every prompt within eta (nothing is ever expired), and with eta > 0 the
    producer really runs ahead of the trainer."""
    eta, batch, _ = params
    sim = Sim(eta, batch, default_max_concurrent(batch, eta))
    max_ahead = 0
    events = data.draw(st.lists(st.sampled_from(["start", "finish", "consume"]), max_size=60))
    for ev in [*events, "consume", "consume", "consume"]:
        if ev == "start":
            sim.start(data.draw(st.integers(1, 8)))
            max_ahead = max(max_ahead, len(sim.running) + len(sim.accepted))
        elif ev == "finish" and sim.running:
            sim.finish(0)
        elif ev == "consume":
            sim.start(batch, waiting=batch)
            while sim.running and len(sim.accepted) < batch:
                sim.finish(0)
            assert sim.try_consume()
            sim.version += 1
    assert sim.expired == 0
    assert max(sim.staleness) <= eta
    assert max_ahead <= (eta + 1) * batch


def test_synchronous_rule_numbers():
    # eta = 0: one batch at a time; nothing starts while the trainer holds the batch
    kw = dict(max_staleness=0, batch_size=4, max_concurrent=100)
    assert rollout_capacity(version=0, consumed=0, accepted=0, running=0, **kw) == 4
    assert rollout_capacity(version=0, consumed=0, accepted=1, running=3, **kw) == 0
    assert rollout_capacity(version=0, consumed=4, accepted=0, running=0, **kw) == 0  # training on batch 0
    assert rollout_capacity(version=1, consumed=4, accepted=0, running=0, **kw) == 4
    # a consumer blocked at the same version still gets its batch (no deadlock)
    assert rollout_capacity(version=0, consumed=4, accepted=1, running=0, waiting=4, **kw) == 3
    # eta = 2: three batches ahead, capped by max_concurrent
    assert (
        rollout_capacity(
            max_staleness=2, batch_size=4, version=0, consumed=0, accepted=0, running=0, max_concurrent=100
        )
        == 12
    )
    assert (
        rollout_capacity(max_staleness=2, batch_size=4, version=0, consumed=0, accepted=0, running=0, max_concurrent=5)
        == 5
    )
    # versions bumped ahead of consumption do not shrink the window
    assert (
        rollout_capacity(
            max_staleness=1, batch_size=2, version=5, consumed=0, accepted=0, running=0, max_concurrent=100
        )
        == 4
    )
    assert is_expired(3, 5, 1) and not is_expired(4, 5, 1) and not is_expired(5, 5, 0)
    with pytest.raises(ValueError, match="batch_size"):
        rollout_capacity(max_staleness=0, batch_size=0, version=0, consumed=0, accepted=0, running=0, max_concurrent=1)
