"""SGLang (>= 0.5): everything RemoteEngine knows of it.

- Detection: ``/get_server_info`` (``/server_info`` in newer releases) gives ``version`` and the
  server arguments (``tp_size``, ``enable_lora``, ``max_lora_rank``); the weight version is read
  from ``/get_weight_version`` (added mid-2025) or, where that route is gone, from
  ``/model_info``'s ``weight_version``; liveness is probed on the model-info route, which never
  generates (SGLang's ``/health`` runs a one-token generation and blocks while generation is
  paused or weights load).
- Requests: the native ``POST /generate`` with ``input_ids``, ``sampling_params`` and
  ``return_logprob``; the reply's ``meta_info`` holds ``output_token_logprobs`` as
  ``[logprob, token_id, text]`` triples, ``finish_reason`` ``{"type": ...}`` and
  ``weight_version``. Images go as ``image_data`` beside ``input_ids``. Batches: ``/generate``
  takes lists (``rid``, ``input_ids`` as a list of lists, one ``sampling_params`` per item) and
  answers a list of per-item replies.
- Weights: ``/update_weights_from_disk`` ``{"model_path", ...}`` (weight_sync=disk), or a
  broadcast over a process group of its own (``/init_weights_update_group``,
  ``/update_weights_from_distributed`` in buckets of ``weight_bucket_mb``; the group laid out as
  SGLang builds it: ``relayrl.inference.weight_group``). LoRA adapters (``model.lora.sync=adapter``):
  ``/load_lora_adapter`` and ``/unload_lora_adapter`` ``{"lora_name", "lora_path"}``, the adapter
  named per request in ``/generate``'s ``lora_path``.
- Launch (``inference.launch=sglang``): ``python -m sglang.launch_server`` (``server_command``,
  adapters: ``lora_flags``) with ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` (``/health``
  never generates).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import itertools
import json
import os
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import torch

from relayrl.api.io import GenerationConfig
from relayrl.inference.remote.launch import Launched, PeerServerGroup, gpu_env
from relayrl.inference.remote.protocol import (
    DEAD_ERRORS,
    AdminError,
    Call,
    Getter,
    JsonDict,
    Parsed,
    PeerInfo,
    ProtocolError,
    Render,
    Server,
    UnsupportedServer,
    first_page,
    int_or_none,
    sampling_fields,
    version_of,
    version_tuple,
)
from relayrl.inference.remote.weights import (
    BroadcastSync,
    DiskSync,
    Fleet,
    UploadSync,
    WeightSync,
    members,
    settle,
)
from relayrl.inference.weight_group import WeightBroadcastGroup, address_towards, buckets, dtype_name
from relayrl.utils.failsafe import fall_back, reason
from relayrl.utils.moe import decode_routed_experts, moe_layer_indices, routing_shape

if TYPE_CHECKING:
    from relayrl.api.config import InferenceConfig, LoraConfig, ModelConfig

MIN_SGLANG = (0, 5, 0)  # weight_version on weight updates, /pause_generation with modes, /get_server_info
WEIGHT_GROUP = "weight_update_group"  # SGLang's default group name
FLUSH_WAIT_S = 60  # /flush_cache?timeout: how long SGLang waits for requests it aborted to wind down


class SGLangBackend:
    """SGLang's native HTTP protocol."""

    name = "sglang"
    speaks: tuple[str, ...] = ("sglang",)  # the inference.protocol values its launched servers answer
    loads_adapters = True  # LoRA adapters at run time (model.lora.sync=adapter)
    supports_upload = False
    streams_items = False  # batched replies come as one list
    answers_while_loading = False  # /health may block during a weight load: not probed then
    return_routed_experts = False  # ask for the routed experts (inference.return_routed_experts)
    routing: tuple[int, list[int], int] | None = None  # (decoder layers, MoE layer indices, top_k) of the model

    def ask_routed_experts(self, model: ModelConfig) -> None:
        """inference.return_routed_experts: ask for them, read by ``model``'s layout (SGLang sends every
        decoder layer's, with no shape)."""
        self.return_routed_experts = True
        self.routing = routing_layout(model)

    def render(self, srv: Server, rid: str, input_ids: list[int], images: list[str]) -> Render | None:
        """Nothing to send before a prompt with images: SGLang takes the images beside ``input_ids``."""
        return None

    def generate(
        self,
        rid: str,
        input_ids: list[int],
        g: GenerationConfig,
        max_new: int,
        min_new: int,
        images: list[str] | None = None,
        adapter: str = "",
        features: JsonDict | None = None,
    ) -> Call:
        """``adapter``: the name of a loaded LoRA adapter to generate with (SGLang's ``lora_path``).
        ``features`` is vLLM's (rendered images); SGLang takes the images themselves."""
        body: JsonDict = {
            "rid": rid,
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": max_new, "min_new_tokens": min_new, **sampling_fields(g)},
            "return_logprob": True,
            "stream": False,
        }
        if self.return_routed_experts:
            body["return_routed_experts"] = True
        if images:  # SGLang's image_data: the prompt's images in order (data: URLs), pad tokens already expanded
            body["image_data"] = list(images)
        if adapter:
            body["lora_path"] = adapter
        return Call("POST", "/generate", body)

    def parse_generate(self, body: object) -> Parsed:
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
            raise ProtocolError(f"/generate reply lacks meta_info: {str(body)[:200]}")
        meta = body["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        tokens = body.get("output_ids")
        if tokens is None:
            tokens = [int(t[1]) for t in triples]
        if len(triples) != len(tokens):
            raise ProtocolError(f"{len(tokens)} output_ids but {len(triples)} output_token_logprobs")
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind not in ("stop", "length", "abort"):
            raise ProtocolError(f"unknown finish_reason {finish!r}")
        versions = meta.get("output_token_versions")
        return Parsed(
            tokens=[int(t) for t in tokens],
            logprobs=[float(t[0]) for t in triples],
            stop_reason=kind,
            versions=[int(v) for v in versions] if isinstance(versions, list) else None,
            weight_version=int_or_none(meta.get("weight_version")),
            routed_experts=self.routed_experts(meta),
        )

    def routed_experts(self, meta: dict[str, object]) -> torch.Tensor | None:
        """``meta_info.routed_experts`` as ``[tokens - 1, n_moe_layers, top_k]``: with its shape (relayrl
        serve), or, as SGLang sends it (0.5.23: base64 int32 over every decoder layer, no shape), reshaped
        by the served model's layout (``routing``) and cut to its MoE layers."""
        data, shape = meta.get("routed_experts"), meta.get("routed_experts_shape")
        if not isinstance(data, str):
            return None
        try:
            if isinstance(shape, list):
                return decode_routed_experts(data, shape)
            if self.routing is None:
                raise ValueError("no shape given and the model's MoE layout is unknown")
            n_layers, moe, top_k = self.routing
            n = len(base64.b64decode(data)) // 4
            if n % (n_layers * top_k):
                raise ValueError(f"{n} ids are not rows of {n_layers} layers x top-{top_k}")
            return decode_routed_experts(data, [n // (n_layers * top_k), n_layers, top_k])[:, moe].contiguous()
        except (ValueError, TypeError) as e:
            raise ProtocolError(f"/generate reply has malformed routed_experts: {e}") from None

    def batch(self, calls: list[Call]) -> list[tuple[Call, list[int]]]:
        """``generate`` calls merged into batched calls: (call, indices of the items it carries).
        One item keeps the single form."""
        if len(calls) == 1:
            return [(calls[0], [0])]
        bodies = [c.json or {} for c in calls]
        # per-item fields become lists (an item without one: [] images, None = the base adapter);
        # the others are the same in every item
        per_item: JsonDict = {
            "rid": None,
            "input_ids": None,
            "sampling_params": None,
            "image_data": [],
            "lora_path": None,
        }
        body = {k: v for k, v in bodies[0].items() if k not in per_item}
        for key, absent in per_item.items():
            if any(key in b for b in bodies):
                body[key] = [b.get(key, absent) for b in bodies]
        return [(Call("POST", "/generate", body), list(range(len(calls))))]

    def split(self, body: object, n: int) -> list[object]:
        """The per-item replies of a batched call's reply (each one for ``parse_generate``)."""
        if not isinstance(body, list) or len(body) != n:
            got = f"{len(body)} items" if isinstance(body, list) else type(body).__name__
            raise ProtocolError(f"batched /generate of {n} items answered {got}")
        return body

    def update_from_disk(self, path: str, version: int) -> Call:
        # abort_all_requests: in-flight requests end with finish_reason "abort" and the client
        # resubmits prompt + partial tokens under the new weights (interruptible rollout).
        body: JsonDict = {"model_path": path, "weight_version": str(version), "abort_all_requests": True}
        return Call("POST", "/update_weights_from_disk", body)

    def upload(self, version: int) -> Call:
        raise NotImplementedError(
            f"{self.name} servers take no safetensors upload; use inference.weight_sync=disk with a shared weight_sync_dir"
        )

    def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str) -> Call:
        body: JsonDict = {
            "master_address": host,
            "master_port": port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": WEIGHT_GROUP,
            "backend": backend,
        }
        return Call("POST", "/init_weights_update_group", body)

    def destroy_weight_group(self) -> Call:
        return Call("POST", "/destroy_weights_update_group", {"group_name": WEIGHT_GROUP})

    def update_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int | None, abort: bool = True
    ) -> Call:
        """One bucket of a broadcast update: the version goes with the last bucket only (the server
        reports it once every bucket is loaded), the abort of in-flight requests with the first."""
        body: JsonDict = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": WEIGHT_GROUP,
            "abort_all_requests": abort,
        }
        if version is not None:
            body["weight_version"] = str(version)
        return Call("POST", "/update_weights_from_distributed", body)

    def begin_update(self) -> Call:
        """SGLang >= 0.5.23 (its PR 28001) loads distributed weights only inside a weight-update session."""
        return Call("POST", "/begin_weight_update", {})

    def end_update(self) -> Call:
        return Call("POST", "/end_weight_update", {})

    def abort_items(self, call: Call, position: int) -> list[Call]:
        """Stop item ``position`` of a ``generate`` call (its rid) on the server: ``/abort_request {rid}``."""
        rid = (call.json or {}).get("rid")
        rid = rid[position] if isinstance(rid, list) else rid
        return [Call("POST", "/abort_request", {"rid": rid})] if isinstance(rid, str) else []

    def abort_all(self) -> Call:
        return Call("POST", "/abort_request", {"abort_all": True})

    def load_adapter(self, name: str, path: str) -> Call:
        """Load the peft adapter at ``path`` (read by the server) under ``name``."""
        return Call("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_adapter(self, name: str) -> Call:
        return Call("POST", "/unload_lora_adapter", {"lora_name": name})

    def parse_adapter_load(self, name: str, body: object) -> None:
        """SGLang answers ``{"success", "error_message", "loaded_adapters": {name: path}}``."""
        loaded = body.get("loaded_adapters") if isinstance(body, dict) else None
        if not isinstance(loaded, dict) or name not in loaded:
            raise ProtocolError(f"/load_lora_adapter of {name!r} answered without it in loaded_adapters: {body!r:.200}")

    def pause(self) -> Call:
        return Call("POST", "/pause_generation", {})

    def resume(self) -> Call:
        return Call("POST", "/continue_generation", {})

    def parse_version(self, body: object) -> int | None:
        return version_of(body)

    @staticmethod
    def parse_update(body: object) -> None:
        if isinstance(body, dict) and body.get("success") is False:
            raise RuntimeError(f"weight update refused: {body.get('message')}")

    # ------------------------------------------------------------------ detection, weights, launch
    def detect(self, url: str, get: Getter) -> PeerInfo:
        """What the server at ``url`` offers (``get``: GET path -> (status, JSON))."""
        return detect(url, get, self.name)

    def connected(self, fleet: Fleet) -> None:
        """Once every server is detected: nothing more to check."""

    def weight_sync(self, fleet: Fleet, mode: str) -> WeightSync:
        """The sync of weight_sync=``mode`` (disk, http, broadcast) with this peer's routes."""
        if mode == "broadcast":
            return SGLangBroadcast(fleet, self)
        if mode == "http":
            return UploadSync(fleet, self.upload, self)
        return SGLangDisk(fleet, self.update_from_disk, self)

    def launch(self, cfg: InferenceConfig, model: ModelConfig, lora: LoraConfig | None, token: str) -> Launched:
        """``inference.launch=sglang``: ``cfg.n_servers`` servers of ``model``, healthy."""
        return PeerServerGroup(self, cfg, model.path, lora=lora, dtype=model.dtype, token=token).start()

    def api_key(self, token: str, folder: Path) -> tuple[list[str], dict[str, str]]:
        """SGLang reads ``--api-key`` from a YAML ``--config`` file too: one readable by this user only."""
        path = folder / "sglang-key.yaml"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"api-key: {json.dumps(token)}\n")
        return ["--config", str(path)], {}

    def server_command(
        self, cfg: InferenceConfig, model: str, port: int, host: str = "127.0.0.1", lora: LoraConfig | None = None
    ) -> list[str]:
        """One launched server's command line (listening on ``host``: a Ray node's address under Ray;
        ``lora``: the adapters it will load, if any)."""
        prefix = (
            shlex.split(cfg.launch_command) if cfg.launch_command else [sys.executable, "-m", "sglang.launch_server"]
        )
        flags = ["--model-path", model, "--host", host, "--port", str(port), "--tp-size", str(cfg.launch_tp_size)]
        return [*prefix, *flags, *lora_flags(lora), *cfg.launch_args]

    def server_env(self, cfg: InferenceConfig, i: int, lora: LoraConfig | None = None) -> dict[str, str]:
        env = gpu_env(cfg, i)
        env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
        return env


def detect(url: str, get: Getter, protocol: str = "sglang") -> PeerInfo:
    """An SGLang server's version, ranks, served name and routes (``relayrl serve`` answers the same)."""
    need = ".".join(map(str, MIN_SGLANG))
    found = first_page(get, ("/get_server_info", "/server_info"))
    if found is None:
        raise UnsupportedServer(
            f"{url} answers neither /get_server_info nor /server_info: not an SGLang server, or "
            f"one older than {need} (relayrl needs SGLang >= {need}: pip install 'sglang>={need}')"
        )
    _, info = found
    version = str(info.get("version", ""))
    server = str(info.get("server", "sglang"))
    if server != "relayrl" and version_tuple(version) < MIN_SGLANG:
        raise UnsupportedServer(
            f"{url} runs SGLang {version or '(no version)'}; relayrl needs SGLang >= {need} "
            f"(weight_version on weight updates, /pause_generation modes): pip install 'sglang>={need}'"
        )
    weights = first_page(get, ("/get_weight_version", "/model_info", "/get_model_info"), "weight_version")
    live = first_page(get, ("/get_model_info", "/model_info"))
    return PeerInfo(
        protocol,
        version,
        int(str(info.get("tp_size", 1) or 1)),
        str(info.get("served_model_name") or "default"),
        weights[0] if weights else None,
        live[0] if live else "/health",
        server=server,
        lora=bool(info["enable_lora"]) if "enable_lora" in info else None,  # SGLang's server args
        max_lora_rank=int(str(info.get("max_lora_rank") or 0)),
    )


def routing_layout(model: ModelConfig) -> tuple[int, list[int], int] | None:
    """(decoder layers, MoE layer indices, top_k) of ``model``, built on the meta device from its config
    (None for a dense model): how SGLang's routed experts, given for every layer, map onto relayrl's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from relayrl.data.models import TINY_PRESETS, build_tiny_model

    with torch.device("meta"):
        if model.path in TINY_PRESETS:
            net = build_tiny_model(model.path)
        else:
            net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model.path))
    shape = routing_shape(net)
    if shape is None:
        return None
    return int(net.config.get_text_config().num_hidden_layers), moe_layer_indices(net), shape[1]


def lora_flags(lora: LoraConfig | None) -> list[str]:
    """The flags that let a server load the trainer's adapters at run time (none without LoRA): ``all``
    targets when model.lora.target_modules is empty (every linear projection, as relayrl's default); two
    adapters at once: the new one and the one it replaces, while requests sent with it finish."""
    if lora is None or lora.rank <= 0:
        return []
    targets = list(lora.target_modules) or ["all"]
    return ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *targets,
            "--max-loras-per-batch", "2"]  # fmt: skip


NCCL_GROUP = "NCCL weight group (inference.weight_sync=broadcast)"


def broadcast_backend(peer: str) -> str:
    """NCCL to GPU servers (SGLang); gloo without CUDA, and to relayrl servers (they run on CPU).
    The seam tests replace to put NCCL, which cannot start on CPU, in the way."""
    return "nccl" if torch.cuda.is_available() and peer != "relayrl" else "gloo"


def load_flushed(fleet: Fleet, srv: Server, call: Call) -> object:
    """``call`` (a weight load) to ``srv``, its reply checked. SGLang flushes its prefix cache after
    loading (KV of the old weights must not serve the continued requests) and fails the call, weights
    loaded, when requests it just aborted are still winding down; then the flush is waited for
    (``/flush_cache?timeout``, which answers plain text) and the load counts as done. The failed call
    left the version SGLang reports unchanged (0.5.23 tags new tokens with it, but ``/get_weight_version``
    still answers the old one), so it is set with ``/update_weight_version``."""
    try:
        reply = fleet.admin(srv, call)
        SGLangBackend.parse_update(reply)  # a 200 whose body says success=false
        return reply
    except RuntimeError as e:  # an AdminError or the refusal above: SGLang's text tells
        if "cache was not flushed" not in str(e):
            raise
    # SGLang waits up to FLUSH_WAIT_S for the flush; the call is given at least that (and 30 s to answer)
    wait = max(fleet.config.request_timeout, FLUSH_WAIT_S + 30)
    fleet.admin(srv, Call("POST", f"/flush_cache?timeout={FLUSH_WAIT_S}"), timeout=wait)
    version = (call.json or {}).get("weight_version")
    if version is not None:
        fleet.admin(srv, Call("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False}))
    return {"success": True, "message": "weights loaded; the cache flushed once the aborted requests ended"}


class SGLangDisk(DiskSync):
    """weight_sync=disk: ``/update_weights_from_disk`` through ``load_flushed``."""

    def push(self, srv: Server, data: object, version: int) -> None:
        load_flushed(self.fleet, srv, self.load(str(data), version))
        self.confirm(srv, version)


class SGLangBroadcast(BroadcastSync):
    """weight_sync=broadcast: every server receives the tensors from one collective broadcast, in
    buckets of ``weight_bucket_mb``, over SGLang's group routes (the group's layout: ``_join``). A server
    that fails mid-way is evicted (dead) or its error raised; either way the group is dropped. NCCL fails
    safe to gloo (``nccl_failed``)."""

    def __init__(self, fleet: Fleet, backend: SGLangBackend) -> None:
        super().__init__(fleet)
        self.backend = backend
        self.group: WeightBroadcastGroup | None = None
        self.members: list[tuple[str, int]] = []
        self.collective = broadcast_backend(backend.name)

    def nccl_failed(
        self, error: Exception, tensors: dict[str, torch.Tensor], version: int, servers: list[Server]
    ) -> None:
        """The group is built again over gloo (both sides told through SGLang's ``/init_weights_update_group``)
        and stays gloo, with one warning."""
        fall_back(NCCL_GROUP, reason(error), "gloo")
        self.collective, self.group = "gloo", None
        self._broadcast(tensors, version, servers)

    def _join(self, servers: list[Server], ex: ThreadPoolExecutor, errors: list[BaseException]) -> WeightBroadcastGroup:
        admin, sglang = self.fleet.admin, self.backend
        # members leave any group of that name first (this engine's old one, or one left by an earlier
        # trainer): SGLang refuses a second group of the same name
        for s in servers:  # (a server that never joined, or one too old for the route: then init fails, named)
            with contextlib.suppress(httpx.HTTPError, RuntimeError):
                admin(s, sglang.destroy_weight_group())
        self.group, self.members = None, []
        host = address_towards(httpx.URL(servers[0].url).host)
        backend = self.collective
        # a server of tensor-parallel size k takes ranks rank_offset .. rank_offset + k - 1 (SGLang: rank_offset + tp_rank)
        sizes = [s.info.tp_size if s.info is not None else 1 for s in servers]
        offsets = list(itertools.accumulate([1, *sizes[:-1]]))
        world = 1 + sum(sizes)
        group = WeightBroadcastGroup(host, 0, world, 0, backend, WEIGHT_GROUP, self.fleet.config.request_timeout)
        calls = [sglang.init_weight_group(host, group.port, off, world, backend) for off in offsets]
        joins = [ex.submit(admin, s, c) for s, c in zip(servers, calls, strict=True)]
        settle(self.fleet, servers, joins, group.join, errors)
        if errors:
            raise errors[0]
        for f in joins:  # {"success": false} is a refusal too (SGLang also answers it 400)
            sglang.parse_update(f.result())
        self.group, self.members = group, members(servers)
        return group

    def _begin(self, srv: Server) -> bool:
        """Open ``srv``'s weight-update session (SGLang >= 0.5.23); False where it has none (older SGLang,
        ``relayrl serve``). Its in-flight requests are aborted first: each holds the model lock the session
        takes (their partial tokens come back and continue under the new weights)."""
        admin = self.fleet.admin  # (each call within inference.request_timeout)
        admin(srv, self.backend.abort_all())
        try:
            admin(srv, self.backend.begin_update())
        except AdminError as e:
            if e.status == 404:
                return False
            if "already open" not in e.body:
                raise
            admin(srv, self.backend.end_update())  # left open by an update that failed mid-way
            admin(srv, self.backend.begin_update())
        return True

    def _end(self, srv: Server, quiet: bool) -> None:
        try:
            self.backend.parse_update(self.fleet.admin(srv, self.backend.end_update()))
        except (httpx.HTTPError, RuntimeError):
            if not quiet:  # after a failed update: the next one closes it (_begin)
                raise

    def _broadcast(self, tensors: dict[str, torch.Tensor], version: int, servers: list[Server]) -> None:
        errors: list[BaseException] = []
        ex = ThreadPoolExecutor(len(servers))  # not a `with`: on a failure, do not wait for calls left hanging
        try:
            group = self.group
            if group is None or self.members != members(servers):
                group = self._join(servers, ex, errors)
            sessions = []
            for s in servers:
                try:
                    if self._begin(s):
                        sessions.append(s)
                except DEAD_ERRORS as e:  # gone since the group was built: the others get a new group
                    self.fleet.evict(s, repr(e))
                    errors.append(ConnectionError(f"{s.url} died before a weight broadcast"))
                    raise errors[-1] from e
            names = list(tensors)
            limit = int(self.fleet.config.weight_bucket_mb * (1 << 20))
            parts = buckets([t.numel() * t.element_size() for t in tensors.values()], limit)
            for b, idx in enumerate(parts):  # one bounded bucket per call: the servers allocate one bucket at a time
                bucket = {names[i]: tensors[names[i]] for i in idx}
                call = self.backend.update_distributed(
                    list(bucket),
                    [dtype_name(t.dtype) for t in bucket.values()],
                    [list(t.shape) for t in bucket.values()],
                    version if b == len(parts) - 1 else None,
                    abort=b == 0,
                )
                replies = [ex.submit(load_flushed, self.fleet, s, call) for s in servers]
                settle(self.fleet, servers, replies, functools.partial(group.broadcast, bucket), errors)
                if errors:
                    break
            for s in sessions:  # the loaded weights take effect when the session closes
                self._end(s, quiet=bool(errors))
        finally:
            ex.shutdown(wait=False)
            if errors:
                self.group = None
        if errors:
            raise errors[0]
        for s in servers:  # (each reply was checked by load_flushed)
            self.confirm(s, version)
