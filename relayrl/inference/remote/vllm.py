"""RemoteEngine's weight sync with vLLM (mixed into ``RemoteEngine`` through ``WeightSync``).

vLLM's own RL route is its weight-transfer API (``vllm serve --weight-transfer-backend nccl|disk``,
RL router under ``VLLM_SERVER_DEV_MODE=1``): every update pauses the servers with ``mode=abort``
(in-flight requests end as ``abort`` with the tokens generated so far, which keep the old
version, and are continued afterwards), opens a session where the server has one
(``/start_weight_update``), sends ``/update_weights``, closes it with the version
(``/finish_weight_update``, reported back by ``/weight_info``) and resumes.

- broadcast: the group of ``vllm_transfer.VLLMTransferGroup`` (this process rank 0, each server's
  workers the ranks from its ``rank_offset``), built on first use and rebuilt when its members
  change (vLLM replaces a server's group on a new init; there is no destroy route); all tensors
  go in one ``/update_weights`` call, in packed buffers of ``weight_bucket_mb``.
- disk: ``{"path"}`` to the disk backend; on a vLLM without it (checked at connect: the init call
  fails, or the routes are older), the dev-mode ``/collective_rpc reload_weights`` fallback.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx
import torch

from relayrl.inference.remote.protocol import UnsupportedServer
from relayrl.inference.remote.sglang import VLLMBackend
from relayrl.inference.remote.vllm_transfer import VLLMTransferGroup
from relayrl.inference.remote.weights import WeightSync
from relayrl.inference.weight_group import address_towards, dtype_name

if TYPE_CHECKING:
    from relayrl.inference.remote.engine import _Server

log = logging.getLogger(__name__)


class VLLMWeightSync(WeightSync):
    """``WeightSync`` with vLLM's routes for vLLM servers (the rest as ``WeightSync`` does it)."""

    @property
    def _vllm(self) -> VLLMBackend:
        assert isinstance(self.backend, VLLMBackend)
        return self.backend

    def _push(self, srv: _Server, weights: tuple[str, str | bytes | dict[str, torch.Tensor]], version: int) -> None:
        if weights[0] == "disk" and isinstance(self.backend, VLLMBackend):
            self._vllm_disk(srv, str(weights[1]), version)
            return
        super()._push(srv, weights, version)

    def _broadcast(self, tensors: dict[str, torch.Tensor], version: int, servers: list[_Server]) -> None:
        if isinstance(self.backend, VLLMBackend):
            self._vllm_broadcast(tensors, version, servers)
            return
        super()._broadcast(tensors, version, servers)

    def _vllm_prepare(self, srv: _Server, sync: str) -> None:
        """At connect (and re-admission): pick the disk route this server offers."""
        info = srv.info
        if info is None or info.protocol != "vllm" or sync != "disk" or info.server == "relayrl":
            return
        if "/start_weight_update" not in info.routes or "/init_weight_transfer_engine" not in info.routes:
            info.disk_transfer = False  # a vLLM before the disk backend: /collective_rpc (require_routes checked it)
            return
        try:
            self._admin(srv, self._vllm.init_disk_transfer(), timeout=30)
            info.disk_transfer = True
        except RuntimeError as e:
            if "/collective_rpc" not in info.routes:
                raise UnsupportedServer(
                    f"{srv.url} refused vLLM's disk weight transfer ({e}): start it with --weight-transfer-backend disk"
                ) from e
            log.warning("%s has no disk weight-transfer backend; reloading through /collective_rpc", srv.url)
            info.disk_transfer = False

    def _paused_for_update(self, servers: list[_Server], update: Callable[[], None]) -> None:
        """Pause ``servers`` (abort mode) unless the engine is paused, run ``update()``, resume them."""
        paused = [] if self._paused else list(servers)
        if paused:
            self._fan_out(lambda s: self._admin(s, self.backend.pause()), paused)
        try:
            update()
        finally:
            for s in paused:
                try:
                    self._admin(s, self.backend.resume(), timeout=30)
                except (httpx.HTTPError, RuntimeError) as e:
                    log.warning("%s did not resume after a weight update: %s", s.url, e)

    def _vllm_disk(self, srv: _Server, path: str, version: int) -> None:
        path = os.path.abspath(path)  # the disk backend takes absolute directories only

        def load() -> None:
            if srv.info is not None and srv.info.disk_transfer:
                self._admin(srv, self._vllm.start_update())
                self._admin(srv, self._vllm.disk_update(path))
                self._admin(srv, self._vllm.finish_update(version))
            else:
                self.backend.parse_update(self._admin(srv, self.backend.update_from_disk(path, version)))
                if srv.info is not None and "/update_weight_version" in srv.info.routes:  # /weight_info then reports it
                    self._admin(srv, self._vllm.set_version(version))

        self._paused_for_update([srv], load)
        self._confirm(srv, version)

    def _vllm_broadcast(self, tensors: dict[str, torch.Tensor], version: int, servers: list[_Server]) -> None:
        members = [s.url for s in servers]
        errors: list[BaseException] = []
        ex = ThreadPoolExecutor(len(servers))  # not a `with`: on a failure, do not wait for calls left hanging
        try:
            if self._group is None or self._group_members != members or self._group_stale:
                self._group, self._group_members, self._group_stale = None, [], False
                host = address_towards(httpx.URL(servers[0].url).host)
                backend = "nccl" if torch.cuda.is_available() else "gloo"
                sizes = [s.info.tp_size if s.info is not None else 1 for s in servers]
                offsets = list(itertools.accumulate([1, *sizes[:-1]]))
                group = VLLMTransferGroup(host, 0, 1 + sum(sizes), backend, self.config.request_timeout)
                calls = [self._vllm.init_transfer(host, group.port, off, 1 + sum(sizes)) for off in offsets]
                joins = [ex.submit(self._admin, s, c) for s, c in zip(servers, calls, strict=True)]
                self._settle(servers, joins, group.join, errors)
                if errors:
                    raise errors[0]
                self._group, self._group_members = group, members
            current = self._group
            assert isinstance(current, VLLMTransferGroup)
            limit = int(self.config.weight_bucket_mb * (1 << 20))
            call = self._vllm.transfer_update(
                list(tensors),
                [dtype_name(t.dtype) for t in tensors.values()],
                [list(t.shape) for t in tensors.values()],
                limit,
            )
            sessions = [s for s in servers if s.info is not None and "/start_weight_update" in s.info.routes]

            def send() -> None:
                for s in sessions:
                    self._admin(s, self._vllm.start_update())
                replies = [ex.submit(self._admin, s, call) for s in servers]
                self._settle(servers, replies, lambda: current.send(tensors, True, limit), errors)
                if errors:
                    raise errors[0]
                for s in sessions:
                    self._admin(s, self._vllm.finish_update(version))

            self._paused_for_update(servers, send)
        finally:
            ex.shutdown(wait=False)
        for s in servers:
            self._confirm(s, version)
