"""SGLang's side of a weight-update group, built the way SGLang builds it.

Follows SGLang v0.5.x ``python/sglang/srt/utils/common.py::init_custom_process_group`` and
``model_executor/model_runner.py::init_weights_update_group``: the member's rank is
``rank_offset + tp_rank``; the store comes from torch's ``rendezvous("tcp://addr:port", rank,
world_size)`` (a TCPStore client that checks in with the master; rank 0 hosts the store and
waits for every check-in); the store is wrapped in ``PrefixStore(group_name, store)`` and handed
to torch's ``_new_process_group_helper(world_size, rank, [], Backend(backend), store,
group_name=group_name, timeout=...)``, which wraps it again per group and per device.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout: timedelta
) -> dist.ProcessGroup:
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def receive(
    pg: dist.ProcessGroup, dtypes: list[str], shapes: list[list[int]], device: str = "cpu"
) -> list[torch.Tensor]:
    """``update_weights_from_distributed``'s receiving side: one broadcast from rank 0 per tensor, in order."""
    out = []
    for d, shape in zip(dtypes, shapes, strict=True):
        t = torch.empty(shape, dtype=getattr(torch, d), device=device)
        dist.broadcast(t, src=0, group=pg)
        out.append(t)
    return out


def send(pg: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """A trainer built with SGLang's helper (rank 0) sending tensors, one broadcast each."""
    for t in tensors:
        dist.broadcast(t, src=0, group=pg)


def sample_tensors() -> list[torch.Tensor]:
    """What the two-process tests send: three tensors of different dtypes and shapes."""
    g = torch.Generator().manual_seed(7)
    return [
        torch.randn(4, 3, generator=g),
        torch.arange(10, dtype=torch.int64),
        torch.randn(5, generator=g).to(torch.bfloat16),
    ]


def tp_worker() -> None:
    """``sglang_group.py worker``: a tensor-parallel rank > 0 of the SGLang stand-in (SGLang runs one
    scheduler process per TP rank, each joining the weight group as ``rank_offset + tp_rank``).
    Reads JSON commands from stdin, one a line: ``{"op": "init", ...}``, ``{"op": "recv", ...}``."""
    import json
    import sys

    groups: dict[str, dist.ProcessGroup] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "init":
                groups[cmd["group_name"]] = init_custom_process_group(
                    cmd["backend"],
                    f"tcp://{cmd['master_address']}:{cmd['master_port']}",
                    cmd["world_size"],
                    cmd["rank"],
                    cmd["group_name"],
                    timedelta(seconds=cmd["timeout"]),
                )
                print(json.dumps({"ok": True}), flush=True)
            elif cmd["op"] == "destroy":
                dist.destroy_process_group(groups.pop(cmd["group_name"]))
                print(json.dumps({"ok": True}), flush=True)
            elif cmd["op"] == "recv":
                got = receive(groups[cmd["group_name"]], cmd["dtypes"], cmd["shapes"])
                print(json.dumps({"ok": True, "sums": [float(t.double().sum()) for t in got]}), flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the server process
            print(json.dumps({"ok": False, "error": repr(e)}), flush=True)


def _main() -> None:
    """``sglang_group.py send|recv HOST PORT RANK WORLD GROUP``: one SGLang-built member; ``recv``
    prints the checksums of what it received, ``send`` (rank 0) hosts the store and sends."""
    import sys

    if sys.argv[1] == "worker":
        tp_worker()
        return
    verb, host, port, rank, world, group = sys.argv[1:7]
    if verb == "send" and int(port) == 0:
        import socket

        with socket.socket() as s:
            s.bind((host, 0))
            port = str(s.getsockname()[1])
    print(f"port {port}", flush=True)
    pg = init_custom_process_group("gloo", f"tcp://{host}:{port}", int(world), int(rank), group, timedelta(seconds=20))
    ts = sample_tensors()
    if verb == "send":
        send(pg, ts)
    else:
        got = receive(pg, [str(t.dtype).removeprefix("torch.") for t in ts], [list(t.shape) for t in ts])
        print("received", [round(float(t.double().sum()), 4) for t in got], flush=True)
    import os

    os._exit(0)  # as a server would, keep the group to the end: no teardown race with the other member's exit


if __name__ == "__main__":
    _main()
