"""Reading relayrl's own ``torch.save`` files (training state, RNG states, doctor records) without pickle.

``torch.load(weights_only=True)`` accepts tensors, numbers, strings and containers only: a
tampered run directory cannot run code on ``--recover`` or ``relayrl doctor``. Anything else is a
ValueError naming the file.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from relayrl.utils.failsafe import reason


def load_state_file(path: str | Path) -> Any:
    """The contents of ``path`` (a relayrl ``torch.save`` file), loaded without running pickled code."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path} holds objects other than tensors, numbers and containers; refusing to unpickle it "
            f"(a tampered or foreign file?): {reason(e)}"
        ) from None
