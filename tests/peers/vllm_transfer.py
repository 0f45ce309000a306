"""vLLM's worker side of its weight-transfer engine, built as vLLM builds it, with gloo for PyNccl.

Follows ``vllm/distributed/weight_transfer/nccl_engine.py`` (commit 04b06efe),
``packed_tensor.py`` (commit 00a9ccfb) and ``vllm/distributed/utils.py::StatelessProcessGroup``:
the worker's rank is ``rank_offset + dp_rank * (tp * pp) + rank``; it joins the TCPStore that rank
0 (the trainer) hosts at ``master_address:master_port`` (no prefix), reads the communicator id
rank 0 published with ``broadcast_obj`` (key ``broadcast_from/0/0``, a pickle), builds the
communicator and warms it up with an all-reduce of one zero. ``receive`` takes the tensors of an
``update_info`` one broadcast each, or (``packed``) in uint8 buffers that each close once their
total exceeds ``packed_buffer_size_bytes``. vLLM's communicator is PyNccl; on CPU the id names
the store prefix of a gloo group instead.
"""

from __future__ import annotations

import math
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size")  # NCCLWeightTransferInitInfo
UPDATE_FIELDS = ("names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes", "packed_num_buffers")


def check_fields(info: dict, fields: tuple[str, ...], required: int, what: str) -> None:
    """vLLM builds its dataclass from the dict: unknown or missing fields are a TypeError."""
    unknown = sorted(set(info) - set(fields))
    missing = [f for f in fields[:required] if f not in info]
    if unknown or missing:
        raise TypeError(f"{what}.__init__() unexpected {unknown} / missing {missing}")


def join(init_info: dict, worker_rank: int, timeout_s: float = 60.0) -> tuple[dist.ProcessGroup, dist.Store]:
    """The group, and the store client it needs kept alive."""
    check_fields(init_info, INIT_FIELDS, 4, "NCCLWeightTransferInitInfo")
    rank = worker_rank + int(init_info["rank_offset"])
    world = int(init_info["world_size"])
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(init_info["master_address"], int(init_info["master_port"]), world, False, timeout=timeout)
    uid = pickle.loads(store.get("broadcast_from/0/0"))
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{uid}/", store), rank, world, timeout)
    pg.allreduce([torch.zeros(1)]).wait()
    return pg, store


def receive(pg: dist.ProcessGroup, update_info: dict) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors, and how many broadcasts carried them."""
    check_fields(update_info, UPDATE_FIELDS, 3, "NCCLWeightTransferUpdateInfo")
    names, shapes = update_info["names"], update_info["shapes"]
    dtypes = [getattr(torch, d) for d in update_info["dtype_names"]]
    if not len(names) == len(shapes) == len(dtypes):
        raise ValueError("`dtype_names` and `shapes` should be of the same size as `names`")
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    out: dict[str, torch.Tensor] = {}
    if not update_info.get("packed", False):
        for n, d, s in zip(names, dtypes, shapes, strict=True):
            t = torch.empty(s, dtype=d)
            pg.broadcast([t], opts).wait()
            out[n] = t
        return out, len(out)
    limit = int(update_info.get("packed_buffer_size_bytes", 1 << 30))
    pending: list[tuple[str, list[int], torch.dtype, int]] = []
    buffers = [0]

    def flush() -> None:
        buf = torch.empty(sum(p[3] for p in pending), dtype=torch.uint8)
        pg.broadcast([buf], opts).wait()
        buffers[0] += 1
        for (n, s, d, _), part in zip(pending, buf.split([p[3] for p in pending]), strict=True):
            out[n] = part.view(d).view(*s).clone()
        pending.clear()

    for n, d, s in zip(names, dtypes, shapes, strict=True):
        pending.append((n, list(s), d, math.prod(s) * d.itemsize))
        if sum(p[3] for p in pending) > limit:
            flush()
    if pending:
        flush()
    return out, buffers[0]
