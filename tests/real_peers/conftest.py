"""Fixtures of the real-peer tests: the tiny model on disk (weights + tokenizer, as the servers load
a Hugging Face directory) and the same model in this process for teacher-forced references."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from relayrl.data.models import build_tiny_model, build_tokenizer


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The ``tiny`` preset (seed 0, fp32) saved with its tokenizer: what the servers serve."""
    path = tmp_path_factory.mktemp("real-peers") / "tiny"
    build_tiny_model("tiny", seed=0).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def served_model(tiny_dir):
    """The served checkpoint loaded here (fp32, eval): the reference of every logprob check."""
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
