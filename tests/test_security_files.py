"""Files a run directory holds are read without pickle: a tampered ``train_state.pt``, ``rng*.pt``
or doctor ``record.pt`` cannot run code on ``--recover`` or ``relayrl doctor`` (issue #38)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from relayrl.doctor.record import record_dir
from relayrl.doctor.replay import diagnose
from relayrl.utils.safeload import load_state_file


class _Payload:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_a_pickle_payload_in_a_doctor_record_does_not_run(tmp_path):
    target = tmp_path / "pwned"
    where = record_dir(tmp_path / "run", 3)
    where.mkdir(parents=True)
    torch.save({"batch": _Payload(target)}, where / "record.pt")
    with pytest.raises(ValueError, match="refusing to unpickle"):
        diagnose(tmp_path / "run", 3)
    assert not target.exists()


def test_training_state_files_load_plain_data_and_refuse_payloads(tmp_path):
    good = {"optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}, "steps": 4, "python": (3, (1, 2), None)}
    torch.save(good, tmp_path / "train_state.pt")
    back = load_state_file(tmp_path / "train_state.pt")
    assert back["steps"] == 4 and torch.equal(back["optimizer"]["state"][0]["exp_avg"], torch.ones(2))
    target = tmp_path / "pwned"
    torch.save({"steps": _Payload(target)}, tmp_path / "rng.pt")
    with pytest.raises(ValueError, match=r"rng\.pt holds objects other than tensors"):
        load_state_file(tmp_path / "rng.pt")
    assert not target.exists()


def test_no_pickle_loads_anywhere_in_relayrl():
    root = Path(__file__).parents[1] / "relayrl"
    found = [
        f"{p.relative_to(root)}:{i}"
        for p in root.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"weights_only\s*=\s*False|pickle\.loads?\(|\bnp\.load\(.*allow_pickle=True", line)
    ]
    assert found == []
