"""Weight routes of ``relayrl serve`` (SGLang's protocol): disk reloads, collective broadcasts in
buckets, and relayrl's safetensors upload.

A broadcast update may come in buckets (SGLang-native trainers send bounded ones): tensors of a
bucket that does not complete the model are staged, and the model is loaded once the staged
tensors cover it (or the bucket carries ``weight_version``, the trainer's mark of the last one).
"""

from __future__ import annotations

import asyncio

import safetensors.torch
import torch
from fastapi import Request

from relayrl.api.commands import ServerConfig
from relayrl.api.io import WeightUpdate
from relayrl.inference.local.engine import LocalEngine
from relayrl.inference.server.common import _bad, _version, confine_file, confine_path
from relayrl.inference.server.schemas import DestroyWeightGroup, DiskUpdate, DistributedUpdate, InitWeightGroup
from relayrl.inference.weight_group import WeightBroadcastGroup, parse_dtype


class WeightRoutes:
    """Mixed into ``Server`` (which provides ``engine``, ``cfg``, ``reference``, ``weight_lock``, ``groups``)."""

    # what Server provides (declared for the type checker)
    engine: LocalEngine
    cfg: ServerConfig
    reference: dict[str, tuple[torch.Size, torch.dtype]]
    weight_lock: asyncio.Lock
    groups: dict[str, WeightBroadcastGroup]
    staged: dict[str, dict[str, torch.Tensor]]

    def check_weights(self, shapes: dict[str, tuple[int, ...]], partial: bool = False) -> None:
        """Every served parameter present (a tied lm_head may be left out; any may be, for one bucket
        of several: ``partial``), none unknown, shapes equal."""
        if not self.reference:
            return
        for name, shape in shapes.items():
            if name not in self.reference:
                raise _bad(f"weights: unknown parameter {name!r}")
            if tuple(shape) != tuple(self.reference[name][0]):
                raise _bad(f"weights: {name} has shape {tuple(shape)}, expected {tuple(self.reference[name][0])}")
        missing = sorted(set(self.reference) - set(shapes) - {"lm_head.weight"})
        if missing and not partial:
            raise _bad(f"weights: missing {len(missing)} parameters, e.g. {missing[:3]}")

    async def apply(self, tensors: dict[str, torch.Tensor], version: int | None) -> dict[str, object]:
        self.check_weights({name: tuple(t.shape) for name, t in tensors.items()})
        async with self.weight_lock:
            v = self.engine.get_version() + 1 if version is None else version
            update = WeightUpdate(kind="tensors", version=v, tensors=tensors)
            try:
                await asyncio.to_thread(self.engine.update_weights, update)
            except ValueError as e:  # e.g. missing parameters
                raise _bad(f"weights: {e}") from None
        return {
            "success": True,
            "message": f"loaded {len(tensors)} tensors",
            "weight_version": str(self.engine.get_version()),
            "num_paused_requests": 0,
        }

    async def update_from_disk(self, req: DiskUpdate) -> dict[str, object]:
        path = confine_path(req.model_path, self.cfg.allowed_weight_roots)
        # each file's real path too: a *.safetensors symlink inside the root may point out of it
        files = [confine_file(fp, self.cfg.allowed_weight_roots) for fp in sorted(path.glob("*.safetensors"))]
        if not files:
            raise _bad(f"model_path {req.model_path!r} holds no *.safetensors file")
        tensors: dict[str, torch.Tensor] = {}
        for fp in files:
            try:
                tensors.update(safetensors.torch.load_file(str(fp)))
            except (safetensors.SafetensorError, OSError, ValueError) as e:
                raise _bad(
                    f"model_path {req.model_path!r}: {fp.name} is not a readable safetensors file ({e})"
                ) from None
        return await self.apply(tensors, _version(req.weight_version))

    async def init_group(self, req: InitWeightGroup) -> dict[str, object]:
        """Join the trainer's weight group (blocks until every member joined; replaces a group of that name)."""
        self.groups.pop(req.group_name, None)
        self.staged.pop(req.group_name, None)
        try:
            self.groups[req.group_name] = await asyncio.to_thread(
                lambda: WeightBroadcastGroup(
                    req.master_address,
                    req.master_port,
                    req.world_size,
                    req.rank_offset,
                    req.backend,
                    req.group_name,
                    self.cfg.inference.request_timeout,
                ).join()
            )
        except (RuntimeError, ValueError, TypeError, OSError) as e:  # bad address, timeout, no CUDA for nccl
            raise _bad(
                f"could not join weight group {req.group_name!r} at {req.master_address}:{req.master_port}: {e}"
            ) from None
        return {"success": True, "message": f"joined {req.group_name!r} as rank {req.rank_offset} of {req.world_size}"}

    async def update_distributed(self, req: DistributedUpdate) -> dict[str, object]:
        """Receive ``names`` by broadcast from rank 0, then load them like any other update."""
        group = self.groups.get(req.group_name)
        if group is None:
            raise _bad(f"no weight group {req.group_name!r}: call /init_weights_update_group first")
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            raise _bad(
                f"names, dtypes and shapes differ in length ({len(req.names)}, {len(req.dtypes)}, {len(req.shapes)})"
            )
        self.check_weights({n: tuple(shape) for n, shape in zip(req.names, req.shapes, strict=True)}, partial=True)
        try:
            buffers = {
                n: torch.empty(shape, dtype=parse_dtype(d))
                for n, d, shape in zip(req.names, req.dtypes, req.shapes, strict=True)
            }
        except ValueError as e:
            raise _bad(f"dtypes: {e}") from None
        try:
            await asyncio.to_thread(group.broadcast, buffers)
        # a member died or timed out: this group is unusable (a newer one may have replaced it)
        except RuntimeError as e:
            if self.groups.get(req.group_name) is group:
                del self.groups[req.group_name]
            raise _bad(f"weight broadcast in {req.group_name!r} failed: {e}", 500) from None
        staged = self.staged.setdefault(req.group_name, {})
        staged.update(buffers)
        complete = not self.reference or not set(self.reference) - set(staged) - {"lm_head.weight"}
        if req.weight_version is None and not complete:
            return {
                "success": True,
                "message": f"staged {len(staged)} of {len(self.reference)} tensors",
                "num_paused_requests": 0,
            }
        del self.staged[req.group_name]
        return await self.apply(staged, _version(req.weight_version))

    async def destroy_group(self, req: DestroyWeightGroup) -> dict[str, object]:
        left = self.groups.pop(req.group_name, None) is not None
        return {"success": left, "message": f"{'left' if left else 'no weight group'} {req.group_name!r}"}

    async def upload(self, request: Request) -> dict[str, object]:
        limit = self.cfg.max_upload_mb << 20
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > limit:
            raise _bad(f"upload of {declared} bytes exceeds max_upload_mb={self.cfg.max_upload_mb}", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _bad(f"upload exceeds max_upload_mb={self.cfg.max_upload_mb}", 413)
            chunks.append(chunk)
        try:
            tensors = safetensors.torch.load(b"".join(chunks))
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise _bad(f"body is not a safetensors file: {e}") from None
        if not tensors:
            raise _bad("body holds no tensors")
        return await self.apply(tensors, _version(request.query_params.get("weight_version")))
