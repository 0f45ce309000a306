"""WorkflowExecutor with a real LocalEngine and the tiny model: staleness bound under random
timing, status accounting, failures, DAPO filtering, reward timeouts, checkpoint round trip."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from relayrl.api.config import InferenceConfig, RolloutConfig
from relayrl.api.io import GenerationConfig, WeightUpdate
from relayrl.data.tasks import make_task
from relayrl.inference.local import LocalEngine
from relayrl.rewards.tasks import task_reward_fn
from relayrl.rollout.executor import WorkflowExecutor
from relayrl.rollout.workflows.rlvr import RLVRWorkflow

G = GenerationConfig(max_new_tokens=6, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    eng = LocalEngine(InferenceConfig(max_batch_size=64, seed=1), model=tiny_model, tokenizer=tokenizer)
    eng.initialize()
    yield eng
    eng.destroy()


@pytest.fixture(scope="module")
def rows():
    return make_task("arithmetic", 120, 4)[0]


def loader(rows, n):
    return iter([rows[i : i + n] for i in range(0, len(rows), n)])


class Delayed(RLVRWorkflow):
    """RLVR with a random delay before generating and an optional failure/reward override."""

    def __init__(self, tokenizer, delay=0.0, fail_every=0, reward=None, seed=0):
        super().__init__(task_reward_fn("arithmetic"), G, tokenizer)
        self.rng, self.delay, self.fail_every, self.calls = random.Random(seed), delay, fail_every, 0
        self.reward_override = reward

    async def arun_episode(self, engine, data):
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            raise ValueError(f"injected failure {self.calls}")
        await asyncio.sleep(self.rng.random() * self.delay)
        traj = await super().arun_episode(engine, data)
        if traj is not None and self.reward_override is not None:
            traj["rewards"][:] = self.reward_override(data)
        return traj


def make(engine, **cfg):
    ex = WorkflowExecutor(RolloutConfig(**{"batch_size": 2, "group_size": 2, **cfg}), engine)
    ex.initialize()
    return ex


def bump(engine, tiny_model):
    engine.update_weights(
        WeightUpdate(kind="tensors", tensors=tiny_model.state_dict(), version=engine.get_version() + 1)
    )


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_staleness_bound_under_random_timing(engine, tiny_model, tokenizer, rows, eta):
    ex = make(engine, max_staleness=eta)
    wf = Delayed(tokenizer, delay=0.05, seed=eta)
    rng = random.Random(eta)
    data = loader(rows, 2)
    seen_staleness = []
    try:
        for _ in range(6):
            batch = ex.prepare_batch(data, wf)
            v = engine.get_version()
            for row in range(batch["input_ids"].shape[0]):
                versions = batch["versions"][row]
                oldest = int(versions[versions >= 0].min())
                assert oldest >= v - eta, (oldest, v, eta)
            assert batch["group_id"].shape == (4,) and batch["prompt_index"].shape == (4,)
            assert (batch["group_id"][0::2] == batch["group_id"][1::2]).all()
            seen_staleness += ex.last_staleness
            time.sleep(rng.random() * 0.1)  # "training"
            bump(engine, tiny_model)  # new weights while the producer runs ahead
    finally:
        ex.destroy()
    assert max(seen_staleness) <= eta
    if eta == 0:
        assert set(seen_staleness) == {0}
    ex.status.reconcile()
    s = ex.stats()
    assert s["completed"] == 6 * 2 * 2
    assert s["submitted"] == s["completed"] + s["filtered"] + s["failed"] + s["aborted"] + s["expired"]


def test_sync_batch_does_not_depend_on_completion_order(engine, tokenizer, rows):
    """Episodes finish in a random order (a reward step of random speed); the batch still comes
    in prompt order with the same group ids and tokens, so a synchronous run is reproducible."""

    class SlowScoring(RLVRWorkflow):
        def __init__(self, seed):
            super().__init__(task_reward_fn("arithmetic"), G, tokenizer)
            self.rng, self.finished = random.Random(seed), []

        async def arun_episode(self, engine, data):
            traj = await super().arun_episode(engine, data)
            await asyncio.sleep(self.rng.random() * 0.05)
            self.finished.append(data["id"])
            return traj

    batches, orders = [], []
    for seed in (0, 1):
        engine.load_state_dict({"next_key": 0})  # the same sampling stream for both runs
        ex, wf = make(engine, batch_size=4, group_size=2), SlowScoring(seed)
        try:
            batches.append(ex.prepare_batch(loader(rows, 4), wf))
        finally:
            ex.destroy()
        orders.append(wf.finished)
    a, b = batches
    assert orders[0] != orders[1]  # the episodes really did finish in different orders
    assert a["prompt_index"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and a["group_id"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    # the generator's logprobs may differ in the last bits: which requests shared a decode step
    # (and so the shapes of its matmuls) depends on timing; trainers recompute them anyway
    assert set(a) == set(b) and [k for k in a if not torch.equal(a[k], b[k])] in ([], ["logprobs"])
    assert torch.allclose(a["logprobs"], b["logprobs"], atol=1e-5)


def test_failed_episodes_counted_and_batch_fills(engine, tokenizer, rows):
    ex = make(engine, batch_size=4, group_size=2, max_failure_rate=0.5)
    wf = Delayed(tokenizer, fail_every=10)
    try:
        batch = ex.prepare_batch(loader(rows, 4), wf)
        batch2 = ex.prepare_batch(loader(rows[40:], 4), wf)
    finally:
        ex.destroy()
    assert len(set(batch["group_id"].tolist())) == 4 and len(set(batch2["group_id"].tolist())) == 4
    ex.status.reconcile()
    s = ex.stats()
    assert s["failed"] == wf.calls // 10 > 0
    assert s["completed"] == batch["input_ids"].shape[0] + batch2["input_ids"].shape[0]


def test_failure_rate_stops_with_clear_error(engine, tokenizer, rows):
    ex = make(engine, batch_size=2, group_size=2, failure_window=6, max_failure_rate=0.5)
    try:
        with pytest.raises(RuntimeError, match=r"rollout stopped: \d+ of the last 6 episodes failed.*injected failure"):
            ex.prepare_batch(loader(rows, 2), Delayed(tokenizer, fail_every=1))
    finally:
        ex.destroy()
    ex.status.reconcile()


def test_invalid_trajectory_counts_as_failed(engine, tokenizer, rows):
    class Bad(RLVRWorkflow):
        async def arun_episode(self, engine, data):
            traj = await super().arun_episode(engine, data)
            traj["logprobs"][0, 0] = -1.0  # a prompt token with a logprob
            return traj

    ex = make(engine, max_failure_rate=1.0)
    try:
        with pytest.raises(RuntimeError, match="none of the 1 prompts"):
            ex.rollout_batch(rows[:1], Bad(task_reward_fn("arithmetic"), G, tokenizer))
    finally:
        ex.destroy()
    assert ex.stats()["failed"] == 2 and "logprobs" in ex._last_error


def test_dapo_dynamic_filter_oversamples(engine, tokenizer, rows):
    # rows with an even index get a constant reward (dropped), odd rows a varying one (kept)
    index = {r["id"]: i for i, r in enumerate(rows)}
    rng = random.Random(0)

    def reward(data):
        return 1.0 if index[data["id"]] % 2 == 0 else rng.random()

    ex = make(engine, batch_size=3, group_size=2, dynamic_filter=True)
    try:
        batch = ex.prepare_batch(loader(rows, 3), Delayed(tokenizer, reward=reward))
    finally:
        ex.destroy()
    kept = batch["prompt_index"].tolist()
    assert len(set(kept)) == 3 and all(i % 2 == 1 for i in kept)
    s = ex.stats()
    assert s["filtered"] >= 2 * 3  # at least the three even rows among the first six
    ex.status.reconcile()


def test_dynamic_filter_gives_up_with_a_clear_error_when_every_group_is_filtered(engine, tokenizer, rows):
    ex = make(engine, batch_size=2, group_size=2, dynamic_filter=True, filter_patience=3)
    try:
        with pytest.raises(RuntimeError, match=r"groups in a row were filtered .* rollout.filter_patience=3"):
            ex.prepare_batch(loader(rows, 2), Delayed(tokenizer, reward=lambda data: 0.0))
        s = ex.stats()
        assert s["filtered"] >= 3 * 2 * 2  # patience x batch_size groups x group_size episodes
    finally:
        ex.destroy()


def test_hanging_reward_fn_times_out(engine, tokenizer, rows):
    hang_id = rows[0]["id"]

    def reward_fn(prompt, completions, prompt_ids, completion_ids, **data):
        if data["id"] == hang_id:
            time.sleep(3600)
        return 0.5

    # 2 s: the healthy calls (threads of this process) return within it however loaded the machine
    wf = RLVRWorkflow(reward_fn, G, tokenizer, reward_timeout=2.0)
    ex = make(engine, max_failure_rate=1.0)
    t0 = time.monotonic()
    try:
        batch = ex.rollout_batch(rows[:3], wf)
    finally:
        ex.destroy()
    assert time.monotonic() - t0 < 600  # not the hung call's hour
    assert sorted(set(batch["prompt_index"].tolist())) == [1, 2]
    assert ex.stats()["failed"] == 2 and "did not return within 2.0s" in ex._last_error


@pytest.mark.parametrize("policy", ["requeue", "requeue_after"])
def test_state_dict_round_trip_neither_loses_nor_repeats(engine, tiny_model, tokenizer, rows, policy):
    data = rows[:24]
    pulled = []

    def counting(rs, start):
        for i in range(start, len(rs), 2):
            pulled.append(i)
            yield rs[i : i + 2]

    cfg = dict(max_staleness=1, tail_batch=policy, tail_batch_trigger=2)
    ex = make(engine, **cfg)
    consumed = []
    wf = Delayed(tokenizer, delay=0.02)
    src = counting(data, 0)
    for _ in range(3):
        consumed += ex.prepare_batch(src, wf)["prompt_index"][0::2].tolist()
        bump(engine, tiny_model)
    state = ex.state_dict()
    position = max(pulled) + 2  # rows the dataloader handed out
    ex.destroy()
    assert state["next_index"] == position and len(state["pending"]) > 0  # work was in flight
    assert {p["prompt_index"] for p in state["pending"]}.isdisjoint(consumed)

    ex2 = make(engine, **cfg)
    ex2.load_state_dict(state)
    src2 = counting(data, position)
    try:
        while True:
            try:
                b = ex2.prepare_batch(src2, wf)
            except StopIteration:
                break
            consumed += b["prompt_index"][0::2].tolist()
            bump(engine, tiny_model)
    finally:
        ex2.destroy()
    assert sorted(consumed) == list(range(len(data)))  # every prompt exactly once
    ex2.status.reconcile()
    assert ex2.stats()["completed"] == 2 * len(data)


@pytest.mark.parametrize("policy", ["discard", "requeue"])
def test_expired_prompts_follow_the_tail_policy(engine, tiny_model, tokenizer, rows, policy):
    """Groups produced ahead go stale when the version jumps past eta: ``discard`` drops their
    prompts (counted), ``requeue`` runs them again; no prompt is ever trained on twice."""
    ex = make(engine, max_staleness=1, tail_batch=policy)
    wf = Delayed(tokenizer)
    src = loader(rows[:60], 2)
    try:
        consumed = ex.prepare_batch(src, wf)["prompt_index"][0::2].tolist()
        deadline = time.monotonic() + 120  # the executor produces the next batch ahead at this version
        while ex.stats()["ready_prompts"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ex.stats()["ready_prompts"] >= 2, ex.stats()
        bump(engine, tiny_model)
        bump(engine, tiny_model)  # now they are 2 > eta versions old
        for _ in range(4):
            batch = ex.prepare_batch(src, wf)
            assert (
                batch["versions"].max() >= 0
                and (engine.get_version() - batch["versions"][batch["loss_mask"].bool()].min()) <= 1
            )
            consumed += batch["prompt_index"][0::2].tolist()
        s = ex.stats()
    finally:
        ex.destroy()
    assert s["expired"] > 0
    assert len(consumed) == len(set(consumed)) == 10
    if policy == "discard":
        assert s["discarded_prompts"] == s["expired"] / 2  # group_size 2: every expired prompt dropped
        assert max(consumed) >= 10 + s["discarded_prompts"] - 1  # later prompts took their place
    else:
        assert s["discarded_prompts"] == 0 and sorted(consumed) == list(range(10))  # expired ones ran again


# ----------------------------------------------------------------------------- submit / wait


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_submit_wait_staleness_bound_under_random_timing(engine, tiny_model, tokenizer, rows, eta):
    """The streaming verbs keep the same promises as prepare_batch: no token older than eta versions,
    groups together in prompt order, every episode accounted for."""
    ex = make(engine, max_staleness=eta)
    wf = Delayed(tokenizer, delay=0.05, seed=10 + eta)
    rng = random.Random(eta)
    it = iter(rows)
    seen, taken = [], []
    try:
        for _ in range(2 * (eta + 1)):  # the producer may run eta versions ahead
            ex.submit(next(it), wf)
        for _ in range(6):
            batch = ex.wait(2, timeout=60)
            v = engine.get_version()
            for row in range(batch["input_ids"].shape[0]):
                versions = batch["versions"][row]
                assert int(versions[versions >= 0].min()) >= v - eta
            assert batch["input_ids"].shape[0] == 4 and (batch["group_id"][0::2] == batch["group_id"][1::2]).all()
            assert batch["prompt_index"].tolist() == sorted(batch["prompt_index"].tolist())
            taken += batch["prompt_index"][0::2].tolist()
            seen += ex.last_staleness
            for _ in range(2):
                ex.submit(next(it), wf)
            time.sleep(rng.random() * 0.1)
            bump(engine, tiny_model)
    finally:
        ex.destroy()
    assert max(seen) <= eta and len(taken) == len(set(taken)) == 12  # no prompt twice
    ex.status.reconcile()
    s = ex.stats()
    assert s["completed"] == 6 * 2 * 2 and s["consumed_prompts"] == 12


def test_submit_wait_counts_failures_and_keeps_partial_groups(engine, tokenizer, rows):
    ex = make(engine, batch_size=4, group_size=2, max_failure_rate=0.9)
    wf = Delayed(tokenizer, fail_every=3)
    try:
        for row in rows[:6]:
            ex.submit(row, wf)
        batch = ex.wait(6, timeout=60)
    finally:
        ex.destroy()
    s = ex.stats()
    assert s["failed"] == wf.calls // 3 == 4 and s["completed"] == batch["input_ids"].shape[0] == 12 - 4
    assert sorted(set(batch["prompt_index"].tolist())) == list(
        range(6)
    )  # a group with a failed episode is kept, smaller
    ex.status.reconcile()


def test_wait_times_out_with_the_counts_and_bad_calls_name_the_problem(engine, tokenizer, rows):
    ex = WorkflowExecutor(RolloutConfig(batch_size=2, group_size=2), engine)
    wf = Delayed(tokenizer)
    with pytest.raises(RuntimeError, match="initialize"):
        ex.submit(rows[0], wf)
    ex.initialize()
    try:
        with pytest.raises(
            TimeoutError, match=r"wait\(1\) timed out after 0.3s: 0 of 1 groups ready, 0 running, 0 queued"
        ):
            ex.wait(1, timeout=0.3)
        with pytest.raises(ValueError, match="count >= 1"):
            ex.wait(0)
        with pytest.raises(TypeError, match="data row must be a dict"):
            ex.submit("2+2", wf)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="workflow must be a RolloutWorkflow"):
            ex.submit(rows[0], object())  # type: ignore[arg-type]
        ex.submit(rows[0], wf)  # the executor still works after bad calls
        assert ex.wait(1, timeout=60)["input_ids"].shape[0] == 2
    finally:
        ex.destroy()
    assert ex.stats()["submitted"] == 2 and ex.stats()["completed"] == 2


def test_destroy_lets_tasks_started_by_episodes_finish_their_clean_up(engine, tokenizer, rows):
    """An episode waiting on a future that a helper task settles (how RemoteEngine's batched HTTP calls
    run): destroy cancels the helper and waits while it unwinds, instead of closing the loop under it
    (which left "Task was destroyed but it is pending!" and skipped its clean-up, e.g. closing a connection)."""
    helpers: list[asyncio.Task] = []
    cleaned: list[bool] = []

    class WaitsOnAHelper(RLVRWorkflow):
        async def arun_episode(self, engine, data):
            fut = asyncio.get_running_loop().create_future()

            async def helper():
                try:
                    await asyncio.Event().wait()  # a request that never answers
                finally:
                    await asyncio.sleep(0.05)  # clean-up that needs the loop (closing a connection)
                    cleaned.append(True)

            helpers.append(asyncio.get_running_loop().create_task(helper()))
            return await fut

    ex = make(engine, batch_size=2, group_size=2)
    ex.submit(rows[0], WaitsOnAHelper(task_reward_fn("arithmetic"), G, tokenizer))
    deadline = time.monotonic() + 60
    while len(helpers) < 2:  # both episodes of the group are waiting
        assert time.monotonic() < deadline, "the episodes never started"
        time.sleep(0.01)
    ex.destroy()
    assert all(h.done() and h.cancelled() for h in helpers) and cleaned == [True, True]
