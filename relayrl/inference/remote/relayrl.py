"""relayrl's own server (``relayrl serve``) as a peer: SGLang's protocol (``sglang.SGLangBackend``,
detected the same way: it answers ``/get_server_info`` with ``"server": "relayrl"``) plus per-token
``output_token_versions``, an HTTP weight upload (``/update_weights_from_tensor``, a safetensors
body: weight_sync=http), batches answered item by item as they finish (``stream_items``: NDJSON
lines ``{"index": i, ...}``) and pause in place (in-flight requests are interrupted by the
update). Launch (``inference.launch=relayrl``): ``server.launcher.launch_servers`` with the
overrides that fit the run's model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relayrl.inference.remote.launch import Launched
from relayrl.inference.remote.protocol import Call
from relayrl.inference.remote.sglang import SGLangBackend
from relayrl.inference.server.launcher import launch_servers

if TYPE_CHECKING:
    from relayrl.api.config import InferenceConfig, LoraConfig, ModelConfig


class RelayrlBackend(SGLangBackend):
    """relayrl's server: SGLang's protocol, per-token versions, and an HTTP weight upload."""

    name = "relayrl"
    speaks: tuple[str, ...] = ("relayrl", "sglang", "vllm")  # `relayrl serve` answers every protocol
    loads_adapters = False  # relayrl servers take merged weights
    supports_upload = True
    streams_items = True  # batched replies come item by item as they finish (NDJSON)
    answers_while_loading = True  # /health answers during a weight load (updates run in a thread)

    def batch(self, calls: list[Call]) -> list[tuple[Call, list[int]]]:
        groups = super().batch(calls)
        for call, idx in groups:
            if len(idx) > 1 and call.json is not None:
                call.json["stream_items"] = True
        return groups

    def update_from_disk(self, path: str, version: int) -> Call:
        return Call("POST", "/update_weights_from_disk", {"model_path": path, "weight_version": version})

    def pause(self) -> Call:
        return Call("POST", "/pause_generation", {"mode": "in_place"})  # in-flight requests: interrupted by the update

    def upload(self, version: int) -> Call:
        return Call("POST", f"/update_weights_from_tensor?weight_version={version}")

    def launch(self, cfg: InferenceConfig, model: ModelConfig, lora: LoraConfig | None, token: str) -> Launched:
        """``inference.launch=relayrl``: ``cfg.n_servers`` ``relayrl serve`` processes fitted to the run."""
        return launch_servers(
            cfg.n_servers,
            model.path,
            cfg.server_threads,
            serve_overrides(cfg, model),
            admin_token=token,
            startup_timeout=cfg.launch_timeout,
        )


def serve_overrides(inf: InferenceConfig, model: ModelConfig) -> list[str]:
    """ServerConfig overrides that make a launched server fit the run: the policy's model
    (vocabulary, dtype, tokenizer) and the weight directory it may read."""
    roots = [inf.weight_sync_dir] if inf.weight_sync_dir else []
    out = [f"model.path={model.path}", f"model.vocab_size={model.vocab_size}", f"model.dtype={model.dtype}"]
    out += [f"model.tokenizer_path={model.tokenizer_path}"] if model.tokenizer_path else []
    return [*out, f"allowed_weight_roots={roots}", f"torch_threads={inf.server_threads}"]
