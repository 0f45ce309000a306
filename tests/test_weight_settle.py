"""``relayrl.inference.remote.weights.settle``: when a broadcast's wait ends early, and when it must not."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from relayrl.inference.remote.protocol import Server
from relayrl.inference.remote.weights import settle


class _Fleet:
    def evict(self, srv: Server, why: object) -> None:
        if srv.alive:
            srv.alive, srv.evictions = False, srv.evictions + 1


def _reply_after(seconds: float) -> Future[object]:
    f: Future[object] = Future()

    def answer() -> None:
        time.sleep(seconds)
        f.set_result({"success": True})

    threading.Thread(target=answer, daemon=True).start()
    return f


def test_a_server_being_readmitted_is_not_taken_for_one_evicted_during_the_broadcast():
    """Re-admission pushes the weights to a server that is not alive yet; a reply slower than the wait's
    first look (0.1 s) ended the push as "evicted during a weight broadcast" and the server was never
    re-admitted (test_peers.py's kill-and-readmit, once in CI)."""
    back = Server("http://127.0.0.1:1", alive=False, evictions=1)  # killed earlier, now being re-admitted
    errors: list[BaseException] = []
    settle(_Fleet(), [back], [_reply_after(0.5)], lambda: None, errors)
    assert errors == []


def test_a_member_evicted_during_the_broadcast_ends_the_wait():
    fleet, frozen = _Fleet(), Server("http://127.0.0.1:2")
    errors: list[BaseException] = []
    threading.Timer(0.3, fleet.evict, (frozen, "health check failed")).start()  # the health check, meanwhile
    t0 = time.monotonic()
    settle(fleet, [frozen], [_reply_after(30)], lambda: None, errors)
    assert time.monotonic() - t0 < 20  # not the reply's 30 s
    assert [str(e) for e in errors] == ["http://127.0.0.1:2 evicted during a weight broadcast"]
