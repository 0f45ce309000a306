"""LocalEngine's release/resume of device memory for a trainer sharing the GPU (a mixin).

``release_memory()`` frees the KV cache, and with ``weights=True`` moves the weights to host
memory; ``resume_memory()`` brings them back. Moving weights is a CUDA-only path, so it fails safe
(``relayrl.utils.failsafe``): a move off the device that raises leaves the weights in place for the
rest of the run (one warning), and the first resume checks the weights came back unchanged.
"""

from __future__ import annotations

import typing

import torch
from torch import nn

from relayrl.inference.local.state import EngineState
from relayrl.utils import failsafe

OFFLOAD = "moving weights off the device (release_memory(weights=True))"


def move_weights(model: nn.Module, device: torch.device) -> None:
    """Move ``model``'s weights to ``device``: the seam tests replace to force a failing move on CPU."""
    model.to(device)


def weights_fingerprint(model: nn.Module) -> torch.Tensor:
    """One float64 sum per parameter, on the host: equal before and after a faithful round trip."""
    return torch.stack([p.detach().double().sum() for p in model.parameters()]).cpu()


class MemoryRelease(EngineState):
    """``release_memory`` / ``resume_memory`` (mixed into ``LocalEngine``)."""

    _fingerprint: torch.Tensor | None = None  # the weights' sums before their first move off the device
    _weights_checked = False
    _offloaded = False

    def release_memory(self, weights: bool = False) -> None:
        """Free the KV cache (and with ``weights=True`` move the weights to host memory) so a
        trainer on the same GPU can use it; generation stops until ``resume_memory()``.
        Running requests are set aside and continue afterwards (their futures stay pending). Moving
        the weights fails safe (see the module docstring)."""

        def apply() -> None:
            self._preempt_all()
            self._released = True
            if self._static is not None:
                self._static.reset()
            if weights and OFFLOAD not in failsafe.FALLBACKS:
                self._offload()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

        self._call_in_loop(apply)

    def _offload(self) -> None:
        model = typing.cast(nn.Module, self.model)
        if self._fingerprint is None:  # first use: what the weights must look like when they come back
            self._fingerprint = weights_fingerprint(model)
        try:
            move_weights(model, torch.device("cpu"))
        except Exception as e:  # noqa: BLE001 - e.g. pinned host memory exhausted: keep the weights where they are
            move_weights(model, self.device)
            failsafe.fall_back(OFFLOAD, failsafe.reason(e), "keeping the weights on the device")
            return
        self._offloaded = True
        if self._fast is not None:
            self._fast.layers = []  # drop the fused copies too

    def resume_memory(self) -> None:
        """Undo ``release_memory()``: weights back on the device, generation continues."""

        def apply() -> None:
            assert self.model is not None
            if self._offloaded:
                self._offloaded = False
                move_weights(typing.cast(nn.Module, self.model), self.device)
                if self._fingerprint is not None and not self._weights_checked:
                    self._weights_checked = True
                    back = weights_fingerprint(typing.cast(nn.Module, self.model))
                    if not torch.equal(back, self._fingerprint):
                        raise RuntimeError(
                            f"{OFFLOAD}: the weights came back changed (release_memory(weights=True) on "
                            f"{self.device}); run `relayrl selftest` and report it; release_memory() without "
                            "weights=True keeps them in place"
                        )
                if self._fast is not None:
                    self._fast.refresh()
            self._released = False

        self._call_in_loop(apply)
        with self._wake:
            self._wake.notify_all()
