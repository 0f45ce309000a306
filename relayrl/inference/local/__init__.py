"""LocalEngine: in-process continuous batching (running batch, decode and static steps, sampling,
vision prefill, devices)."""

from relayrl.inference.local.engine import LocalEngine

__all__ = ["LocalEngine"]
