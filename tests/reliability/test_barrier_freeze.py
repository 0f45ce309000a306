"""A trainer rank that stops (SIGSTOP) before a barrier: the other rank stops within
``train.collective_timeout`` with one line (``Stalled``), instead of waiting out the 30 minutes
of the process group's old fixed timeout. Two real gloo processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from relayrl.utils.dist import free_port

TIMEOUT_S = 3.0


def _rank(r: int, port: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2")
    from relayrl.utils import dist as dist_utils
    from relayrl.utils.deadline import Stalled

    dist_utils.maybe_init_process_group(TIMEOUT_S)
    dist_utils.barrier()  # both ranks are in the group
    if r == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen before the next barrier
    t0 = time.monotonic()
    try:
        dist_utils.barrier(what="the end of a checkpoint")
        out.put(("passed", 0.0))
    except Stalled as e:
        out.put((str(e), time.monotonic() - t0))


@pytest.mark.timeout(90)
def test_a_rank_frozen_before_a_barrier_stops_the_other_with_one_line():
    ctx = mp.get_context("fork")  # the children only run gloo: no torch state of this process is reused
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        msg, waited = out.get(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.join(10)
    print(f"rank frozen before a barrier: the other stopped after {waited:.1f}s: {msg}")
    assert msg.startswith("rank 0 of 2 waited 3s at the end of a checkpoint for the other ranks")
    assert "train.collective_timeout" in msg and "\n" not in msg
