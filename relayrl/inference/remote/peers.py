"""The peers RemoteEngine speaks to, by ``inference.protocol``: adding a peer means adding its module
and its line here."""

from __future__ import annotations

from relayrl.inference.remote.relayrl import RelayrlBackend
from relayrl.inference.remote.sglang import SGLangBackend
from relayrl.inference.remote.vllm import VLLMBackend

Backend = SGLangBackend | VLLMBackend  # (RelayrlBackend is an SGLangBackend)


def make_backend(protocol: str) -> Backend:
    """The peer module's backend for ``protocol``: request mapping, detection, weight syncs, launch."""
    if protocol == "relayrl":
        return RelayrlBackend()
    if protocol == "sglang":
        return SGLangBackend()
    if protocol == "vllm":
        return VLLMBackend()
    raise ValueError(f"inference.protocol must be relayrl, sglang or vllm, got {protocol!r}")
