"""The peers RemoteEngine speaks to, by ``inference.protocol``: adding a peer means adding its module,
a backend class with the methods the others have (mypy checks every use against each), and its line here.
A backend holds no connection: every method builds a ``Call`` or reads a reply."""

from __future__ import annotations

from relayrl.inference.remote.relayrl import RelayrlBackend
from relayrl.inference.remote.sglang import SGLangBackend
from relayrl.inference.remote.vllm import VLLMBackend

Peer = SGLangBackend | VLLMBackend  # (RelayrlBackend is an SGLangBackend)
PEERS: dict[str, type[Peer]] = {"relayrl": RelayrlBackend, "sglang": SGLangBackend, "vllm": VLLMBackend}


def make_backend(protocol: str) -> Peer:
    """The peer module's backend for ``protocol``: request mapping, detection, weight syncs, launch."""
    if protocol not in PEERS:
        raise ValueError(f"inference.protocol must be relayrl, sglang or vllm, got {protocol!r}")
    return PEERS[protocol]()
