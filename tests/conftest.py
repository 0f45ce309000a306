"""Shared fixtures: one torch thread per process, the offline tokenizer and tiny models."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    from relayrl.data.models import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model():
    """The ~5M-parameter preset, seeded; tests that train on it must deep-copy it first."""
    from relayrl.data.models import build_tiny_model

    return build_tiny_model("tiny", seed=0).eval()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped when torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
