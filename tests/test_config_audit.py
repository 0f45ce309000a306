"""Every documented ``RunConfig`` field does something: the code reads it during a real run, or a
named test changes it and asserts what it does (fields that act only under torch.distributed, on
NaN, on failures).

A field that nothing reads (like ``gconfig.n_samples`` was: every workflow reset it) fails here.
Reads inside ``relayrl/api/`` do not count: loading, documenting and validating
(``api/fields.py``'s ``validate_config`` reads every field) are not doing.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path

import pytest

from relayrl.api.config import RunConfig, load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
# field -> the test that changes it and asserts its effect, for fields a short run cannot reach
ELSEWHERE = {
    "TrainEngineConfig.fsdp": "tests/test_train_distributed.py::test_two_ranks_equal_one_process",
    "TrainEngineConfig.max_nan_skips": "tests/test_train_engine.py::test_nan_guard_skips_and_then_stops",
    "RolloutConfig.max_failure_rate": "tests/test_executor.py::test_failure_rate_stops_with_clear_error",
    "InferenceConfig.max_retries": "tests/test_remote.py::test_killed_server_requests_complete_and_server_is_readmitted",
    "InferenceConfig.server_wait_timeout": "tests/reliability/test_server_freeze.py::test_every_server_frozen_stops_the_run_with_one_line",
    "CheckpointConfig.every_minutes": "tests/test_trainer.py::test_checkpoints_are_due_every_n_steps_or_every_n_minutes",
    "RolloutCorrectionConfig.level": "tests/test_mismatch.py::test_rollout_correction_matches_the_peers_formulas",
    "RolloutCorrectionConfig.low": "tests/test_mismatch.py::test_rollout_correction_matches_the_peers_formulas",
    "RolloutCorrectionConfig.high": "tests/test_mismatch.py::test_rollout_correction_matches_the_peers_formulas",
    "RolloutCorrectionConfig.masked_in_norm": "tests/test_mismatch.py::test_rollout_correction_matches_the_peers_formulas",
    "LoraConfig.alpha": "tests/test_lora.py::test_alpha_scales_the_adapters_update",
    "LoraConfig.dropout": "tests/test_lora.py::test_dropout_acts_on_the_adapters_in_training_mode_only",
    "LoraConfig.target_modules": "tests/test_lora.py::test_target_modules_are_checked_at_start_up",
    "LoraConfig.adapter_path": "tests/test_lora.py::test_checkpoint_is_a_peft_adapter_and_resumes_exactly",
    "TeacherConfig.top_k": "tests/test_distill.py::test_distill_alone_and_added_to_ppo_in_the_actor",
    "TeacherConfig.url": "tests/test_distill.py::test_a_served_teacher_is_asked_for_each_rows_tokens_with_its_key",
    "TeacherConfig.protocol": "tests/test_distill.py::test_a_served_teacher_is_asked_for_each_rows_tokens_with_its_key",
    "TeacherConfig.api_key_env": "tests/test_distill.py::test_a_served_teacher_is_asked_for_each_rows_tokens_with_its_key",
    "TeacherConfig.timeout": "tests/test_distill.py::test_a_served_teacher_is_asked_for_each_rows_tokens_with_its_key",
    "ActorConfig.moe_aux_loss_coef": "tests/test_moe.py::test_load_balancing_loss_matches_transformers_and_is_logged",
    "InferenceConfig.cuda_graphs": "tests/test_failsafe.py::test_a_failing_graph_capture_falls_back_to_eager_steps",
    "InferenceConfig.weight_bucket_mb": "tests/test_peers.py::test_broadcast_to_sglang_in_buckets_with_tensor_parallel_ranks",
    "LoraConfig.sync": "tests/test_lora_peers.py::test_a_server_without_runtime_lora_is_refused_at_start_up",
    "RolloutConfig.max_turns": "tests/test_prompt_formats.py::test_workflow_settings_are_config_fields",
    "RolloutConfig.turn_discount": "tests/test_prompt_formats.py::test_workflow_settings_are_config_fields",
    "RolloutConfig.max_tool_calls": "tests/test_prompt_formats.py::test_workflow_settings_are_config_fields",
    "RolloutConfig.tool": "tests/test_prompt_formats.py::test_workflow_settings_are_config_fields",
    "RolloutConfig.tool_timeout": "tests/test_prompt_formats.py::test_workflow_settings_are_config_fields",
    "RolloutConfig.tool_format": "tests/test_agents.py::test_tool_agent_workflow_through_the_chat_template",
    # servers launched as SGLang / vLLM (the stand-ins in tests/peers/)
    "InferenceConfig.launch_args": "tests/test_peer_launch.py::test_a_server_that_fails_to_start_is_an_error_quoting_its_log",
    "InferenceConfig.launch_command": "tests/test_peer_launch.py::test_launched_servers_get_relayrls_flags_gpus_and_logs_and_stop_on_destroy",
    "InferenceConfig.launch_gpus": "tests/test_peer_launch.py::test_launched_servers_get_relayrls_flags_gpus_and_logs_and_stop_on_destroy",
    "InferenceConfig.launch_log_dir": "tests/test_peer_launch.py::test_launched_servers_get_relayrls_flags_gpus_and_logs_and_stop_on_destroy",
    "InferenceConfig.launch_tp_size": "tests/test_peer_launch.py::test_launched_servers_get_relayrls_flags_gpus_and_logs_and_stop_on_destroy",
    "InferenceConfig.launch_timeout": "tests/test_peer_launch.py::test_a_server_not_healthy_within_launch_timeout_is_an_error_naming_it",
    # launcher=ray: read by `relayrl train` (cli.py) and relayrl.launch, which these runs do not go through
    "RunConfig.launcher": "tests/test_ray_launcher.py::test_two_ranks_and_a_server_on_two_nodes_train_like_one_process_through_a_rank_death",
    "RayConfig.address": "tests/test_ray_launcher.py::test_unreachable_ray_address_is_one_line",
    "RayConfig.num_cpus": "tests/test_ray_launcher.py::test_without_an_address_a_local_instance_starts_with_ray_num_cpus",
    "RayConfig.trainer_ranks": "tests/test_ray_launcher.py::test_two_ranks_and_a_server_on_two_nodes_train_like_one_process_through_a_rank_death",
    "RayConfig.trainer_cpus": "tests/test_ray_launcher.py::test_two_ranks_and_a_server_on_two_nodes_train_like_one_process_through_a_rank_death",
    "RayConfig.trainer_gpus": "tests/test_ray_launcher.py::test_a_spec_the_cluster_cannot_hold_fails_at_start_naming_what_is_missing",
    "RayConfig.server_cpus": "tests/test_ray_launcher.py::test_two_ranks_and_a_server_on_two_nodes_train_like_one_process_through_a_rank_death",
    "RayConfig.server_gpus": "tests/test_ray_launcher.py::test_a_spec_the_cluster_cannot_hold_fails_at_start_naming_what_is_missing",
    "RayConfig.strategy": "tests/test_ray_launcher.py::test_two_ranks_and_a_server_on_two_nodes_train_like_one_process_through_a_rank_death",
    "RayConfig.placement_timeout": "tests/test_ray_launcher.py::test_a_spec_the_cluster_cannot_hold_fails_at_start_naming_what_is_missing",
    "RayConfig.server_max_restarts": "tests/test_ray_launcher.py::test_killed_server_actor_is_restarted_and_readmitted_with_nothing_lost",
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
    # the fields only REINFORCE and decoupled PPO declare (reads=)
    "reinforce-decoupled": ["actor.adv_estimator=reinforce", "actor.loss=decoupled_ppo"],
}
NOT_A_USE = ("/relayrl/api/", "/dataclasses.py", "/copy.py")  # readers whose reads are not a use


def _sections(cls: type, out: dict[type, set[str]]) -> dict[type, set[str]]:
    hints = typing.get_type_hints(cls)
    out[cls] = {fl.name for fl in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[fl.name])}
    for fl in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[fl.name]):
            _sections(typing.cast(type, hints[fl.name]), out)
    return out


def unread_fields(root: type, run: Callable[[], None], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fields of ``root``'s sections that ``run()`` never reads outside ``NOT_A_USE``."""
    sections = _sections(root, {})
    reads: set[str] = set()
    for cls, names in sections.items():

        def hook(self: object, name: str, _cls: type = cls, _names: set[str] = names) -> object:
            if name in _names:
                caller = sys._getframe(1).f_code.co_filename  # (here: a generator below would be the frame)
                if not any(part in caller for part in NOT_A_USE):
                    reads.add(f"{_cls.__name__}.{name}")
            return object.__getattribute__(self, name)

        monkeypatch.setattr(cls, "__getattribute__", hook)
    run()
    monkeypatch.undo()
    return sorted({f"{cls.__name__}.{n}" for cls, names in sections.items() for n in names} - reads)


def changes_and_asserts(test: str, field: str) -> bool:
    """Whether the test function ``path::name`` (with the module constants and helpers it uses) sets ``field`` (a
    keyword argument, an override ``[section.]field=...``, an attribute assignment or a parameter of
    that name) and asserts something."""
    path, name = test.split("::")
    tree = ast.parse((ROOT / path).read_text())
    funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(funcs) != 1:
        return False
    used = {n.id for n in ast.walk(funcs[0]) if isinstance(n, ast.Name)}
    helpers = [  # module constants and helper functions the test uses (one level)
        n
        for n in tree.body
        if (isinstance(n, ast.Assign) and {ast.unparse(t) for t in n.targets} & used)
        or (isinstance(n, ast.FunctionDef) and n.name in used)
    ]
    sets = asserts = False
    for node in [n for top in (funcs[0], *helpers) for n in ast.walk(top)]:
        if isinstance(node, ast.keyword) and node.arg == field:
            sets = True
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.match(rf"(\w+\.)*{field}=", node.value)
        ):
            sets = True
        elif isinstance(node, ast.Attribute) and node.attr == field and isinstance(node.ctx, ast.Store):
            sets = True
        elif isinstance(node, ast.arg) and node.arg == field:
            sets = True
        elif isinstance(node, ast.Assert) or (isinstance(node, ast.Attribute) and node.attr == "raises"):
            asserts = True
    return sets and asserts


@dataclasses.dataclass
class _Knob:
    unread_knob: int = 3  # a field no code reads: validation alone must not make it count


@dataclasses.dataclass
class _RunWithKnob(RunConfig):
    knob: _Knob = dataclasses.field(default_factory=_Knob)


def test_a_field_only_validation_reads_is_reported_unread(monkeypatch):
    cfg = _RunWithKnob()

    def run() -> None:
        validate_config(cfg)  # reads every field, as train() does first
        assert cfg.total_steps > 0  # a read from outside relayrl/api/ (this test) does count

    unread = unread_fields(_RunWithKnob, run, monkeypatch)
    assert "_Knob.unread_knob" in unread and "_RunWithKnob.total_steps" not in unread
    assert "_RunWithKnob.seed" in unread and len(unread) > 100  # everything else only validation read


def test_the_named_test_check_needs_the_field_set_and_an_assert():
    here = "tests/test_config_audit.py::test_a_field_only_validation_reads_is_reported_unread"
    assert not changes_and_asserts(here, "max_nan_skips")  # a name alone proves nothing
    assert changes_and_asserts("tests/test_lora.py::test_dropout_acts_on_the_adapters_in_training_mode_only", "dropout")
    assert not changes_and_asserts("tests/test_lora.py::test_no_such_test", "dropout")


def test_every_named_test_changes_its_field_and_asserts_the_effect():
    wrong = [
        f"{field}: {test}" for field, test in ELSEWHERE.items() if not changes_and_asserts(test, field.split(".")[1])
    ]
    assert not wrong, f"named tests that do not set the field and assert: {wrong}"


@pytest.mark.slow
def test_every_config_field_is_read_by_a_run_or_shown_by_a_named_test(tmp_path, monkeypatch):
    from relayrl.trainer import train

    def runs() -> None:
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

    unread = [f for f in unread_fields(RunConfig, runs, monkeypatch) if f not in ELSEWHERE]
    assert not unread, f"config fields no run reads and no test shows: {unread}"
