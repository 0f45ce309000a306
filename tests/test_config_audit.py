"""Every documented ``RunConfig`` field does something: the code reads it during a real run, or a
named test shows what it does (fields that act only under torch.distributed, on NaN, on failures).

A field that nothing reads (like ``gconfig.n_samples`` was: every workflow reset it) fails here.
Reads inside ``api/config.py`` (loading, validation, docs) do not count.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

import pytest

from relayrl.api.config import RunConfig, load_config
from relayrl.trainer import train

ROOT = Path(__file__).resolve().parents[1]
# field -> the test that shows its effect, for fields a short run cannot reach
ELSEWHERE = {
    "TrainEngineConfig.fsdp": "tests/test_train_distributed.py::test_two_ranks_equal_one_process",
    "TrainEngineConfig.max_nan_skips": "tests/test_train_engine.py::test_nan_guard_skips_and_then_stops",
    "RolloutConfig.max_failure_rate": "tests/test_executor.py::test_failure_rate_stops_with_clear_error",
    "InferenceConfig.max_retries": "tests/test_remote.py::test_killed_server_requests_complete_and_server_is_readmitted",
    "CheckpointConfig.every_minutes": "tests/test_trainer.py::test_checkpoints_are_due_every_n_steps_or_every_n_minutes",
    "LoraConfig.alpha": "tests/test_lora.py::test_merged_weights_reach_a_local_engine_and_leave_the_base_alone",
    "LoraConfig.dropout": "tests/test_lora.py::test_dropout_acts_on_the_adapters_in_training_mode_only",
    "LoraConfig.target_modules": "tests/test_lora.py::test_target_modules_are_checked_at_start_up",
    "LoraConfig.adapter_path": "tests/test_lora.py::test_checkpoint_is_a_peft_adapter_and_resumes_exactly",
}
RUNS = {
    # grpo, a decaying LR, timed checkpoints, file data, requeue_after tail batches
    "local-file": [
        "data.task=file",
        f"data.train_path={ROOT}/tests/data/gsm8k_sample.jsonl",
        f"data.eval_path={ROOT}/tests/data/gsm8k_sample.jsonl",
        "train.optimizer.lr_schedule=linear",
        "checkpoint.every_minutes=60",
        "rollout.tail_batch=requeue_after",
    ],
    # PPO with a critic and a KL-regularised reference
    "gae-kl": ["actor.adv_estimator=gae", "actor.kl_coef=0.1"],
    # launched servers over HTTP
    "remote": ["inference.backend=remote", "inference.n_servers=1"],
}


def _sections(cls: type, out: dict[type, set[str]]) -> dict[type, set[str]]:
    hints = typing.get_type_hints(cls)
    out[cls] = {fl.name for fl in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[fl.name])}
    for fl in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[fl.name]):
            _sections(typing.cast(type, hints[fl.name]), out)
    return out


@pytest.mark.slow
def test_every_config_field_is_read_by_a_run_or_shown_by_a_named_test(tmp_path, monkeypatch):
    sections = _sections(RunConfig, {})
    reads: set[str] = set()
    for cls, names in sections.items():

        def hook(self: object, name: str, _cls: type = cls, _names: set[str] = names) -> object:
            if name in _names:
                caller = sys._getframe(1).f_code.co_filename
                if not caller.endswith(("api/config.py", "dataclasses.py", "copy.py")):
                    reads.add(f"{_cls.__name__}.{name}")
            return object.__getattribute__(self, name)

        monkeypatch.setattr(cls, "__getattribute__", hook)
    for name, extra in RUNS.items():
        cfg = load_config(
            RunConfig,
            None,
            [
                f"run_dir={tmp_path / name}",
                "total_steps=2",
                "rollout.batch_size=2",
                "rollout.group_size=2",
                "gconfig.max_new_tokens=4",
                "data.n_train=8",
                "data.n_eval=2",
                "eval.before_training=true",
                "eval.every_n_steps=1",
                "checkpoint.every_n_steps=1",
                "logging.progress=off",
                "logging.tensorboard=false",
                *extra,
            ],
        )
        train(cfg)
    every = {f"{cls.__name__}.{n}" for cls, names in sections.items() for n in names}
    unread = sorted(every - reads - set(ELSEWHERE))
    assert not unread, f"config fields no run reads and no test shows: {unread}"
    for test in ELSEWHERE.values():
        path, func = test.split("::")
        assert f"def {func}(" in (ROOT / path).read_text(), f"{test} does not exist"
