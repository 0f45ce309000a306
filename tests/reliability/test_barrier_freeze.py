"""A trainer rank that stops (SIGSTOP) before a collective (a barrier, an all-reduce, a
broadcast): the other rank stops within ``train.collective_timeout`` with one line (``Stalled``)
naming the collective, instead of waiting out the 30 minutes of the process group's old fixed
timeout or printing the backend's multi-line error. Two real gloo processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta

import pytest

from relayrl.utils.dist import free_port

TIMEOUT_S = 3.0

# each collective as rank 0 calls it while rank 1 is frozen, and the start of rank 0's line
COLLECTIVES = {
    "barrier": "the end of a checkpoint",
    "all_reduce": "an all-reduce (max)",
    "broadcast": "a broadcast (from rank 1)",  # rank 0 receives: a sender may return before anyone reads
}


def _rank(r: int, port: int, which: str, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2")
    import torch

    from relayrl.utils import dist as dist_utils
    from relayrl.utils.deadline import Stalled

    # set-up gets a minute (a rank of a loaded machine may take seconds to get here); the collective
    # under test gets TIMEOUT_S, as train.collective_timeout sets it for every one
    dist_utils.maybe_init_process_group(60.0)
    dist_utils.barrier()  # both ranks are in the group
    gloo = torch.distributed.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert gloo.options._timeout == timedelta(seconds=60)  # the group runs on the timeout it was given
    torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=TIMEOUT_S))
    dist_utils._timeout_s = TIMEOUT_S
    if r == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen before the next collective
    t0 = time.monotonic()
    try:
        if which == "barrier":
            dist_utils.barrier(what="the end of a checkpoint")
        elif which == "all_reduce":
            dist_utils.all_reduce(torch.tensor([1.0]), "max")
        else:
            dist_utils.broadcast_object({"step": 3}, src=1)
        out.put(("passed", 0.0))
    except Stalled as e:
        out.put((str(e), time.monotonic() - t0))
    except BaseException as e:  # noqa: BLE001 - the test shows what came instead of Stalled
        out.put((f"{type(e).__name__}: {e}", time.monotonic() - t0))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("which", list(COLLECTIVES))
def test_a_rank_frozen_before_a_collective_stops_the_other_with_one_line(which: str):
    ctx = mp.get_context("fork")  # the children only run gloo: no torch state of this process is reused
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, which, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        msg, waited = out.get(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.join(10)
    print(f"rank frozen before {which}: the other stopped after {waited:.1f}s: {msg}")
    assert msg.startswith(f"rank 0 of 2 waited 3s at {COLLECTIVES[which]} for the other ranks"), msg
    assert "train.collective_timeout" in msg and "\n" not in msg, msg
