"""What every peer module shares: an HTTP call, a parsed generate reply, what a server offers
(``PeerInfo``, read at connect by the peer's ``detect``) and the errors that name what is wrong.

SGLang and vLLM move and add routes between versions: RemoteEngine asks each server once which it
has, and refuses at start-up one that lacks what the run needs (``UnsupportedServer``).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import torch

from relayrl.api.io import GenerationConfig, StopReason

JsonDict = dict[str, object]
Getter = Callable[[str], tuple[int, object]]  # GET path -> (status, JSON body, or its text)

# Errors after which a server is presumed dead (refused, reset, closed mid-reply).
DEAD_ERRORS = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.ConnectTimeout)


class ProtocolError(ValueError):
    """A server reply that does not have the documented shape."""


class ServerError(RuntimeError):
    """A server answered 5xx (retried elsewhere)."""


class AdminError(RuntimeError):
    """An admin call answered 4xx / 5xx: ``status`` and the start of the reply's ``body``."""

    def __init__(self, where: str, status: int, body: str) -> None:
        super().__init__(f"{where} answered {status}: {body}")
        self.status, self.body = status, body


class UnsupportedServer(RuntimeError):
    """A server that lacks what this run needs (the message says what, and what provides it)."""


@dataclass
class Parsed:
    """One generate reply, protocol-independent."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    versions: list[int] | None = None  # per-token versions when the server reports them
    weight_version: int | None = None  # the server's version when it answered
    routed_experts: torch.Tensor | None = None  # MoE: [input + output - 1, layers, top_k] when asked and given

    def __post_init__(self) -> None:
        """A server's numbers are checked before they reach a trajectory (a broken or hostile peer)."""
        bad = next((i for i, t in enumerate(self.tokens) if not 0 <= t < 1 << 31), None)
        if bad is not None:
            raise ProtocolError(f"reply token {bad} is {self.tokens[bad]}: not a token id")
        bad = next((i for i, x in enumerate(self.logprobs) if not (math.isfinite(x) and x <= 1e-4)), None)
        if bad is not None:
            raise ProtocolError(f"reply logprob {bad} is {self.logprobs[bad]}: logprobs are finite and <= 0")


@dataclass
class Call:
    """An HTTP call: method, path (with query), JSON body."""

    method: str
    path: str
    json: JsonDict | None = None


@dataclass
class Render:
    """A call sent before a prompt with images is generated (vLLM renders them first), and what makes its
    reply the ``features`` the peer's ``generate`` takes."""

    call: Call
    features: Callable[[object], JsonDict]


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
    lora_flags: str = "--enable-lora --max-lora-rank R"  # how this peer is started to load adapters


@dataclass
class Server:
    """One server RemoteEngine sends to, and what it knows of it."""

    url: str
    alive: bool = True
    in_flight: int = 0
    version: int = 0
    info: PeerInfo | None = None  # what it offers, read at connect
    updating: bool = False  # a weight update is under way (no health probes: SGLang's block then)
    adapter: str = ""  # the LoRA adapter requests name (model.lora.sync=adapter); "" = the base weights
    evictions: int = 0  # times evicted: a weight group with it in is rebuilt once it was


def version_tuple(v: str) -> tuple[int, ...]:
    """``"0.5.3.post1"`` -> ``(0, 5, 3)``; unparsable parts end the tuple."""
    out = []
    for part in v.split(".")[:3]:
        digits = part[: len(part) - len(part.lstrip("0123456789"))]  # the leading digits ("10rc1" -> "10")
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def first_page(get: Getter, paths: tuple[str, ...], key: str = "") -> tuple[str, dict[str, object]] | None:
    """The first of ``paths`` that answers 200 with a JSON object (holding ``key``, if given): (path, body)."""
    for p in paths:
        status, body = get(p)
        if status == 200 and isinstance(body, dict) and (not key or key in body):
            return p, body
    return None


def require_lora(info: PeerInfo, url: str, rank: int) -> None:
    """Start-up check that ``url`` loads LoRA adapters of ``rank`` at run time (model.lora.sync=adapter)."""
    if info.lora is False:
        raise UnsupportedServer(
            f"{url} does not load LoRA adapters at run time, which model.lora.sync=adapter needs: start it with "
            f"{info.lora_flags} (R >= model.lora.rank={rank}), or set model.lora.sync=merged"
        )
    if info.max_lora_rank and rank > info.max_lora_rank:
        raise UnsupportedServer(
            f"{url} takes LoRA adapters up to rank {info.max_lora_rank} (--max-lora-rank) but model.lora.rank={rank}"
        )


def wire_image(image: str | bytes) -> str:
    """An image of ``ModelRequest.image_data`` as JSON text: encoded bytes become a base64 ``data:`` URL
    (SGLang, vLLM and relayrl all read those); text (a data: URL, base64, a server-side path) is sent as is."""
    if isinstance(image, str):
        return image
    kind = "png" if image[:4] == b"\x89PNG" else "jpeg" if image[:2] == b"\xff\xd8" else "octet-stream"
    mime = f"image/{kind}" if kind != "octet-stream" else "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(bytes(image)).decode()}"


def int_or_none(v: object) -> int | None:
    try:
        return int(v) if isinstance(v, (int, float, str)) else None
    except ValueError:  # text that is no number (SGLang's "default" version)
        return None


def sampling_fields(g: GenerationConfig) -> JsonDict:
    """The sampling parameters SGLang and vLLM name alike; OpenAI's penalties only when set."""
    return {
        "temperature": 0.0 if g.greedy else g.temperature,
        "top_p": g.top_p,
        "top_k": -1 if g.top_k == 0 else g.top_k,  # -1 = off
        "stop": list(g.stop),
        "stop_token_ids": list(g.stop_token_ids),
        "ignore_eos": g.ignore_eos,
        "skip_special_tokens": False,
        **{k: getattr(g, k) for k in ("frequency_penalty", "presence_penalty") if getattr(g, k)},
    }


def version_of(body: object) -> int | None:
    """The ``weight_version`` of a version route's reply (SGLang's and vLLM's field)."""
    return int_or_none(body.get("weight_version")) if isinstance(body, dict) else None
