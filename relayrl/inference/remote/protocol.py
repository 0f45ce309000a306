"""What a server offers, found out when RemoteEngine connects: version, routes, served model.

SGLang and vLLM move and add routes between versions; RemoteEngine asks each server once and
uses the routes it has, and refuses at start-up (naming what is missing and the version or
flag that provides it) where a server cannot do what the run needs.

- SGLang: ``/get_server_info`` (``/server_info`` in newer releases) gives ``version`` and the
  server arguments (``tp_size``); the weight version is read from ``/get_weight_version``
  (added mid-2025) or, where that route is gone, from ``/model_info``'s ``weight_version``;
  liveness is probed on the model-info route, which never generates (SGLang's ``/health``
  runs a one-token generation and blocks while generation is paused or weights load).
- vLLM: ``/version``; the served model name from ``/v1/models`` (vLLM answers 404 for any
  other name); the routes from ``/openapi.json``: the RL router (``/pause``, ``/resume``, the
  weight-transfer routes ``/init_weight_transfer_engine`` and ``/update_weights``; later also
  ``/start_weight_update``, ``/finish_weight_update`` and ``/weight_info``, which reports the
  weight version) is attached only with ``VLLM_SERVER_DEV_MODE=1``, as is ``/collective_rpc``
  (the reload fallback for a vLLM without the transfer API); ``/get_world_size`` gives the
  ranks a server's workers take in a transfer group.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass, field

Getter = Callable[[str], tuple[int, object]]  # GET path -> (status, JSON body or None)

MIN_SGLANG = (0, 5, 0)  # weight_version on weight updates, /pause_generation with modes, /get_server_info


class UnsupportedServer(RuntimeError):
    """A server that lacks what this run needs (the message says what, and what provides it)."""


@dataclass
class PeerInfo:
    protocol: str
    version: str = ""
    tp_size: int = 1  # weight-group ranks this server takes (SGLang: rank_offset + tp_rank)
    model: str = "default"  # the served model name (vLLM refuses any other)
    version_path: str | None = None  # GET route whose JSON has "weight_version"; None: the server reports none
    live_path: str = "/health"  # a liveness route that never generates
    routes: set[str] = field(default_factory=set)  # published routes (vLLM's openapi.json), else empty
    disk_transfer: bool = False  # vLLM: disk updates through its weight-transfer API (else /collective_rpc)
    server: str = ""  # "relayrl" for `relayrl serve` (it speaks both protocols), else the peer's own
    lora: bool | None = None  # loads LoRA adapters at run time (None: the server does not say)
    max_lora_rank: int = 0  # the largest adapter rank it takes (0: not reported)


def version_tuple(v: str) -> tuple[int, ...]:
    """``"0.5.3.post1"`` -> ``(0, 5, 3)``; unparsable parts end the tuple."""
    out = []
    for part in v.split(".")[:3]:
        digits = part[: len(part) - len(part.lstrip("0123456789"))]  # the leading digits ("10rc1" -> "10")
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _first(get: Getter, paths: tuple[str, ...]) -> tuple[str, dict[str, object]] | None:
    for p in paths:
        status, body = get(p)
        if status == 200 and isinstance(body, dict):
            return p, body
    return None


def detect_sglang(url: str, get: Getter, protocol: str = "sglang") -> PeerInfo:
    found = _first(get, ("/get_server_info", "/server_info"))
    if found is None:
        raise UnsupportedServer(
            f"{url} answers neither /get_server_info nor /server_info: not an SGLang server, or "
            f"one older than {'.'.join(map(str, MIN_SGLANG))} (relayrl needs SGLang >= "
            f"{'.'.join(map(str, MIN_SGLANG))}: pip install 'sglang>={'.'.join(map(str, MIN_SGLANG))}')"
        )
    _, info = found
    version = str(info.get("version", ""))
    server = str(info.get("server", "sglang"))
    if server != "relayrl" and version_tuple(version) < MIN_SGLANG:
        need = ".".join(map(str, MIN_SGLANG))
        raise UnsupportedServer(
            f"{url} runs SGLang {version or '(no version)'}; relayrl needs SGLang >= {need} "
            f"(weight_version on weight updates, /pause_generation modes): pip install 'sglang>={need}'"
        )
    tp = int(typing.cast(int, info.get("tp_size", 1) or 1))
    version_path = None
    for p in ("/get_weight_version", "/model_info", "/get_model_info"):
        status, body = get(p)
        if status == 200 and isinstance(body, dict) and "weight_version" in body:
            version_path = p
            break
    live = _first(get, ("/get_model_info", "/model_info"))
    return PeerInfo(
        protocol,
        version,
        tp,
        str(info.get("served_model_name") or "default"),
        version_path,
        live[0] if live else "/health",
        server=server,
        lora=bool(info["enable_lora"]) if "enable_lora" in info else None,  # SGLang's server args
        max_lora_rank=int(typing.cast(int, info.get("max_lora_rank") or 0)),
    )


def detect_vllm(url: str, get: Getter) -> PeerInfo:
    status, body = get("/version")
    if status != 200 or not isinstance(body, dict):
        raise UnsupportedServer(f"{url} answers no /version ({status}): not a vLLM OpenAI server (`vllm serve`)")
    status, models = get("/v1/models")
    data = models.get("data") if isinstance(models, dict) else None
    if status != 200 or not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise UnsupportedServer(f"{url}/v1/models lists no served model ({status}); relayrl sends the served name")
    status, spec = get("/openapi.json")
    paths = spec.get("paths") if isinstance(spec, dict) else None
    routes = set(paths) if isinstance(paths, dict) else set()
    ranks = 1
    if "/get_world_size" in routes:  # the server's workers (TP x PP x DP), each a rank of the transfer group
        status, size = get("/get_world_size")
        ranks = int(size.get("world_size", 1)) if status == 200 and isinstance(size, dict) else 1
    return PeerInfo(
        "vllm",
        str(body.get("version", "")),
        ranks,
        str(data[0]["id"]),
        "/weight_info" if "/weight_info" in routes else None,
        "/health",
        routes,
        server=str(body.get("server", "vllm")),  # by name: disk_transfer comes first
        # the runtime adapter routes exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
        lora=LORA_ROUTE in routes if routes else None,
    )


def detect(protocol: str, url: str, get: Getter) -> PeerInfo:
    if protocol == "vllm":
        return detect_vllm(url, get)
    return detect_sglang(url, get, protocol)


TRANSFER = "/init_weight_transfer_engine"
LORA_ROUTE = "/v1/load_lora_adapter"


def require_lora(info: PeerInfo, url: str, rank: int) -> None:
    """Start-up check that ``url`` loads LoRA adapters of ``rank`` at run time (model.lora.sync=adapter)."""
    if info.lora is False:
        need = (
            "--enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment"
            if info.protocol == "vllm"
            else "--enable-lora --max-lora-rank R"
        )
        raise UnsupportedServer(
            f"{url} does not load LoRA adapters at run time, which model.lora.sync=adapter needs: start it with "
            f"{need} (R >= model.lora.rank={rank}), or set model.lora.sync=merged"
        )
    if info.max_lora_rank and rank > info.max_lora_rank:
        raise UnsupportedServer(
            f"{url} takes LoRA adapters up to rank {info.max_lora_rank} (--max-lora-rank) but model.lora.rank={rank}"
        )


RL_ROUTER = "VLLM_SERVER_DEV_MODE=1: vLLM attaches its RL router only in dev mode"


def require_routes(info: PeerInfo, url: str, sync: str) -> None:
    """Start-up check that ``url`` has the routes weight_sync=``sync`` needs (vLLM)."""
    if info.protocol != "vllm" or not info.routes or info.server == "relayrl":
        return
    missing = [] if "/pause" in info.routes else [f"/pause ({RL_ROUTER})"]
    if sync == "broadcast" and not {TRANSFER, "/update_weights"} <= info.routes:
        missing.append(
            f"{TRANSFER} and /update_weights (vLLM's weight-transfer API: a vLLM that has it, run with "
            f"--weight-transfer-backend nccl and {RL_ROUTER})"
        )
    if sync == "disk" and "/start_weight_update" not in info.routes and "/collective_rpc" not in info.routes:
        missing.append(
            f"/collective_rpc ({RL_ROUTER}; for reload_weights) or vLLM's disk weight transfer "
            "(--weight-transfer-backend disk, a vLLM with /start_weight_update)"
        )
    if missing:
        raise UnsupportedServer(
            f"{url} (vLLM {info.version}) lacks {', '.join(missing)}, which weight_sync={sync} needs"
        )


IMAGE_ROUTES = ("/v1/chat/completions/render", "/inference/v1/generate")


def require_image_routes(info: PeerInfo | None, url: str) -> None:
    """A request with images to a vLLM server needs its render and token-in generate routes."""
    if info is None or info.protocol != "vllm" or not info.routes:
        return
    missing = [r for r in IMAGE_ROUTES if r not in info.routes]
    if missing:
        raise UnsupportedServer(
            f"{url} (vLLM {info.version}) lacks {', '.join(missing)}, which requests with images need "
            "(vLLM's render + token-in generate; /v1/completions takes no images with token ids)"
        )
