"""The trainer's side of vLLM's weight-transfer engine (``vllm serve --weight-transfer-backend nccl``).

vLLM (``vllm/distributed/weight_transfer/nccl_engine.py``) does not use torch.distributed for
this: trainer (rank 0) and workers (rank ``rank_offset + worker rank``) meet through a
``StatelessProcessGroup`` (a TCPStore hosted by rank 0 on ``master_address:master_port``, no
key prefix); rank 0 publishes the NCCL unique id under the store key ``broadcast_from/0/0``
(a pickle), every rank builds a PyNccl communicator from it and warms it up with an all-reduce
of one zero. An update is one ``/update_weights`` call listing every tensor (``names``,
``dtype_names``, ``shapes``); with ``packed=True`` the tensors travel as uint8 buffers, each
closed once it holds more than ``packed_buffer_size_bytes`` (the tensor that crossed the limit
included), which bounds the server's receive memory.

- NCCL (GPUs, a real vLLM): vLLM's own trainer helpers build the communicator and send
  (``NCCLWeightTransferEngine.trainer_init`` / ``trainer_send_weights``), so ``vllm`` must be
  importable in the trainer process, as vLLM's RL examples require.
- gloo (CPU): vLLM has no gloo transfer backend; this is the same construction with a gloo
  group in place of PyNccl (the id published the same way names the group's store prefix). It
  is what the vLLM stand-in in ``tests/peers/`` builds, so the whole exchange is tested on CPU.
"""

from __future__ import annotations

import pickle
import secrets
import typing
from datetime import timedelta

import torch
import torch.distributed as dist

UNIQUE_ID_KEY = "broadcast_from/0/0"  # StatelessProcessGroup.broadcast_obj's first key from rank 0


def packed_groups(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of the tensors in each packed buffer, as vLLM packs them: a buffer is closed once
    its total exceeds ``limit`` bytes (the tensor that crossed it is the buffer's last)."""
    out: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(sizes):
        out[-1].append(i)
        total += n
        if total > limit:
            out.append([])
            total = 0
    return [g for g in out if g]


class VLLMTransferGroup:
    """Rank 0 of a vLLM weight-transfer group: ``port`` (0 picks one) to send in ``init_info``,
    ``join()`` once the servers were asked to init, then ``send(tensors, packed, limit)``."""

    def __init__(self, host: str, port: int, world_size: int, backend: str, timeout_s: float = 300.0) -> None:
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"vLLM weight transfer backend must be 'nccl' or 'gloo', got {backend!r}")
        self.host, self.world_size, self.backend = host, world_size, backend
        self.timeout = timedelta(seconds=timeout_s)
        self.pg: dist.ProcessGroup | None = None
        self.nccl: object | None = None
        if backend == "nccl":
            try:
                from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine  # noqa: F401
            except ImportError as e:
                raise RuntimeError(
                    "weight_sync=broadcast to vLLM over NCCL uses vLLM's trainer helpers "
                    "(NCCLWeightTransferEngine.trainer_init): install the server's vllm version in the trainer's "
                    "environment, or use inference.weight_sync=disk"
                ) from e
            import socket

            with socket.socket() as s:  # vLLM's StatelessProcessGroup binds the port itself
                s.bind((host, port))
                self.port = int(s.getsockname()[1]) if port == 0 else port
            self.store = None
        else:
            self.store = dist.TCPStore(
                host, port, world_size, is_master=True, timeout=self.timeout, wait_for_workers=False
            )
            self.port = self.store.port

    def join(self) -> VLLMTransferGroup:
        """Blocks until every rank joined (the servers' init calls run meanwhile)."""
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            init = {"master_address": self.host, "master_port": self.port, "world_size": self.world_size}
            self.nccl = NCCLWeightTransferEngine.trainer_init(init)
            return self
        assert self.store is not None
        uid = secrets.token_hex(16)
        self.store.set(UNIQUE_ID_KEY, pickle.dumps(uid))  # type: ignore[arg-type]  # the store takes bytes too
        gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"{uid}/", self.store), 0, self.world_size, self.timeout)
        pg = typing.cast(dist.ProcessGroup, gloo)  # a backend: all-reduce and broadcast are all this uses
        pg.allreduce([torch.zeros(1)]).wait()  # PyNccl's warm-up all-reduce
        self.pg = pg
        return self

    def send(self, tensors: dict[str, torch.Tensor], packed: bool, limit: int) -> None:
        """Broadcast ``tensors`` in dict order: one by one, or in packed uint8 buffers of ``limit`` bytes."""
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            args = {"group": self.nccl, "packed": packed, "packed_buffer_size_bytes": limit}
            NCCLWeightTransferEngine.trainer_send_weights(iter(tensors.items()), args)
            return
        assert self.pg is not None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        values = [t.detach().to("cpu").contiguous() for t in tensors.values()]
        if not packed:
            for t in values:
                self.pg.broadcast([t], opts).wait()
            return
        flat = [t.reshape(-1).view(torch.uint8) for t in values]
        for idx in packed_groups([f.numel() for f in flat], limit):
            self.pg.broadcast([torch.cat([flat[i] for i in idx])], opts).wait()
