"""Weights by collective broadcast: a process group of its own between the trainer (rank 0)
and the inference servers (ranks 1..n), driven by SGLang's HTTP protocol
(``/init_weights_update_group``, ``/update_weights_from_distributed``).

NCCL between GPUs is the fast path of disaggregated GPU training (no serialisation, no disk);
gloo runs the same code on CPU, which is how it is tested here.

The group is laid out exactly as SGLang builds its side (``init_custom_process_group`` in
``sglang/srt/utils``: a ``tcp://`` rendezvous, then ``PrefixStore(group_name, store)``, then
torch's ``_new_process_group_helper``, which adds ``PrefixStore(f"{group_name}/")`` and
``PrefixStore(f"{device}/")`` for the first device the backend serves: one gloo backend under
``cpu/`` (registered for cuda too), one NCCL backend under ``cuda/``). A member that is not
rank 0 checks in with the store (``wait_for_workers``), as the rendezvous' store clients do: a
rank 0 built by torch's rendezvous waits for every member's check-in before it returns.
Either side may therefore be relayrl or SGLang (or a trainer that uses SGLang's helper).
Tensors go out one broadcast each, in the order of the ``names`` the servers were sent.
"""

from __future__ import annotations

import socket
import typing
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling of SGLang's ``dtypes`` field)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; ValueError names the value otherwise."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def master_store(host: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """A rendezvous TCPStore listening on ``host`` only (TCPStore alone listens on every interface
    whatever host it is given): it takes a socket bound here (and owns it from then on)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    bound_port = sock.getsockname()[1]
    return dist.TCPStore(
        host,
        bound_port,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
        use_libuv=True,
    )


def address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (what a server there can reach us at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
        return str(s.getsockname()[0])


def store_device(backend: str) -> str:
    """The device whose store prefix torch's helper builds the backend under (gloo: ``cpu``, nccl:
    ``cuda``): it builds one backend, for the first device, when every device maps to the same backend."""
    return next(iter(BackendConfig(Backend(backend)).get_device_backend_map()))


def buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of consecutive items grouped so that each group's total stays within ``limit``
    bytes (an item larger than ``limit`` goes alone): SGLang-native trainers send bounded
    buckets, so a server allocates one bucket of receive buffers at a time."""
    out: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if out and total + n <= limit:
            out[-1].append(i)
            total += n
        else:
            out.append([i])
            total = n
    return out


class WeightBroadcastGroup:
    """One weight-update process group; ``rank`` 0 (the trainer) hosts the rendezvous store
    (``port=0`` picks a free port: read it from ``.port`` and tell the other members).

    The store is up when the constructor returns (for rank 0 at once; another rank has
    checked in); ``join()`` (or the first ``broadcast``) blocks until all ``world_size``
    members joined, or ``timeout_s`` passed.
    """

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        rank: int,
        backend: str = "nccl",
        group_name: str = "weight_update_group",
        timeout_s: float = 300.0,
    ) -> None:
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"weight group backend must be 'nccl' or 'gloo', got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("a weight group with backend='nccl' needs CUDA; gloo works on CPU")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
        self.rank, self.world_size, self.backend, self.name = rank, world_size, backend, group_name
        self.timeout = timedelta(seconds=timeout_s)
        # rank 0 does not wait for check-ins here: its port must be handed to the others first
        if rank == 0:
            self.store = master_store(host, port, world_size, self.timeout)
        else:
            self.store = dist.TCPStore(host, port, world_size, is_master=False, timeout=self.timeout)
        self.port = self.store.port
        self.pg: dist.ProcessGroup | None = None
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def join(self) -> WeightBroadcastGroup:
        """Build the process group; returns (itself) once every member has joined."""
        group = dist.PrefixStore(f"{self.name}/", dist.PrefixStore(self.name, self.store))
        store = dist.PrefixStore(f"{store_device(self.backend)}/", group)
        pg: object
        if self.backend == "nccl":
            pg = dist.ProcessGroupNCCL(store, self.rank, self.world_size)  # type: ignore[call-arg]  # (options default)
        else:
            pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, self.timeout)
        self.pg = typing.cast(dist.ProcessGroup, pg)  # a backend: broadcast() is all this uses
        return self

    def broadcast(self, tensors: dict[str, torch.Tensor]) -> None:
        """Rank 0 sends ``tensors`` in dict order; other ranks pass same-shaped buffers, filled in place."""
        if self.pg is None:
            self.join()
        pg = self.pg
        assert pg is not None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for t in tensors.values():
            buf = t.detach().to(self.device).contiguous()
            pg.broadcast([buf], opts).wait()
            if self.rank != 0 and buf is not t:
                t.copy_(buf)
