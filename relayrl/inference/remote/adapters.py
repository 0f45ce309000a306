"""RemoteEngine's LoRA adapter sync (a ``WeightSync`` it holds): ``model.lora.sync=adapter``.

A LoRA trainer sends SGLang / vLLM servers its adapter instead of merged full weights
(``WeightUpdate(kind="adapter")``). The adapter is written as peft saves it to
``<inference.weight_sync_dir>/relayrl-<run>-v<version>``, every server loads it under that name (the
peer's ``load_adapter``) and requests to it name it; the adapter it replaces is unloaded.
Neither peer's load route takes a weight version, so the version is carried by the name: a
request's tokens are tagged with the version of the adapter it was sent with (the servers'
own ``weight_version`` stays that of their base weights). Version 0 (no update yet) is the
base model, which a fresh adapter (B = 0) computes too. ``<run>`` is drawn per engine: a second run
or a resume against the same servers and directory never meets an adapter of an earlier run under
its own name (vLLM and SGLang refuse a name they hold, and the earlier adapter would be served).
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import safetensors.torch

from relayrl.api.io import WeightUpdate
from relayrl.inference.remote.protocol import Call, Server, require_lora
from relayrl.inference.remote.weights import Fleet, PerServerSync, host_tensors, publish

if TYPE_CHECKING:
    from relayrl.api.config import InferenceConfig, LoraConfig
    from relayrl.inference.remote.peers import Peer

log = logging.getLogger(__name__)


def adapter_mode(lora: LoraConfig, config: InferenceConfig, peer: Peer) -> bool:
    """Whether this run sends adapters to ``peer``'s servers (``model.lora.sync``, resolved): checked at start-up."""
    if lora.rank <= 0 or lora.sync == "merged":
        return False
    shared = bool(config.weight_sync_dir)
    if lora.sync == "auto":
        return peer.loads_adapters and shared
    if not peer.loads_adapters:
        raise ValueError(
            f"model.lora.sync=adapter needs SGLang or vLLM servers (inference.protocol is "
            f"{peer.name}; relayrl servers take merged weights: model.lora.sync=merged)"
        )
    if not shared:
        raise ValueError(
            "model.lora.sync=adapter needs inference.weight_sync_dir (a directory the servers read adapters from)"
        )
    return True


def adapters_kept(lora: LoraConfig, servers: list[Server]) -> bool:
    """At connect: ``sync=auto`` keeps adapters only if every server says it loads them at run
    time (else merged weights, as before); ``sync=adapter`` refuses a server that does not."""
    if lora.sync == "auto" and not all(s.info is not None and s.info.lora for s in servers):
        log.info("model.lora.sync=auto: a server does not load LoRA adapters at run time; sending merged weights")
        return False
    for srv in servers:
        if srv.info is not None:
            require_lora(srv.info, srv.url, lora.rank)
    return True


class AdapterSync(PerServerSync):
    """``WeightUpdate(kind="adapter")``: the adapter as peft saves it, loaded by every server."""

    def __init__(self, fleet: Fleet, routes: Peer) -> None:
        super().__init__(fleet)
        self.routes = routes
        self.prefix = f"relayrl-{secrets.token_hex(4)}-v"  # this engine's adapters: <prefix><version>

    def prepare(self, update: WeightUpdate) -> object:
        """The adapter in ``weight_sync_dir/<prefix><version>`` (this engine's two newest up to it kept)."""
        tensors = host_tensors(update)

        def fill(d: Path) -> None:
            safetensors.torch.save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
            (d / "adapter_config.json").write_text(update.adapter_config)

        return publish(Path(self.fleet.config.weight_sync_dir), self.prefix, update.version, fill)

    def _call(self, srv: Server, call: Call) -> tuple[int, object]:
        return self.fleet.http.request(srv, call, self.fleet.config.request_timeout)

    def push(self, srv: Server, data: object, version: int) -> None:
        """Load the adapter at ``data`` on ``srv`` under its directory's name, then unload the one it replaces.
        A server that holds that name already (one that kept it across a restart of this engine's
        connection) unloads it and loads the directory again: what it serves is always this file."""
        path = str(data)
        name = Path(path).name
        call = self.routes.load_adapter(name, path)
        status, body = self._call(srv, call)
        if status == 404 and isinstance(body, dict) and body.get("detail") == "Not Found":
            flags = srv.info.lora_flags if srv.info is not None else "--enable-lora"
            raise RuntimeError(f"{srv.url} has no {call.path}: start it with {flags}")
        if status >= 400 and "already" in str(body):
            log.info("%s holds adapter %s already: reloading it from %s", srv.url, name, path)
            self._call(srv, self.routes.unload_adapter(name))
            status, body = self._call(srv, call)
        if status >= 400:
            raise RuntimeError(f"{srv.url}{call.path} refused adapter {name} ({status}): {str(body)[:500]}")
        self.routes.parse_adapter_load(name, body)
        previous, srv.adapter, srv.version = srv.adapter, name, version
        if previous and previous != name:
            unload = self.routes.unload_adapter(previous)
            try:
                status, body = self._call(srv, unload)
                if status >= 400:
                    log.warning("%s kept adapter %s: %s answered %d %s", srv.url, previous, unload.path, status, body)
            except httpx.HTTPError as e:
                log.warning("%s kept adapter %s: %r", srv.url, previous, e)
