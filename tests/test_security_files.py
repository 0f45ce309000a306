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


def test_secret_fields_never_reach_config_yaml_or_a_sink(tmp_path, monkeypatch):
    import dataclasses
    import sys
    import types

    from relayrl.api.commands import ServerConfig
    from relayrl.api.config import RunConfig, load_config, save_config
    from relayrl.utils.logging import MetricLogger

    cfg = load_config(RunConfig, None, ["inference.admin_token=hunter2-token"])
    assert cfg.inference.admin_token == "hunter2-token"
    text = save_config(cfg, tmp_path).read_text()
    assert "hunter2" not in text and "admin_token: ''" in text
    again = load_config(RunConfig, tmp_path / "config.yaml")  # a saved config still loads
    assert again.inference.admin_token == ""
    secret = [fl.name for fl in dataclasses.fields(ServerConfig) if fl.metadata.get("secret")]
    assert secret == ["admin_token"]

    seen = {}
    fake = types.SimpleNamespace(
        init=lambda **kw: seen.update(kw) or types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    MetricLogger(tmp_path / "wb", tensorboard=False, wandb=True, config=cfg).close()
    assert seen["config"]["inference"]["admin_token"] == "" and "hunter2" not in repr(seen["config"])


def test_server_replies_out_of_range_are_refused():
    from relayrl.api.workflow import TrajectoryError, validate_trajectory
    from relayrl.inference.remote.protocol import Parsed, ProtocolError

    with pytest.raises(ProtocolError, match="logprob 1 is nan"):
        Parsed(tokens=[1, 2], logprobs=[-0.5, float("nan")], stop_reason="stop")
    with pytest.raises(ProtocolError, match="logprob 0 is 0.5"):
        Parsed(tokens=[1], logprobs=[0.5], stop_reason="stop")
    with pytest.raises(ProtocolError, match="token 0 is -3"):
        Parsed(tokens=[-3], logprobs=[-0.1], stop_reason="stop")
    traj = {
        "input_ids": torch.tensor([[3, 4, 9]]),
        "attention_mask": torch.ones(1, 3, dtype=torch.long),
        "loss_mask": torch.tensor([[0, 1, 1]]),
        "logprobs": torch.tensor([[0.0, -0.2, float("nan")]]),
        "versions": torch.tensor([[-1, 0, 0]]),
        "rewards": torch.tensor([1.0]),
    }
    with pytest.raises(TrajectoryError, match="NaN"):
        validate_trajectory(traj)
    traj["logprobs"] = torch.tensor([[0.0, -0.2, -0.1]])
    validate_trajectory(traj)
    with pytest.raises(TrajectoryError, match="outside the vocabulary"):
        validate_trajectory(traj, vocab_size=8)
