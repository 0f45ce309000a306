"""The api contracts: trajectory building and validation, sample status, GenerationConfig, imports."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from relayrl.api import (
    GenerationConfig,
    ModelResponse,
    SampleStatus,
    StatusCounter,
    TrajectoryError,
    WeightUpdate,
    concat_trajectories,
    trajectory_from_response,
    validate_trajectory,
)


def _resp(prompt: list[int], out: list[int], version: int = 0) -> ModelResponse:
    return ModelResponse(
        input_tokens=prompt,
        output_tokens=out,
        output_logprobs=[-0.1 * (i + 1) for i in range(len(out))],
        output_versions=[version] * len(out),
        stop_reason="stop",
    )


def _batch() -> dict[str, torch.Tensor]:
    a = trajectory_from_response(_resp([1, 2, 3], [4, 5]), reward=1.0, group_id=torch.tensor([0]))
    b = trajectory_from_response(_resp([6], [7, 8, 9, 10], version=2), reward=0.0, group_id=torch.tensor([0]))
    return concat_trajectories([a, b])


def test_good_trajectory_built_from_responses():
    single = trajectory_from_response(_resp([1, 2, 3], [4, 5]), reward=0.5)
    validate_trajectory(single)
    assert single["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert single["loss_mask"].tolist() == [[False, False, False, True, True]]
    assert single["logprobs"][0].tolist() == pytest.approx([0, 0, 0, -0.1, -0.2])
    assert single["versions"].tolist() == [[-1, -1, -1, 0, 0]]

    batch = _batch()
    validate_trajectory(batch)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert batch["attention_mask"].tolist() == [[True] * 5, [True] * 5]
    # a shorter row is right-padded: 0 everywhere except versions (-1)
    c = trajectory_from_response(_resp([1], [2]), reward=1.0, group_id=torch.tensor([1]))
    batch = concat_trajectories([batch, c])
    validate_trajectory(batch)
    assert batch["input_ids"][2].tolist() == [1, 2, 0, 0, 0]
    assert batch["attention_mask"][2].tolist() == [True, True, False, False, False]
    assert batch["versions"][2].tolist() == [-1, 0, -1, -1, -1]
    assert batch["rewards"].tolist() == [1.0, 0.0, 1.0]
    assert batch["group_id"].tolist() == [0, 0, 1]
    # trainer-side keys of the right shape are accepted
    batch["advantages"] = torch.zeros(3, 5)
    validate_trajectory(batch)


def _broken(mutate) -> dict[str, torch.Tensor]:
    batch = _batch()
    mutate(batch)
    return batch


DEFECTS = {
    "missing key": (lambda b: b.pop("logprobs"), r"missing key 'logprobs'"),
    "not a tensor": (lambda b: b.update(rewards=[1.0, 0.0]), r"\['rewards'\] must be a torch.Tensor"),
    "wrong dtype ids": (
        lambda b: b.update(input_ids=b["input_ids"].float()),
        r"\['input_ids'\] has dtype torch.float32",
    ),
    "wrong dtype logprobs": (
        lambda b: b.update(logprobs=b["logprobs"].half()),
        r"\['logprobs'\] has dtype torch.float16",
    ),
    "1-D input_ids": (lambda b: b.update(input_ids=b["input_ids"][0]), r"\['input_ids'\] must be \[B, L\]"),
    "token key wrong shape": (
        lambda b: b.update(loss_mask=b["loss_mask"][:, :4]),
        r"\['loss_mask'\] must have shape \[B, L\] = \[2, 5\]",
    ),
    "rewards wrong shape": (
        lambda b: b.update(rewards=b["rewards"][:, None]),
        r"\['rewards'\] must have shape \[B\] = \[2\]",
    ),
    "trainer key wrong shape": (
        lambda b: b.update(advantages=torch.zeros(2)),
        r"\['advantages'\] must have shape \[B, L\]",
    ),
    "extra key wrong batch": (
        lambda b: b.update(group_id=torch.tensor([0, 0, 0])),
        r"extra key 'group_id' must have batch size 2",
    ),
    "left padding": (
        lambda b: b["attention_mask"][1].copy_(torch.tensor([0, 1, 1, 1, 1])),
        r"\['attention_mask'\] must start with 1",
    ),
    "hole in mask": (
        lambda b: b["attention_mask"][1].copy_(torch.tensor([1, 0, 1, 1, 1])),
        r"\['attention_mask'\] must be 1s then 0s",
    ),
    "loss on padding": (
        lambda b: b["attention_mask"][0].copy_(torch.tensor([1, 1, 1, 1, 0])),
        r"\['loss_mask'\] is 1 on a padding position",
    ),
    "loss on first token": (
        lambda b: b["loss_mask"][1].__setitem__(0, True),
        r"\['loss_mask'\] is 1 on the first token",
    ),
    "no completion": (lambda b: b["loss_mask"][1].zero_(), r"\['loss_mask'\] selects no token in row 1"),
    "logprob on prompt": (
        lambda b: b["logprobs"][0].__setitem__(1, -0.5),
        r"\['logprobs'\] must be 0 where loss_mask is 0",
    ),
    "positive logprob": (lambda b: b["logprobs"][0].__setitem__(4, 0.3), r"\['logprobs'\] has a positive value"),
    "version on prompt": (
        lambda b: b["versions"][0].__setitem__(0, 0),
        r"\['versions'\] must be -1 where loss_mask is 0",
    ),
    "negative version": (lambda b: b["versions"][1].__setitem__(3, -1), r"\['versions'\] must be >= 0"),
    "nan reward": (lambda b: b["rewards"].__setitem__(1, float("nan")), r"\['rewards'\] contains NaN"),
    "inf reward": (lambda b: b["rewards"].__setitem__(0, float("inf")), r"\['rewards'\] contains NaN or inf"),
}


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_validate_rejects_each_defect_naming_the_key(defect):
    mutate, pattern = DEFECTS[defect]
    with pytest.raises(TrajectoryError, match=pattern):
        validate_trajectory(_broken(mutate))


def test_validate_rejects_non_dict_and_concat_rejects_mismatched_keys():
    with pytest.raises(TrajectoryError, match="must be a dict of tensors, got list"):
        validate_trajectory([1, 2])  # type: ignore[arg-type]
    a = trajectory_from_response(_resp([1], [2]), reward=1.0)
    b = trajectory_from_response(_resp([1], [2]), reward=1.0, extra=torch.tensor([1]))
    with pytest.raises(TrajectoryError, match="trajectory 1 has keys"):
        concat_trajectories([a, b])
    with pytest.raises(ValueError, match="at least one"):
        concat_trajectories([])


def test_status_counter_reconciles():
    c = StatusCounter()
    c.submit(5)
    for status in (SampleStatus.COMPLETED, SampleStatus.COMPLETED, SampleStatus.FILTERED, SampleStatus.FAILED):
        c.finish(status)
    assert c.in_flight == 1
    with pytest.raises(RuntimeError, match="5 submitted but 4 finished"):
        c.reconcile()
    c.finish(SampleStatus.EXPIRED)
    c.reconcile()
    assert c.as_dict() == {"submitted": 5, "completed": 2, "filtered": 1, "failed": 1, "aborted": 0, "expired": 1}
    with pytest.raises(RuntimeError, match="6 episodes finished but only 5 submitted"):
        c.finish(SampleStatus.ABORTED)
    restored = StatusCounter()
    restored.load_state_dict(c.state_dict())
    assert restored.as_dict() == c.as_dict() and restored.in_flight == 0
    assert [s.value for s in SampleStatus] == ["completed", "filtered", "failed", "aborted", "expired"]


def test_generation_config_new_and_validate():
    g = GenerationConfig(max_new_tokens=16, stop=["\n"])
    g2 = g.new(greedy=True, temperature=0.5)
    assert (g2.greedy, g2.temperature, g2.max_new_tokens, g2.stop) == (True, 0.5, 16, ["\n"])
    assert g.greedy is False and g.temperature == 1.0  # the original is unchanged
    g2.stop.append("x")
    assert g.stop == ["\n"]  # lists are copied, not shared
    g.validate()
    for changes, field in [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"min_new_tokens": 17}, "min_new_tokens"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
    ]:
        with pytest.raises(ValueError, match=f"^{field} must"):
            g.new(**changes).validate()
    with pytest.raises(TypeError):
        g.new(no_such_field=1)


def test_weight_update_checks_its_fields():
    WeightUpdate(kind="tensors", version=1, tensors={})
    with pytest.raises(ValueError, match="needs `tensors`"):
        WeightUpdate(kind="tensors", version=1)
    with pytest.raises(ValueError, match="needs `path`"):
        WeightUpdate(kind="disk", version=1)
    with pytest.raises(ValueError, match="kind must be"):
        WeightUpdate(kind="pigeon", version=1)  # type: ignore[arg-type]


def test_import_api_does_not_import_transformers():
    code = "import relayrl.api, sys; assert 'transformers' not in sys.modules, 'transformers was imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
