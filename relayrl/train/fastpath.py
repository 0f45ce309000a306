"""The training forward's CUDA-only fast paths, checked at first use (``relayrl.utils.failsafe``).

flash-attn's varlen kernel (``model.attn_impl`` auto/flash on CUDA) and bf16 autocast
(``train.bf16`` on CUDA) have never run on the CPU machines relayrl is tested on. The first
micro-batch therefore also runs the tested path (``relayrl_varlen`` attention, no autocast) and
each fast path alone, without gradients; a fast path that raises or lands farther from the tested
path than rounding explains is switched off for the rest of the run, with one warning. Under
torch.distributed the ranks agree (one failing rank switches it off everywhere).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel

from relayrl.train.packing import VARLEN_ATTN, register_varlen_attention
from relayrl.utils import dist as dist_utils
from relayrl.utils.failsafe import check, fall_back, reason

FLASH_VARLEN = "flash-attn varlen attention (model.attn_impl)"
BF16_AUTOCAST = "bf16 autocast (train.bf16)"


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager[None] | None:
    """bf16 autocast on CUDA, None elsewhere: the seam tests replace to force a failing autocast on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None


class CheckedForward:
    """Runs the model's forward on the fast paths that survived their first-use check."""

    def __init__(self, model: PreTrainedModel, bf16: bool, device: torch.device) -> None:
        self.model = model
        self.attn = str(model.config._attn_implementation)
        self.flash = self.attn not in (VARLEN_ATTN, "sdpa", "eager")  # flash-attn (or a stand-in for it)
        self.tested_attn = register_varlen_attention() if self.flash else self.attn
        self.bf16 = bf16 and autocast_for(device) is not None
        self.device = device
        self.checked = not (self.flash or self.bf16)

    def __call__(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``forward()``'s logits, under the fast paths in use (checked on the first call)."""
        if not self.checked:
            self._check(forward)
        with self._paths(self.flash, self.bf16):
            return forward()

    @contextlib.contextmanager
    def _paths(self, flash: bool, bf16: bool) -> Iterator[None]:
        attn = self.attn if flash else self.tested_attn
        if self.model.config._attn_implementation != attn:
            self.model.set_attn_implementation(attn)
        with (autocast_for(self.device) if bf16 else None) or contextlib.nullcontext():
            yield

    def _check(self, forward: Callable[[], torch.Tensor]) -> None:
        self.checked = True
        with torch.no_grad():
            with self._paths(False, False):
                ref = forward()
            dtype = next(self.model.parameters()).dtype
            for path, attr in ((FLASH_VARLEN, "flash"), (BF16_AUTOCAST, "bf16")):
                if not getattr(self, attr):
                    continue
                bf16 = attr == "bf16"
                try:
                    with self._paths(not bf16, bf16):
                        ok = check(path, forward(), ref, torch.bfloat16 if bf16 else dtype, "the tested path")
                except Exception as e:  # noqa: BLE001 - any failure of the fast path means: do not use it
                    fall_back(path, reason(e), "the tested path")
                    ok = False
                ok = bool(dist_utils.all_reduce(torch.tensor([float(ok)]), "min").item())  # passed on every rank
                setattr(self, attr, ok)
