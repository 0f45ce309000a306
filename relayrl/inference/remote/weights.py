"""RemoteEngine's weight sync (mixed into ``RemoteEngine``): a versioned safetensors dir on shared
disk, an HTTP upload, or a collective broadcast to every server over a process group of their own
(NCCL on GPUs, gloo on CPU) in buckets of ``weight_bucket_mb``; each server's new version is
confirmed where it reports one. Servers being updated are flagged (no health probes, no new
requests sent to them)."""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import threading
import typing
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import safetensors.torch
import torch

from relayrl.api.config import InferenceConfig
from relayrl.api.io import WeightUpdate
from relayrl.inference.remote.sglang import WEIGHT_GROUP, Backend, Call, SGLangBackend
from relayrl.inference.remote.vllm_transfer import VLLMTransferGroup
from relayrl.inference.weight_group import WeightBroadcastGroup, address_towards, buckets, dtype_name

if TYPE_CHECKING:
    from relayrl.inference.remote.engine import _Server

# Errors after which a server is presumed dead (refused, reset, closed mid-reply).
DEAD_ERRORS = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.ConnectTimeout)

Weights = tuple[
    str, str | bytes | dict[str, torch.Tensor]
]  # ("disk", path), ("http", payload), ("broadcast", tensors) or ("adapter", adapter dir)


class WeightSync:
    """Needs from ``RemoteEngine``: ``config``, ``backend``, ``servers``, ``_admin``, ``_fan_out``,
    ``_evict``, ``_paused``, ``_group*``, ``_update_lock``, ``_version``, ``_last_weights``."""

    # what RemoteEngine provides (declared for the type checker)
    config: InferenceConfig
    backend: Backend
    servers: list[_Server]
    _paused: bool
    _update_lock: threading.Lock
    _group: WeightBroadcastGroup | VLLMTransferGroup | None
    _group_members: list[str]
    _group_stale: bool
    _last_weights: tuple[str, str | bytes | dict[str, torch.Tensor]] | None
    _admin: Callable[..., object]
    _fan_out: Callable[..., None]
    _evict: Callable[..., None]
    # from AdapterSync (remote_lora.py)
    accepts_adapters: bool
    _load_adapter: Callable[[_Server, str, int], None]
    _write_adapter: Callable[[WeightUpdate], str]

    def _push(self, srv: _Server, weights: tuple[str, str | bytes | dict[str, torch.Tensor]], version: int) -> None:
        kind, data = weights
        if kind == "adapter":
            self._load_adapter(srv, str(data), version)
            return
        if kind == "broadcast":  # a server (re)joining: the group is rebuilt with it in
            tensors = typing.cast(dict[str, torch.Tensor], data)
            self._broadcast(tensors, version, [s for s in self.servers if s.alive or s is srv])
            return
        if kind == "disk":
            body = self._admin(srv, self.backend.update_from_disk(str(data), version))
        else:
            body = self._admin(srv, self.backend.upload(version), content=data)
        self.backend.parse_update(body)
        self._confirm(srv, version)

    def _broadcast(self, tensors: dict[str, torch.Tensor], version: int, servers: list[_Server]) -> None:
        """weight_sync=broadcast: every server receives ``tensors`` from one collective broadcast.

        The group (this process = rank 0, server i = rank i + 1) is built on first use and
        rebuilt whenever its members change: a dead server leaves it, a returning one rejoins.
        A server that fails mid-way is evicted (dead) or its error raised; either way the group
        is dropped, to be rebuilt from the live servers at the next update."""
        sglang = self.backend
        assert isinstance(sglang, SGLangBackend)  # vLLM: VLLMWeightSync._broadcast
        members = [s.url for s in servers]
        errors: list[BaseException] = []
        ex = ThreadPoolExecutor(len(servers))  # not a `with`: on a failure, do not wait for calls left hanging
        try:
            if self._group is None or self._group_members != members or self._group_stale:
                # members leave any group of that name first (this engine's old one, or one left by an earlier
                # trainer): SGLang refuses a second group of the same name
                for s in servers:
                    try:
                        self._admin(s, sglang.destroy_weight_group(), timeout=30)
                    except (httpx.HTTPError, RuntimeError):
                        pass  # a server that never joined, or one too old for the route (then init fails, named)
                self._group, self._group_members, self._group_stale = None, [], False
                host = address_towards(httpx.URL(servers[0].url).host)
                # NCCL to GPU servers (SGLang); gloo without CUDA, and to relayrl servers (they run on CPU)
                backend = "nccl" if torch.cuda.is_available() and self.backend.name != "relayrl" else "gloo"
                # a server of tensor-parallel size k takes ranks rank_offset .. rank_offset + k - 1 (SGLang: rank_offset + tp_rank)
                sizes = [s.info.tp_size if s.info is not None else 1 for s in servers]
                offsets = list(itertools.accumulate([1, *sizes[:-1]]))
                world = 1 + sum(sizes)
                group = WeightBroadcastGroup(host, 0, world, 0, backend, WEIGHT_GROUP, self.config.request_timeout)
                calls = [sglang.init_weight_group(host, group.port, off, world, backend) for off in offsets]
                joins = [ex.submit(self._admin, s, c) for s, c in zip(servers, calls, strict=True)]
                self._settle(servers, joins, group.join, errors)
                if errors:
                    raise errors[0]
                self._group, self._group_members = group, members
            current = self._group
            assert isinstance(current, WeightBroadcastGroup)
            names = list(tensors)
            limit = int(self.config.weight_bucket_mb * (1 << 20))
            parts = buckets([t.numel() * t.element_size() for t in tensors.values()], limit)
            for b, idx in enumerate(parts):  # one bounded bucket per call: the servers allocate one bucket at a time
                bucket = {names[i]: tensors[names[i]] for i in idx}
                call = sglang.update_distributed(
                    list(bucket),
                    [dtype_name(t.dtype) for t in bucket.values()],
                    [list(t.shape) for t in bucket.values()],
                    version if b == len(parts) - 1 else None,
                    abort=b == 0,
                )
                replies = [ex.submit(self._admin, s, call) for s in servers]
                self._settle(servers, replies, functools.partial(current.broadcast, bucket), errors)
                if errors:
                    break
        finally:
            ex.shutdown(wait=False)
        if errors:
            raise errors[0]
        for s, f in zip(servers, replies, strict=True):
            self.backend.parse_update(f.result())
            self._confirm(s, version)

    def _settle(
        self,
        servers: list[_Server],
        replies: list[Future[object]],
        collective: Callable[[], object],
        errors: list[BaseException],
    ) -> None:
        """Run this side of a collective (on a thread) while the servers' HTTP calls run theirs.

        A failed call (a dead server, a refusal) or a failed collective ends the wait at once:
        the rest cannot complete without that member (its thread and the servers' handlers time
        out on their own). Failures go to ``errors``, dead servers are evicted, the group dropped."""
        failed: list[BaseException] = []

        def run() -> None:
            try:
                collective()
            except BaseException as e:  # noqa: BLE001 - reported through `failed`
                failed.append(e)

        thread = threading.Thread(target=run, name="relayrl-weight-broadcast", daemon=True)
        thread.start()
        owner = dict(zip(replies, servers, strict=True))
        pending = set(replies)
        while pending and not failed and not errors:
            done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
            for f in done:
                try:
                    f.result()
                except DEAD_ERRORS as e:
                    self._evict(owner[f], repr(e))
                    errors.append(ConnectionError(f"{owner[f].url} died during a weight broadcast"))
                except BaseException as e:  # noqa: BLE001 - collected, raised by the caller
                    errors.append(e)
        if not errors and not failed:
            thread.join()
        errors.extend(failed)
        if errors:
            self._group = None

    def _confirm(self, srv: _Server, version: int) -> None:
        path = srv.info.version_path if srv.info is not None else None
        if path is not None:
            got = self.backend.parse_version(self._admin(srv, Call("GET", path), timeout=30))
            if got != version:
                raise RuntimeError(f"{srv.url} reports weight version {got} after an update to {version}")
        srv.version = version

    def update_weights(self, update: WeightUpdate) -> None:
        with self._update_lock:
            weights = self._prepare(update)
            live = [s for s in self.servers if s.alive]
            if not live:
                raise ConnectionError("no live server to update")
            for s in self.servers:
                s.updating = True
            try:
                self._update_live(weights, update.version, live)
            finally:
                for s in self.servers:
                    s.updating = False
            if not any(s.alive and s.version == update.version for s in self.servers):
                raise ConnectionError(f"no server confirmed weight version {update.version}")
            self._version = update.version
            self._last_weights = weights

    def _update_live(
        self, weights: tuple[str, str | bytes | dict[str, torch.Tensor]], version: int, live: list[_Server]
    ) -> None:
        if weights[0] != "broadcast":
            self._fan_out(lambda s: self._push(s, weights, version), live)
            return
        try:
            self._broadcast(typing.cast(dict[str, torch.Tensor], weights[1]), version, live)
        except ConnectionError:  # a server died mid-way (evicted): the others get it through a new group
            live = [s for s in self.servers if s.alive]
            if not live:
                raise
            self._broadcast(typing.cast(dict[str, torch.Tensor], weights[1]), version, live)

    def _sync_mode(self) -> str:
        mode = self.config.weight_sync
        if mode == "auto":
            mode = "disk" if self.config.weight_sync_dir else "http"
        if mode == "disk" and not self.config.weight_sync_dir:
            raise ValueError(
                "inference.weight_sync=disk needs inference.weight_sync_dir (a directory all servers can read)"
            )
        if mode == "http" and not self.backend.supports_upload:
            raise ValueError(
                f"{self.backend.name} servers take no HTTP upload: set inference.weight_sync=disk and weight_sync_dir"
            )
        return mode

    def _prepare(self, update: WeightUpdate) -> tuple[str, str | bytes | dict[str, torch.Tensor]]:
        if update.kind == "disk":
            return ("disk", update.path)
        if update.kind == "adapter":
            if not self.accepts_adapters:
                raise ValueError("WeightUpdate(kind='adapter') needs model.lora.sync=adapter and SGLang / vLLM servers")
            return ("adapter", self._write_adapter(update))
        assert update.tensors is not None
        mode = self._sync_mode()
        if mode == "broadcast":
            return ("broadcast", {k: v.detach().contiguous() for k, v in sorted(update.tensors.items())})
        # clone: safetensors refuses tensors that share storage (tied embeddings)
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in update.tensors.items()}
        if mode == "http":
            return ("http", safetensors.torch.save(tensors))
        root = Path(self.config.weight_sync_dir)
        final = root / f"v{update.version:08d}"
        tmp = root / f".tmp-v{update.version:08d}-{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_file(tensors, str(tmp / "model.safetensors"))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in sorted(root.glob("v*"))[:-2]:  # keep the two newest versions
            shutil.rmtree(old, ignore_errors=True)
        return ("disk", str(final))
