"""RemoteEngine's LoRA adapter sync (mixed into ``RemoteEngine``): ``model.lora.sync=adapter``.

A LoRA trainer sends SGLang / vLLM servers its adapter instead of merged full weights
(``WeightUpdate(kind="adapter")``). The adapter is written as peft saves it to
``<inference.weight_sync_dir>/relayrl-v<version>`` and every server loads it under that name
(SGLang ``/load_lora_adapter``, vLLM ``/v1/load_lora_adapter``); from then on requests to the
server name it (SGLang ``lora_path``, vLLM ``model``), and the adapter it replaces is unloaded.
Neither peer's load route takes a weight version, so the version is carried by the name: a
request's tokens are tagged with the version of the adapter it was sent with (the servers'
own ``weight_version`` stays that of their base weights). Version 0 (no update yet) is the
base model, which a fresh adapter (B = 0) computes too.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import safetensors.torch

from relayrl.api.config import InferenceConfig, ModelConfig
from relayrl.api.io import WeightUpdate
from relayrl.inference.remote.protocol import require_lora
from relayrl.inference.remote.sglang import Backend

if TYPE_CHECKING:
    from relayrl.inference.remote.engine import _Server

log = logging.getLogger(__name__)

PREFIX = "relayrl-v"  # adapters are loaded as relayrl-v<version>


def adapter_name(version: int) -> str:
    return f"{PREFIX}{version}"


class AdapterSync:
    """Needs from ``RemoteEngine``: ``config``, ``model``, ``backend``, ``servers``, ``accepts_adapters``, ``_sync_client``."""

    # what RemoteEngine provides (declared for the type checker)
    config: InferenceConfig
    model: ModelConfig
    backend: Backend
    servers: list[_Server]
    accepts_adapters: bool
    _sync_client: Callable[[float], httpx.Client]

    def _adapter_mode(self) -> bool:
        """Whether this run sends adapters (``model.lora.sync``, resolved): checked at start-up."""
        lora = self.model.lora
        if lora.rank <= 0 or lora.sync == "merged":
            return False
        peer = self.backend.name in ("sglang", "vllm")
        shared = bool(self.config.weight_sync_dir)
        if lora.sync == "auto":
            return peer and shared
        if not peer:
            raise ValueError(
                f"model.lora.sync=adapter needs SGLang or vLLM servers (inference.protocol is "
                f"{self.backend.name}; relayrl servers take merged weights: model.lora.sync=merged)"
            )
        if not shared:
            raise ValueError(
                "model.lora.sync=adapter needs inference.weight_sync_dir (a directory the servers read adapters from)"
            )
        return True

    def _resolve_adapters(self) -> None:
        """At connect: ``sync=auto`` keeps adapters only if every server says it loads them at run
        time (else merged weights, as before); ``sync=adapter`` refuses a server that does not."""
        if not self.accepts_adapters:
            return
        lora = self.model.lora
        if lora.sync == "auto" and not all(s.info is not None and s.info.lora for s in self.servers):
            log.info("model.lora.sync=auto: a server does not load LoRA adapters at run time; sending merged weights")
            self.accepts_adapters = False
            return
        for srv in self.servers:
            if srv.info is not None:
                require_lora(srv.info, srv.url, lora.rank)

    def _write_adapter(self, update: WeightUpdate) -> str:
        """The adapter as peft saves it, in ``weight_sync_dir/relayrl-v<version>`` (the two newest kept)."""
        assert update.tensors is not None
        root = Path(self.config.weight_sync_dir)
        final = root / adapter_name(update.version)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in update.tensors.items()}
        safetensors.torch.save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(update.adapter_config)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        old = sorted(
            root.glob(f"{PREFIX}*"), key=lambda p: int(p.name[len(PREFIX) :]) if p.name[len(PREFIX) :].isdigit() else -1
        )
        for p in old[:-2]:
            shutil.rmtree(p, ignore_errors=True)
        return str(final)

    def _adapter_call(self, srv: _Server, method: str, path: str, body: dict[str, object]) -> tuple[int, object]:
        """(status, JSON body or text): vLLM's adapter routes answer plain text."""
        with self._sync_client(self.config.request_timeout) as c:
            r = c.request(method, srv.url + path, json=body)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def _load_adapter(self, srv: _Server, path: str, version: int) -> None:
        """Load the adapter at ``path`` on ``srv`` as ``relayrl-v<version>``, then unload the one it replaces."""
        name = Path(path).name
        call = self.backend.load_adapter(name, path)
        status, body = self._adapter_call(srv, call.method, call.path, call.json or {})
        if status == 404 and isinstance(body, dict) and body.get("detail") == "Not Found":
            raise RuntimeError(
                f"{srv.url} has no {call.path}: start vLLM with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
                if self.backend.name == "vllm"
                else f"{srv.url} has no {call.path}: an SGLang with runtime LoRA loading, run with --enable-lora"
            )
        if status >= 400 and "already" not in str(body):  # a returning server that kept it: loaded
            raise RuntimeError(f"{srv.url}{call.path} refused adapter {name} ({status}): {str(body)[:500]}")
        if status < 400:
            self.backend.parse_adapter_load(name, body)
        previous, srv.adapter, srv.version = srv.adapter, name, version
        if previous and previous != name:
            unload = self.backend.unload_adapter(previous)
            try:
                status, body = self._adapter_call(srv, unload.method, unload.path, unload.json or {})
                if status >= 400:
                    log.warning("%s kept adapter %s: %s answered %d %s", srv.url, previous, unload.path, status, body)
            except httpx.HTTPError as e:
                log.warning("%s kept adapter %s: %r", srv.url, previous, e)
