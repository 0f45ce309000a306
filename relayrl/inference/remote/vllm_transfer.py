"""The trainer's side of vLLM's weight-transfer API (``vllm serve --weight-transfer-config '{"backend": "nccl"}'``;
a disk backend exists in later vLLM sources, not in releases up to 0.33):
its routes, the checks that a server has them, and the two syncs ``vllm.VLLMBackend.weight_sync`` picks
(``VLLMDisk``, ``VLLMBroadcast``; see ``vllm``'s docstring for the update sequence).

The transfer group: vLLM (``vllm/distributed/weight_transfer/nccl_engine.py``) does not use torch.distributed for
this: trainer (rank 0) and workers (rank ``rank_offset + worker rank``) meet through a
``StatelessProcessGroup`` (a TCPStore hosted by rank 0 on ``master_address:master_port``, no
key prefix); rank 0 publishes the NCCL unique id under the store key ``broadcast_from/0/0``
(a pickle, which vLLM's workers unpickle: vLLM's protocol, not relayrl's choice; relayrl only
writes it, and its store listens on ``master_address`` alone, not on every interface), every rank
builds a PyNccl communicator from it and warms it up with an all-reduce of one zero. An update is one ``/update_weights`` call listing every tensor (``names``,
``dtype_names``, ``shapes``); with ``packed=True`` the tensors travel as uint8 buffers, each
closed once it holds more than ``packed_buffer_size_bytes`` (the tensor that crossed the limit
included), which bounds the server's receive memory.

- NCCL (GPUs, a real vLLM): vLLM's own trainer helpers build the communicator and send
  (``NCCLWeightTransferEngine.trainer_init`` / ``trainer_send_weights``), so ``vllm`` must be
  importable in the trainer process, as vLLM's RL examples require.
- gloo (CPU): vLLM has no gloo transfer backend; this is the same construction with a gloo
  group in place of PyNccl (the id published the same way names the group's store prefix). It
  is what the vLLM stand-in in ``tests/peers/`` builds, so the whole exchange is tested on CPU.

NCCL fails safe (``relayrl.utils.failsafe``): vLLM has no gloo transfer to fall back to, so if the
first NCCL update fails for another reason than a dead server (``vllm`` not importable in the trainer,
NCCL unable to start), that update and every later one reload from ``inference.weight_sync_dir``
through ``/collective_rpc`` (the weight_sync=disk path), with one warning; without that directory,
or on a server without ``/collective_rpc``, the error says what to set.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import secrets
import typing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Protocol

import httpx
import torch
import torch.distributed as dist

from relayrl.api.io import WeightUpdate
from relayrl.inference.remote.protocol import AdminError, Call, JsonDict, PeerInfo, Server, UnsupportedServer
from relayrl.inference.remote.weights import (
    BroadcastSync,
    DiskSync,
    Fleet,
    Replies,
    members,
    settle,
)
from relayrl.inference.weight_group import address_towards, dtype_name, master_store
from relayrl.utils.failsafe import fall_back, reason

log = logging.getLogger(__name__)

TRANSFER = "/init_weight_transfer_engine"
RL_ROUTER = "VLLM_SERVER_DEV_MODE=1: vLLM attaches its RL router only in dev mode"
UNIQUE_ID_KEY = "broadcast_from/0/0"  # StatelessProcessGroup.broadcast_obj's first key from rank 0
NCCL_TRANSFER = "vLLM NCCL weight transfer (inference.weight_sync=broadcast)"


def transfer_backend() -> str:
    """NCCL with CUDA (vLLM's only transfer backend); gloo on CPU, which only the stand-in speaks.
    The seam tests replace to put NCCL, which cannot start on CPU, in the way."""
    return "nccl" if torch.cuda.is_available() else "gloo"


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
    ``join()`` once the servers were asked to init, then ``send(tensors, limit)``."""

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
            self.store = master_store(host, port, world_size, self.timeout)
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

    def send(self, tensors: dict[str, torch.Tensor], limit: int) -> None:
        """Broadcast ``tensors`` in dict order, in packed uint8 buffers of ``limit`` bytes (as ``transfer_update`` says)."""
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            args = {"group": self.nccl, "packed": True, "packed_buffer_size_bytes": limit}
            NCCLWeightTransferEngine.trainer_send_weights(iter(tensors.items()), args)
            return
        assert self.pg is not None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        flat = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
        for idx in packed_groups([f.numel() for f in flat], limit):
            self.pg.broadcast([torch.cat([flat[i] for i in idx])], opts).wait()


class Controls(Replies, Protocol):
    """What the syncs use of vLLM's request mapping (``vllm.VLLMBackend``)."""

    def pause(self) -> Call: ...

    def resume(self) -> Call: ...

    def update_from_disk(self, path: str, version: int) -> Call: ...


def init_transfer(host: str, port: int, rank_offset: int, world_size: int) -> Call:
    """Join vLLM's weight-transfer group (``--weight-transfer-config '{"backend": "nccl"}'``): this server's
    workers take ranks ``rank_offset`` .. ``rank_offset + world size - 1``."""
    info: JsonDict = {
        "master_address": host,
        "master_port": port,
        "rank_offset": rank_offset,
        "world_size": world_size,
    }
    return Call("POST", "/init_weight_transfer_engine", {"init_info": info})


def init_disk_transfer() -> Call:
    """vLLM's disk transfer backend (``{"backend": "disk"}``, where a vLLM has one) takes no init fields."""
    return Call("POST", "/init_weight_transfer_engine", {"init_info": {}})


def transfer_update(names: list[str], dtypes: list[str], shapes: list[list[int]], bucket: int) -> Call:
    """Every tensor in one call, sent in packed buffers of ``bucket`` bytes (bounded receive memory)."""
    info: JsonDict = {
        "names": names,
        "dtype_names": dtypes,
        "shapes": shapes,
        "packed": True,
        "packed_buffer_size_bytes": bucket,
    }
    return Call("POST", "/update_weights", {"update_info": info})


def disk_update(path: str) -> Call:
    return Call("POST", "/update_weights", {"update_info": {"path": path}})


def start_update() -> Call:
    return Call("POST", "/start_weight_update")


def finish_update(version: int) -> Call:
    return Call("POST", "/finish_weight_update", {"weight_version": str(version)})


def require_routes(info: PeerInfo, url: str, sync: str) -> None:
    """Start-up check that ``url`` has the routes weight_sync=``sync`` needs."""
    if info.protocol != "vllm" or not info.routes or info.server == "relayrl":
        return
    missing = [] if "/pause" in info.routes else [f"/pause ({RL_ROUTER})"]
    if sync == "broadcast" and not {TRANSFER, "/update_weights"} <= info.routes:
        missing.append(
            f"{TRANSFER} and /update_weights (vLLM's weight-transfer API: a vLLM that has it, run with "
            f'--weight-transfer-config \'{{"backend": "nccl"}}\' and {RL_ROUTER})'
        )
    if sync == "disk" and "/start_weight_update" not in info.routes and "/collective_rpc" not in info.routes:
        missing.append(
            f"/collective_rpc ({RL_ROUTER}; for reload_weights) or vLLM's disk weight transfer "
            '(--weight-transfer-config \'{"backend": "disk"}\' on a vLLM that has that backend)'
        )
    if missing:
        raise UnsupportedServer(
            f"{url} (vLLM {info.version}) lacks {', '.join(missing)}, which weight_sync={sync} needs"
        )


def paused_for_update(fleet: Fleet, backend: Controls, servers: list[Server], update: Callable[[], None]) -> None:
    """Pause ``servers`` (abort mode) unless generation is paused already, run ``update()``, resume them."""
    paused = [] if fleet.paused else list(servers)
    if paused:
        fleet.fan_out(lambda s: fleet.admin(s, backend.pause()), paused)
    try:
        update()
    finally:
        for s in paused:
            try:
                fleet.admin(s, backend.resume())
            except (httpx.HTTPError, RuntimeError) as e:
                log.warning("%s did not resume after a weight update: %s", s.url, e)


class VLLMDisk(DiskSync):
    """weight_sync=disk: vLLM's disk transfer backend in a session, else ``/collective_rpc``
    (always with ``transfer=False``: the servers' transfer engine is NCCL's, NCCL having failed)."""

    def __init__(self, fleet: Fleet, backend: Controls, transfer: bool = True) -> None:
        super().__init__(fleet, backend.update_from_disk, backend)
        self.backend, self.transfer = backend, transfer

    def connect(self, srv: Server) -> None:
        """Pick the disk route this server offers."""
        info = srv.info
        if info is None:
            return
        require_routes(info, srv.url, "disk")
        if info.protocol != "vllm" or info.server == "relayrl":
            return
        if not self.transfer and info.routes and "/collective_rpc" not in info.routes:
            raise UnsupportedServer(f"{srv.url} (vLLM {info.version}) lacks /collective_rpc ({RL_ROUTER})")
        if not self.transfer or "/start_weight_update" not in info.routes or TRANSFER not in info.routes:
            info.disk_transfer = False  # a vLLM before the disk backend: /collective_rpc (require_routes checked it)
            return
        try:
            self.fleet.admin(srv, init_disk_transfer())
            info.disk_transfer = True
        except AdminError as e:
            if "/collective_rpc" not in info.routes:
                raise UnsupportedServer(
                    f"{srv.url} refused vLLM's disk weight transfer ({e}): start it with "
                    '--weight-transfer-config \'{"backend": "disk"}\' on a vLLM that has that backend'
                ) from e
            log.warning("%s has no disk weight-transfer backend; reloading through /collective_rpc", srv.url)
            info.disk_transfer = False

    def push(self, srv: Server, data: object, version: int) -> None:
        path = os.path.abspath(str(data))  # the disk backend takes absolute directories only
        admin, vllm = self.fleet.admin, self.backend

        def load() -> None:
            if srv.info is not None and srv.info.disk_transfer:
                admin(srv, start_update())
                admin(srv, disk_update(path))
                admin(srv, finish_update(version))
            else:
                vllm.parse_update(admin(srv, vllm.update_from_disk(path, version)))
                if srv.info is not None and "/update_weight_version" in srv.info.routes:  # /weight_info then reports it
                    admin(srv, Call("POST", "/update_weight_version", {"new_version": str(version)}))

        paused_for_update(self.fleet, vllm, [srv], load)
        self.confirm(srv, version)


class VLLMBroadcast(BroadcastSync):
    """weight_sync=broadcast through vLLM's weight-transfer API (NCCL, or gloo with the stand-in);
    disk reloads once NCCL failed at first use (the module docstring)."""

    def __init__(self, fleet: Fleet, backend: Controls) -> None:
        super().__init__(fleet)
        self.backend = backend
        self.group: VLLMTransferGroup | None = None
        self.members: list[tuple[str, int]] = []
        self.collective = transfer_backend()
        self.disk: VLLMDisk | None = None  # the fallback, once NCCL failed at first use
        self.written: tuple[int, str] | None = None  # the fallback's last directory: (version, path)

    def connect(self, srv: Server) -> None:
        if self.disk is not None:
            self.disk.connect(srv)
        elif srv.info is not None:
            require_routes(srv.info, srv.url, "broadcast")

    def broadcast(self, tensors: dict[str, torch.Tensor], version: int, servers: list[Server]) -> None:
        """Disk reloads once NCCL failed at first use; else the transfer group."""
        if self.disk is not None:
            return self._reload(tensors, version, servers)
        super().broadcast(tensors, version, servers)

    def nccl_failed(
        self, error: Exception, tensors: dict[str, torch.Tensor], version: int, servers: list[Server]
    ) -> None:
        """Disk reloads from ``inference.weight_sync_dir`` from now on (none set: the error says to set it)."""
        why, where = reason(error), self.fleet.config.weight_sync_dir
        if not where:
            raise RuntimeError(
                f"{NCCL_TRANSFER} failed at first use ({why}) and vLLM has no other transfer backend: set "
                "inference.weight_sync_dir to a directory every server reads (updates then reload from it), "
                "or inference.weight_sync=disk"
            ) from error
        disk = VLLMDisk(self.fleet, self.backend, transfer=False)
        try:
            for s in servers:
                disk.connect(s)
        except UnsupportedServer as e:
            raise RuntimeError(f"{NCCL_TRANSFER} failed at first use ({why}); reloading from disk instead: {e}") from e
        fall_back(NCCL_TRANSFER, why, f"disk reloads from inference.weight_sync_dir ({where}) through /collective_rpc")
        self.disk, self.group = disk, None
        self._reload(tensors, version, servers)

    def _reload(self, tensors: dict[str, torch.Tensor], version: int, servers: list[Server]) -> None:
        assert self.disk is not None
        if self.written is None or self.written[0] != version:  # written once per version (a rejoin reuses it)
            path = self.disk.prepare(WeightUpdate(kind="tensors", version=version, tensors=tensors))
            self.written = (version, str(path))
        self.disk.send(self.written[1], version, servers)

    def _join(self, servers: list[Server], ex: ThreadPoolExecutor, errors: list[BaseException]) -> VLLMTransferGroup:
        self.group, self.members = None, []
        host = address_towards(httpx.URL(servers[0].url).host)
        sizes = [s.info.tp_size if s.info is not None else 1 for s in servers]
        offsets = list(itertools.accumulate([1, *sizes[:-1]]))
        group = VLLMTransferGroup(host, 0, 1 + sum(sizes), self.collective, self.fleet.config.request_timeout)
        calls = [init_transfer(host, group.port, off, 1 + sum(sizes)) for off in offsets]
        joins = [ex.submit(self.fleet.admin, s, c) for s, c in zip(servers, calls, strict=True)]
        settle(self.fleet, servers, joins, group.join, errors)
        if errors:
            raise errors[0]
        self.group, self.members = group, members(servers)
        return group

    def _broadcast(self, tensors: dict[str, torch.Tensor], version: int, servers: list[Server]) -> None:
        admin, vllm = self.fleet.admin, self.backend
        errors: list[BaseException] = []
        ex = ThreadPoolExecutor(len(servers))  # not a `with`: on a failure, do not wait for calls left hanging
        try:
            group = self.group
            if group is None or self.members != members(servers):
                group = self._join(servers, ex, errors)
            limit = int(self.fleet.config.weight_bucket_mb * (1 << 20))
            call = transfer_update(
                list(tensors),
                [dtype_name(t.dtype) for t in tensors.values()],
                [list(t.shape) for t in tensors.values()],
                limit,
            )
            sessions = [s for s in servers if s.info is not None and "/start_weight_update" in s.info.routes]
            current = group

            def send() -> None:
                opened: list[Server] = []
                try:
                    for s in sessions:
                        admin(s, start_update())
                        opened.append(s)
                    replies = [ex.submit(admin, s, call) for s in servers]
                    settle(self.fleet, servers, replies, lambda: current.send(tensors, limit), errors)
                    if errors:
                        raise errors[0]
                except BaseException:
                    # close the sessions opened, with no version (the next update is sent whole): left open,
                    # every later /start_weight_update there is refused and the server takes no update again
                    for s in (s for s in opened if s.alive):
                        with contextlib.suppress(httpx.HTTPError, RuntimeError):
                            admin(s, Call("POST", "/finish_weight_update", {}))
                    raise
                for s in sessions:
                    admin(s, finish_update(version))

            paused_for_update(self.fleet, vllm, servers, send)
        finally:
            ex.shutdown(wait=False)
            if errors:
                self.group = None
        for s in servers:
            self.confirm(s, version)
