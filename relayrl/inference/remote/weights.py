"""How weights reach RemoteEngine's servers: one ``WeightSync`` object per peer and mode, held by
RemoteEngine (the peer module's ``weight_sync`` picks it).

This module holds what every peer shares: the ``Fleet`` a sync works on (RemoteEngine's servers
and admin calls), the per-server syncs (a versioned safetensors dir on shared disk, an HTTP
upload) and ``settle``, which runs this side of a collective while the servers' HTTP calls run
theirs (the broadcast syncs live in the peer modules: each peer builds its group its own way).
"""

from __future__ import annotations

import os
import shutil
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import httpx
import safetensors.torch
import torch

from relayrl.api.io import WeightUpdate
from relayrl.inference.remote.protocol import DEAD_ERRORS, Call, Server, version_of
from relayrl.utils.deadline import within

if TYPE_CHECKING:
    from relayrl.api.config import InferenceConfig
    from relayrl.inference.remote.transport import Clients


class Fleet(Protocol):
    """What a weight sync may use of RemoteEngine."""

    config: InferenceConfig
    http: Clients  # (status, body) requests to a server, for the calls whose refusals are read
    servers: list[Server]
    paused: bool  # generation is paused by the trainer (a sync that pauses servers leaves them so)

    def admin(self, srv: Server, call: Call, timeout: float | None = None, content: bytes | None = None) -> object:
        """Send ``call`` to ``srv`` now (within ``timeout``, default inference.request_timeout); its JSON
        reply, or ``AdminError`` (its ``status``) on a 4xx/5xx."""
        ...

    def fan_out(self, fn: Callable[[Server], object], servers: list[Server]) -> None:
        """``fn(server)`` on all ``servers`` at once; dead ones are evicted, other errors raised."""
        ...

    def evict(self, srv: Server, why: object) -> None: ...


class Replies(Protocol):
    """The reply parsing a sync needs from the peer's request mapping."""

    def parse_update(self, body: object) -> None: ...


class WeightSync(ABC):
    """One way weights reach the servers."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def connect(self, srv: Server) -> None:  # noqa: B027 - a default: most syncs check nothing
        """At connect and re-admission: check ``srv`` offers what this sync needs (named if not)."""

    @abstractmethod
    def prepare(self, update: WeightUpdate) -> object:
        """What is sent for ``update`` (a directory, a payload, tensors), built once for every server."""

    @abstractmethod
    def send(self, data: object, version: int, servers: list[Server]) -> None:
        """``data`` to every server of ``servers``, each confirmed at ``version``."""

    @abstractmethod
    def rejoin(self, srv: Server, data: object, version: int) -> None:
        """``data`` to one server coming back; errors raised (it stays out)."""

    def confirm(self, srv: Server, version: int) -> None:
        """``srv`` is at ``version``: checked where it reports a version."""
        path = srv.info.version_path if srv.info is not None else None
        if path is not None:
            got = version_of(self.fleet.admin(srv, Call("GET", path)))
            if got != version:
                raise RuntimeError(f"{srv.url} reports weight version {got} after an update to {version}")
        srv.version = version


class PerServerSync(WeightSync):
    """A sync that loads each server on its own (``push``), all at once."""

    @abstractmethod
    def push(self, srv: Server, data: object, version: int) -> None: ...

    def send(self, data: object, version: int, servers: list[Server]) -> None:
        self.fleet.fan_out(lambda s: self.push(s, data, version), servers)

    def rejoin(self, srv: Server, data: object, version: int) -> None:
        self.push(srv, data, version)


def host_tensors(update: WeightUpdate) -> dict[str, torch.Tensor]:
    """The update's tensors on the CPU, each its own storage (safetensors refuses tied ones)."""
    assert update.tensors is not None
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in update.tensors.items()}


def publish(root: Path, prefix: str, version: int, fill: Callable[[Path], None], digits: int = 0) -> str:
    """Write ``root/<prefix><version>`` with ``fill`` under a temporary name and rename it, so that a
    server never reads one half-written. Of this prefix's directories, the two newest up to this one
    are kept; higher ones (an earlier run's, before a resume) are not ours to judge."""
    final = root / f"{prefix}{version:0{digits}d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    fill(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    numbered = ((p, p.name[len(prefix) :]) for p in root.glob(f"{prefix}*"))
    for _, old in sorted((int(v), p) for p, v in numbered if v.isdigit() and int(v) <= version)[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    return str(final)


class DiskSync(PerServerSync):
    """weight_sync=disk: a versioned safetensors dir in ``weight_sync_dir`` (the two newest kept), or
    the directory a ``WeightUpdate(kind="disk")`` names; each server loads it through ``load``."""

    def __init__(self, fleet: Fleet, load: Callable[[str, int], Call], replies: Replies) -> None:
        super().__init__(fleet)
        self.load, self.replies = load, replies

    def prepare(self, update: WeightUpdate) -> object:
        if update.kind == "disk":
            return update.path
        tensors = host_tensors(update)
        root = Path(self.fleet.config.weight_sync_dir)
        limit = self.fleet.config.request_timeout

        def fill(d: Path) -> None:
            safetensors.torch.save_file(tensors, str(d / "model.safetensors"))

        return within(  # a write that blocks (a full or hung file system, a FIFO) stops the run instead of hanging it
            limit,
            lambda: publish(root, "v", update.version, fill, digits=8),
            lambda: (
                f"writing weights v{update.version} to inference.weight_sync_dir={root} took over {limit:.0f}s: "
                "its storage blocks (full, or a hung network file system); fix it, or give it longer with "
                "inference.request_timeout"
            ),
        )

    def push(self, srv: Server, data: object, version: int) -> None:
        self.replies.parse_update(self.fleet.admin(srv, self.load(str(data), version)))
        self.confirm(srv, version)


class UploadSync(PerServerSync):
    """weight_sync=http: the safetensors bytes in the body of ``upload(version)`` (relayrl servers)."""

    def __init__(self, fleet: Fleet, upload: Callable[[int], Call], replies: Replies) -> None:
        super().__init__(fleet)
        self.upload, self.replies = upload, replies

    def prepare(self, update: WeightUpdate) -> object:
        return safetensors.torch.save(host_tensors(update))

    def push(self, srv: Server, data: object, version: int) -> None:
        assert isinstance(data, bytes)
        self.replies.parse_update(self.fleet.admin(srv, self.upload(version), content=data))
        self.confirm(srv, version)


class BroadcastSync(WeightSync):
    """weight_sync=broadcast: the update's tensors, where they are and in name order (both sides'
    order), to every live server through a collective group the peer builds (``broadcast``). A server
    that dies mid-way leaves: the others get the update through a new group; one coming back is let in
    by rebuilding the group with it.

    NCCL fails safe (``relayrl.utils.failsafe``): a failure at its first use for another reason than a
    dead server hands the update to the peer's ``nccl_failed``, which sends it another way from then on."""

    collective = "gloo"  # the group's backend: "nccl" or "gloo" (set by the peer's sync)
    proven = False  # a broadcast over ``collective`` succeeded: a later failure is raised, not fallen back from

    def broadcast(self, tensors: dict[str, torch.Tensor], version: int, servers: list[Server]) -> None:
        """``_broadcast``, or at the first use of NCCL, when it fails, ``nccl_failed``."""
        try:
            self._broadcast(tensors, version, servers)
        except ConnectionError:
            raise
        except Exception as e:
            if self.proven or self.collective != "nccl":
                raise
            self.nccl_failed(e, tensors, version, servers)
        self.proven = True

    @abstractmethod
    def _broadcast(self, tensors: dict[str, torch.Tensor], version: int, servers: list[Server]) -> None:
        """``tensors`` to ``servers`` (the group rebuilt if its members changed), each confirmed at ``version``."""

    @abstractmethod
    def nccl_failed(
        self, error: Exception, tensors: dict[str, torch.Tensor], version: int, servers: list[Server]
    ) -> None:
        """NCCL failed at its first use with ``error``: switch to the peer's other way and send this update by it."""

    def prepare(self, update: WeightUpdate) -> object:
        assert update.tensors is not None
        return {k: v.detach().contiguous() for k, v in sorted(update.tensors.items())}

    def send(self, data: object, version: int, servers: list[Server]) -> None:
        try:
            self.broadcast(_tensors(data), version, servers)
        except ConnectionError:  # a server died mid-way (evicted): the others get it through a new group
            live = [s for s in self.fleet.servers if s.alive]
            if not live:
                raise
            self.broadcast(_tensors(data), version, live)

    def rejoin(self, srv: Server, data: object, version: int) -> None:
        self.broadcast(_tensors(data), version, [s for s in self.fleet.servers if s.alive or s is srv])


def _tensors(data: object) -> dict[str, torch.Tensor]:
    assert isinstance(data, dict)
    return data


def settle(
    fleet: Fleet,
    servers: list[Server],
    replies: list[Future[object]],
    collective: Callable[[], object],
    errors: list[BaseException],
) -> None:
    """Run this side of a collective (on a thread) while the servers' HTTP calls run theirs.

    A failed call (a dead server, a refusal), a failed collective or a member evicted during it
    (frozen: the health check; not one still being re-admitted) ends the wait at once: the rest cannot complete without that member
    (its thread and the servers' handlers time out on their own). Failures go to ``errors`` (the
    caller drops its group); dead servers, and those whose call timed out, are evicted."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            collective()
        except BaseException as e:  # noqa: BLE001 - reported through `failed`
            failed.append(e)

    thread = threading.Thread(target=run, name="relayrl-weight-broadcast", daemon=True)
    thread.start()
    owner = dict(zip(replies, servers, strict=True))
    evictions = {f: owner[f].evictions for f in replies}  # (a server being re-admitted is not alive yet)
    pending = set(replies)
    while pending and not failed and not errors:
        done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
        for f in done:
            try:
                f.result()
            except (*DEAD_ERRORS, httpx.TimeoutException) as e:
                fleet.evict(owner[f], f"no answer during a weight broadcast: {e!r}")
                errors.append(ConnectionError(f"{owner[f].url} died or froze during a weight broadcast"))
            except BaseException as e:  # noqa: BLE001 - collected, raised by the caller
                errors.append(e)
        gone = [owner[f].url for f in pending if owner[f].evictions > evictions[f]]
        if gone and not errors:  # evicted meanwhile: its reply, and its part of the collective, never come
            errors.append(ConnectionError(f"{', '.join(gone)} evicted during a weight broadcast"))
    if not errors and not failed:
        thread.join()
    errors.extend(failed)


def members(servers: list[Server]) -> list[tuple[str, int]]:
    """A weight group's members: a server evicted since the group was built (it may have restarted
    and left it) makes the group stale."""
    return [(s.url, s.evictions) for s in servers]
