"""The peers RemoteEngine speaks to, by ``inference.protocol``, and what each one provides (``Peer``):
adding a peer means adding its module, a class that satisfies ``Peer``, and its line in ``PEERS``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from relayrl.inference.remote.launch import LaunchablePeer, Launched
from relayrl.inference.remote.protocol import Call, Getter, JsonDict, Parsed, PeerInfo, Render, Server
from relayrl.inference.remote.relayrl import RelayrlBackend
from relayrl.inference.remote.sglang import SGLangBackend
from relayrl.inference.remote.vllm import VLLMBackend
from relayrl.inference.remote.weights import Fleet, Replies, WeightSync

if TYPE_CHECKING:
    from relayrl.api.config import InferenceConfig, LoraConfig, ModelConfig
    from relayrl.api.io import GenerationConfig


class Peer(LaunchablePeer, Replies, Protocol):
    """What a peer module's backend gives RemoteEngine: detection, the request mapping (one item's
    call, batching, replies, aborts), pause / resume, adapters, the weight syncs and launching its
    servers. It holds no connection: every method builds a ``Call`` or reads a reply."""

    speaks: tuple[str, ...]  # the inference.protocol values its launched servers answer
    loads_adapters: bool  # LoRA adapters at run time (model.lora.sync=adapter)
    supports_upload: bool  # weight_sync=http
    streams_items: bool  # a batched call's replies come one item at a time (else as one list)
    answers_while_loading: bool  # /health answers during a weight load (probed then)

    def detect(self, url: str, get: Getter) -> PeerInfo: ...

    def connected(self, fleet: Fleet) -> None: ...

    def ask_routed_experts(self, model: ModelConfig) -> None: ...

    def render(self, srv: Server, rid: str, input_ids: list[int], images: list[str]) -> Render | None: ...

    def generate(
        self,
        rid: str,
        input_ids: list[int],
        g: GenerationConfig,
        max_new: int,
        min_new: int,
        images: list[str] | None = ...,
        adapter: str = ...,
        features: JsonDict | None = ...,
    ) -> Call: ...

    def batch(self, calls: list[Call]) -> list[tuple[Call, list[int]]]: ...

    def split(self, body: object, n: int) -> list[object]: ...

    def parse_generate(self, body: object) -> Parsed: ...

    def abort_items(self, call: Call, position: int) -> list[Call]: ...

    def parse_version(self, body: object) -> int | None: ...

    def pause(self) -> Call: ...

    def resume(self) -> Call: ...

    def load_adapter(self, name: str, path: str) -> Call: ...

    def unload_adapter(self, name: str) -> Call: ...

    def parse_adapter_load(self, name: str, body: object) -> None: ...

    def weight_sync(self, fleet: Fleet, mode: str) -> WeightSync: ...

    def launch(self, cfg: InferenceConfig, model: ModelConfig, lora: LoraConfig | None, token: str) -> Launched: ...


PEERS: dict[str, type[Peer]] = {"relayrl": RelayrlBackend, "sglang": SGLangBackend, "vllm": VLLMBackend}


def make_backend(protocol: str) -> Peer:
    """The peer module's backend for ``protocol``: request mapping, detection, weight syncs, launch."""
    if protocol not in PEERS:
        raise ValueError(f"inference.protocol must be relayrl, sglang or vllm, got {protocol!r}")
    return PEERS[protocol]()
