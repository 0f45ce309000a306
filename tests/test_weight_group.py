"""The weight-update group against SGLang's own construction of it, two real processes over gloo.

The other member is built by ``tests/peers/sglang_group.py`` the way SGLang builds it
(rendezvous, ``PrefixStore(group_name)``, torch's ``_new_process_group_helper``); both directions
must work: relayrl's trainer with an SGLang server, and an SGLang-style trainer with a relayrl server.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relayrl.inference.weight_group import WeightBroadcastGroup, buckets, store_device

sys.path.insert(0, str(Path(__file__).parent))
from peers.sglang_group import sample_tensors  # noqa: E402

PEER = Path(__file__).parent / "peers" / "sglang_group.py"


def _peer(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(PEER), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _sums(ts: list[torch.Tensor]) -> list[float]:
    return [round(float(t.double().sum()), 4) for t in ts]


def test_relayrl_trainer_broadcasts_to_an_sglang_built_member():
    group = WeightBroadcastGroup("127.0.0.1", 0, 2, 0, "gloo", "weight_update_group", timeout_s=30)
    peer = _peer("recv", "127.0.0.1", group.port, 1, 2, "weight_update_group")
    try:
        ts = sample_tensors()
        group.broadcast({str(i): t for i, t in enumerate(ts)})
        out, err = peer.communicate(timeout=60)
        assert peer.returncode == 0, err[-2000:]
        assert f"received {_sums(ts)}" in out
    finally:
        peer.kill()


def test_an_sglang_built_trainer_broadcasts_to_a_relayrl_member():
    """The master built by torch's rendezvous waits for every member to check in with its store."""
    peer = _peer("send", "127.0.0.1", 0, 0, 2, "weight_update_group")
    try:
        assert peer.stdout is not None
        port = int(peer.stdout.readline().split()[1])
        member = WeightBroadcastGroup("127.0.0.1", port, 2, 1, "gloo", "weight_update_group", timeout_s=30)
        ts = sample_tensors()
        bufs = {str(i): torch.empty_like(t) for i, t in enumerate(ts)}
        member.broadcast(bufs)
        assert [torch.equal(b, t) for b, t in zip(bufs.values(), ts, strict=True)] == [True] * 3
        _, err = peer.communicate(timeout=60)
        assert peer.returncode == 0, err[-2000:]
    finally:
        peer.kill()


def test_the_backend_sits_under_the_store_prefix_torch_gives_it():
    assert store_device("gloo") == "cpu"
    assert store_device("nccl") == "cuda"


@pytest.mark.parametrize(
    ("sizes", "limit", "want"),
    [
        ([4, 4, 4], 8, [[0, 1], [2]]),
        ([10, 1, 1], 8, [[0], [1, 2]]),  # an item over the limit goes alone
        ([1, 2, 3], 100, [[0, 1, 2]]),
        ([], 8, []),
    ],
)
def test_buckets_stay_within_the_byte_limit(sizes, limit, want):
    assert buckets(sizes, limit) == want
