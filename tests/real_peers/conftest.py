"""Fixtures of the real-peer tests: the tiny model on disk (weights + tokenizer, as the servers load
a Hugging Face directory), the same model in this process for teacher-forced references, and relayrl
installed beside each peer's environment (tests/real_peers/install.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from relayrl.data.models import build_tiny_model, build_tokenizer
from tests.real_peers.install import build_wheel, install_beside
from tests.real_peers.servers import peer_env


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


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """``installed(kind)``: (peer ``kind``'s environment, the folder holding relayrl and what that environment
    lacked), proven to install there changing none of its packages (built once a session)."""
    done: dict[str, tuple[Path, Path]] = {}
    wheel: list[Path] = []

    def install(kind: str) -> tuple[Path, Path]:
        if not wheel:
            wheel.append(build_wheel(tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("relayrl-src")))
        if kind not in done:
            done[kind] = (peer_env(kind), install_beside(peer_env(kind), wheel[0], tmp_path_factory.mktemp(kind)))
        return done[kind]

    return install
