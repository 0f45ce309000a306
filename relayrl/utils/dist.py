"""Small torch.distributed helpers that also work when torch.distributed is absent or idle.

Every function answers for a single process (rank 0 of 1) when no process group exists,
so code that calls them runs unchanged in one process, under ``torchrun``, or in tests.
"""

from __future__ import annotations

import os
import socket
from typing import Literal

import torch
import torch.distributed as dist

ReduceOpName = Literal["sum", "min", "max"]

_OPS = {"sum": "SUM", "min": "MIN", "max": "MAX"}


def is_dist() -> bool:
    """True when a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_dist() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_dist() else 1


def is_main() -> bool:
    """True on global rank 0 (and in a single process): the rank that writes logs and files."""
    return rank() == 0


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if is_dist():
        dist.barrier(group)


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where collective tensors must live for the group's backend (NCCL needs CUDA)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op: ReduceOpName = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Return ``tensor`` reduced over the ranks of ``group`` (a new tensor on ``tensor``'s device).

    Without a process group this is the identity. The tensor is moved to the backend's
    device for the collective (CPU for gloo, CUDA for NCCL) and moved back.
    """
    if op not in _OPS:
        raise ValueError(f"all_reduce op must be one of {list(_OPS)}, got {op!r}")
    if not is_dist() or world_size(group) == 1:
        return tensor.clone()
    buf = tensor.detach().to(_comm_device(group), copy=True)
    dist.all_reduce(buf, op=getattr(dist.ReduceOp, _OPS[op]), group=group)
    return buf.to(tensor.device)


def all_gather_object(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` without a process group."""
    if not is_dist() or world_size(group) == 1:
        return [obj]
    out: list[object] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: object, src: int = 0) -> object:
    """``obj`` of rank ``src`` on every rank (picklable; tensors travel inside the pickle);
    ``obj`` itself without a process group."""
    if not is_dist() or world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a process group or a test server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_from_env(backend: str = "gloo") -> bool:
    """Join the process group described by torchrun's env vars (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``); returns False (and does nothing) when they are unset."""
    if is_dist():
        return True
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    dist.init_process_group(backend=backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return True
