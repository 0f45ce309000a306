"""RemoteEngine: generation on HTTP servers, one module per peer (``sglang``, ``vllm``, ``relayrl``)."""

from relayrl.inference.remote.engine import RemoteEngine

__all__ = ["RemoteEngine"]
