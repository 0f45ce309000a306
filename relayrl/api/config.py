"""Every config of relayrl: dataclasses with ``help`` metadata, validated at load time.

Load a run config from YAML plus dotted overrides::

    cfg = load_config(RunConfig, "recipes/grpo.yaml", ["train.optimizer.lr=1e-5", "rollout.max_staleness=2"])

Rules are declared next to each field (``ge``/``gt``/``le``/``lt``/``choices``) and checked
for every field on load; an error names the dotted field, the value and what is allowed,
in one line (``ConfigError``). Unknown keys are rejected with a did-you-mean.
``docs/config.md`` is generated from these classes by ``config_reference()``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar, Union, get_args, get_origin

import yaml

from relayrl.api.io import GenerationConfig

T = TypeVar("T")
Scalar = str | int | float | bool | None
# A YAML value as loaded: scalars, lists and mappings of them.
YamlValue = Scalar | list["YamlValue"] | dict[str, "YamlValue"]


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or out of range."""


def f(default: T, help: str = "", **rules: object) -> T:
    """A dataclass field with help text and validation rules.

    Rules: ``ge``, ``gt``, ``le``, ``lt`` (numeric bounds), ``choices`` (allowed values).
    List and dataclass defaults are copied per instance.
    """
    meta = {"help": help, **rules}
    if isinstance(default, list) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)  # type: ignore[return-value]
    return field(default=default, metadata=meta)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------
# Config classes. Each section documents its own fields; recipes/ show them in use.
# --------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    path: str = f("tiny", help="HF model directory, or 'tiny' / 'tiny-30m' for a model built from a config in code.")
    tokenizer_path: str = f("", help="Tokenizer directory; empty means the model path (or the offline tokenizer for tiny models).")
    dtype: str = f("float32", help="Parameter dtype.", choices=["float32", "bfloat16", "float16"])
    attn_impl: str = f(
        "auto", help="Attention for packed training: 'varlen' (relayrl per-document), 'flash' (flash-attn), 'auto'.",
        choices=["auto", "varlen", "flash", "sdpa"],
    )
    gradient_checkpointing: bool = f(False, help="Recompute activations in backward to save memory.")
    vocab_size: int = f(0, help="Override the vocabulary size of a tiny model (0 = tokenizer's).", ge=0)


@dataclass
class OptimizerConfig:
    lr: float = f(1e-5, help="Peak learning rate of AdamW.", gt=0.0, le=1.0)
    weight_decay: float = f(0.0, help="AdamW decoupled weight decay.", ge=0.0)
    beta1: float = f(0.9, help="AdamW beta1.", ge=0.0, lt=1.0)
    beta2: float = f(0.999, help="AdamW beta2.", ge=0.0, lt=1.0)
    eps: float = f(1e-8, help="AdamW epsilon.", gt=0.0)
    lr_schedule: str = f("constant", help="LR schedule after warmup.", choices=["constant", "linear", "cosine"])
    warmup_steps: int = f(0, help="Linear warmup steps from 0 to lr.", ge=0)
    min_lr_ratio: float = f(0.0, help="Final LR as a fraction of lr for linear/cosine schedules.", ge=0.0, le=1.0)
    grad_clip: float = f(1.0, help="Clip the global gradient norm to this value (0 disables).", ge=0.0)


@dataclass
class TrainEngineConfig:
    optimizer: OptimizerConfig = f(OptimizerConfig(), help="Optimizer and schedule.")
    mb_max_tokens: int = f(8192, help="Token budget of one packed micro-batch.", ge=16)
    bf16: bool = f(False, help="bf16 autocast (GPU only; ignored on CPU).")
    fsdp: bool = f(True, help="Shard with FSDP2 when torch.distributed runs with more than one rank.")
    max_nan_skips: int = f(3, help="Consecutive non-finite steps skipped before the run stops.", ge=0)
    total_steps: int = f(0, help="Optimizer steps for the LR schedule (0 = taken from the trainer).", ge=0)


@dataclass
class InferenceConfig:
    backend: str = f("local", help="'local': in-process LocalEngine; 'remote': HTTP servers.", choices=["local", "remote"])
    max_batch_size: int = f(64, help="LocalEngine: most sequences decoded together.", ge=1)
    max_tokens_in_flight: int = f(65536, help="LocalEngine: most prompt+generated tokens held in the running batch.", ge=16)
    seed: int = f(0, help="Sampling seed of the engine.")
    fast_decode: bool = f(True, help="LocalEngine: lean decode step for Llama/Qwen2-style models (else the generic HF forward).")
    admit_window_ms: float = f(
        5.0, help="LocalEngine: an idle engine waits up to this long while requests keep arriving, so a burst is "
        "prefilled in one forward (0 = admit at once).", ge=0.0, le=1000.0,
    )
    protocol: str = f("relayrl", help="Remote server protocol.", choices=["relayrl", "sglang", "vllm"])
    addresses: list[str] = f([], help="Remote servers as host:port; empty with n_servers > 0 launches local servers.")
    n_servers: int = f(0, help="Servers to launch for backend=remote when no addresses are given (see launch).", ge=0)
    launch: str = f("relayrl", help="Who starts the n_servers servers: relayrl (`relayrl serve`), sglang "
                    "(`python -m sglang.launch_server`), vllm (`vllm serve`), none (never: addresses are required).",
                    choices=["none", "relayrl", "sglang", "vllm"])
    launch_command: str = f("", help="launch=sglang|vllm: the command run instead of `python -m sglang.launch_server` / "
                            "`vllm serve` (a wrapper script, a container entry point).")
    launch_args: list[str] = f([], help="launch=sglang|vllm: extra server flags, e.g. ['--mem-fraction-static', '0.7'].")
    launch_gpus: list[int] = f([], help="launch=sglang|vllm: GPUs handed out in order, launch_tp_size per server "
                               "(CUDA_VISIBLE_DEVICES); empty = the servers' own default.")
    launch_tp_size: int = f(1, help="launch=sglang|vllm: tensor-parallel size of each launched server.", ge=1)
    launch_log_dir: str = f("", help="launch=sglang|vllm: where server-<i>.log files go (empty: a temporary directory).")
    launch_timeout: float = f(900.0, help="launch=sglang|vllm: seconds a server may take to load and become healthy.", gt=0.0)
    server_threads: int = f(1, help="torch threads of each launched server.", ge=1)
    request_timeout: float = f(300.0, help="Seconds before one HTTP request is abandoned and retried.", gt=0.0)
    max_retries: int = f(5, help="Retries of a request on connection errors (with backoff).", ge=0)
    admin_token: str = f("", help="Bearer token for admin endpoints of servers (also read from RELAYRL_ADMIN_TOKEN).")
    weight_sync: str = f("auto", help="How weights reach servers: 'disk' (versioned dir), 'http' (upload), 'broadcast' "
                         "(a process group with the servers: NCCL on GPUs, gloo on CPU), 'auto' (disk if weight_sync_dir, else http).",
                         choices=["auto", "disk", "http", "broadcast"])
    weight_sync_dir: str = f("", help="Shared directory for weight_sync=disk (versioned safetensors dirs); auto uses disk when set.")
    health_interval: float = f(1.0, help="Seconds between health checks of remote servers (dead ones are re-admitted).", gt=0.0)
    batch_window_ms: float = f(1.0, help="RemoteEngine: generation requests headed to the same server within this many "
                               "milliseconds go out as one batched HTTP call (each still retried, continued and balanced on its "
                               "own); 0 = one call per request.", ge=0.0, le=1000.0)
    batch_max_requests: int = f(256, help="RemoteEngine: most generation requests in one batched HTTP call.", ge=1)
    weight_bucket_mb: float = f(512.0, help="weight_sync=broadcast: most megabytes of tensors per update call (servers "
                                "allocate one bucket of receive buffers at a time).", gt=0.0)


@dataclass
class RolloutConfig:
    batch_size: int = f(8, help="Prompts per training step (each yields group_size episodes).", ge=1)
    group_size: int = f(4, help="Episodes per prompt (GRPO group).", ge=1)
    max_staleness: int = f(0, help="eta: most versions a trajectory may lag the trainer; 0 = synchronous RL.", ge=0)
    max_concurrent_rollouts: int = f(0, help="Most prompts in flight at once (0 = batch_size * (max_staleness + 1)).", ge=0)
    dynamic_filter: bool = f(False, help="DAPO dynamic sampling: drop groups whose rewards are all equal and over-sample.")
    filter_patience: int = f(
        20, help="Stop with an error when this many batch_size-worth of groups in a row were filtered "
        "(dynamic_filter or accept fn) while one batch was being filled: the task gives no learning signal (0 = never).", ge=0,
    )
    max_failure_rate: float = f(0.5, help="Stop the run when more than this fraction of recent episodes failed.", ge=0.0, le=1.0)
    failure_window: int = f(50, help="Episodes over which the failure rate is measured.", ge=1)
    tail_batch: str = f(
        "requeue", help="What happens to aborted/expired prompts: discard, requeue (at once), requeue_after (N pile up).",
        choices=["discard", "requeue", "requeue_after"],
    )
    tail_batch_trigger: int = f(8, help="requeue_after: prompts that pile up before they are re-run together.", ge=1)
    reward_timeout: float = f(30.0, help="Seconds before one reward call is abandoned (counted as failed).", gt=0.0)
    reward_workers: int = f(0, help="Reward worker processes (0 = run reward fns in the rollout thread).", ge=0)


@dataclass
class ActorConfig:
    adv_estimator: str = f("grpo", help="Advantage estimator, a name registered with @register_advantage: grpo, dr_grpo, rloo, reinforce, reinforce_pp, remax, gae, or your own (checked against the registry when the trainer or actor is built, before any model loads).")
    loss: str = f("ppo", help="Policy loss, a name registered with @register_loss: ppo, decoupled_ppo, gspo, reinforce, or your own (checked against the registry when the trainer or actor is built, before any model loads).")
    eps_clip: float = f(0.2, help="PPO clip range (lower side, and upper unless eps_clip_higher is set).", gt=0.0, lt=1.0)
    eps_clip_higher: float | None = f(None, help="DAPO clip-higher: upper clip range; None = eps_clip.", gt=0.0, lt=10.0)
    c_clip: float | None = f(None, help="Dual-clip factor for negative advantages, must be > 1; None disables.", gt=1.0)
    behav_imp_weight_cap: float | None = f(5.0, help="Decoupled PPO: cap on pi_prox / pi_behav; None disables.", gt=1.0)
    kl_coef: float = f(0.0, help="KL(pi || ref) coefficient (0 disables the reference model).", ge=0.0)
    kl_estimator: str = f("k3", help="KL estimator.", choices=["k1", "k2", "k3"])
    kl_in_reward: bool = f(False, help="Apply KL as a per-token reward penalty instead of a loss term.")
    entropy_coef: float = f(0.0, help="Entropy bonus coefficient.", ge=0.0)
    loss_agg_mode: str = f(
        "token-mean", help="How token losses become one number (seq-mean-token-sum-norm divides by n_seqs * loss_norm_len: Dr.GRPO).",
        choices=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
    )
    loss_norm_len: int = f(0, help="seq-mean-token-sum-norm: the constant per-sequence divisor, usually gconfig.max_new_tokens.", ge=0)
    temperature: float = f(1.0, help="Sampling temperature (logprobs are recomputed at it).", gt=0.0)
    ppo_epochs: int = f(1, help="Passes over each batch.", ge=1)
    n_minibatches: int = f(1, help="Optimizer steps per pass.", ge=1)
    recompute_logp: bool = f(True, help="Recompute old logprobs with the trainer (needed for decoupled PPO).")
    reuse_update_logp: bool = f(
        True, help="With ppo_epochs=1 and n_minibatches=1 the policy before the update is the one the update's own "
        "forward runs: its detached logprobs serve as the old / proximal ones, saving a forward pass per step "
        "(identical unless the model has dropout).",
    )
    reward_scale: float = f(1.0, help="Rewards are multiplied by this ...", gt=0.0)
    reward_bias: float = f(0.0, help="... then shifted by this ...")
    reward_clip: float = f(0.0, help="... then clipped to [-c, c] (0 disables).", ge=0.0)
    overlong_buffer: int = f(0, help="DAPO overlong penalty: tokens before max_new_tokens where the penalty ramps (0 disables).", ge=0)
    overlong_penalty: float = f(1.0, help="DAPO overlong penalty at max_new_tokens.", ge=0.0)
    overlong_max_len: int = f(0, help="DAPO overlong penalty: the generation limit (gconfig.max_new_tokens); needed when overlong_buffer > 0.", ge=0)
    mask_truncated: bool = f(False, help="Drop completions that hit max_new_tokens from the loss.")
    gamma: float = f(1.0, help="Discount for GAE / REINFORCE returns.", ge=0.0, le=1.0)
    lam: float = f(1.0, help="GAE lambda.", ge=0.0, le=1.0)
    adv_norm: bool = f(True, help="grpo: divide by group std; reinforce_pp: normalise over the batch.")
    adv_eps: float = f(1e-6, help="grpo / reinforce_pp: added to the std before dividing.", gt=0.0)
    baseline: bool = f(True, help="reinforce: subtract the batch-mean reward as a baseline.")
    value_clip: float = f(0.2, help="Critic: value clipping range.", gt=0.0)
    critic_lr: float = f(1e-5, help="Critic learning rate (PPO with critic).", gt=0.0)

    def validate(self) -> None:
        """Cross-field rules (``ValueError`` naming the fields; field prefix added by the loader)."""
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_norm_len <= 0:
            raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs loss_norm_len > 0 (e.g. gconfig.max_new_tokens)")
        if self.overlong_buffer > 0 and 0 < self.overlong_max_len <= self.overlong_buffer:
            raise ValueError(f"overlong_buffer={self.overlong_buffer} needs overlong_max_len > overlong_buffer "
                             f"(the generation limit), got {self.overlong_max_len}")
        if self.loss == "decoupled_ppo" and not self.recompute_logp:
            raise ValueError("loss='decoupled_ppo' needs recompute_logp=true (the proximal logprobs)")


@dataclass
class DataConfig:
    task: str = f("arithmetic", help="A synthetic task name, or 'file' to read train_path/eval_path.", choices=["arithmetic", "countdown", "count", "file"])
    train_path: str = f("", help="jsonl / parquet / json file of training rows (task=file).")
    eval_path: str = f("", help="Held-out rows (task=file).")
    prompt_key: str = f("question", help="Column holding the prompt text (or 'messages' for chat rows).")
    answer_key: str = f("answer", help="Column holding the reference answer.")
    n_train: int = f(2000, help="Synthetic task: training prompts.", ge=1)
    n_eval: int = f(200, help="Synthetic task: held-out prompts.", ge=1)
    max_prompt_len: int = f(1024, help="Prompts longer than this (tokens) are rejected.", ge=1)
    skip_invalid_rows: bool = f(False, help="Skip (and count) bad rows instead of stopping with an error.")
    shuffle: bool = f(True, help="Shuffle the training set each epoch (seeded).")
    difficulty: int = f(2, help="Synthetic task: number of digits / operands (count: length scale, median 3x numbers).", ge=1, le=6)


@dataclass
class EvalConfig:
    every_n_steps: int = f(0, help="Evaluate every N steps (0 = never, except before/after when asked).", ge=0)
    before_training: bool = f(False, help="Evaluate once before the first step.")
    gconfig: GenerationConfig = f(GenerationConfig(greedy=True, max_new_tokens=32), help="Generation for evaluation.")
    n_samples: int = f(1, help="Samples per prompt; >1 reports pass@k as well.", ge=1)
    max_prompts: int = f(0, help="Evaluate on at most this many prompts (0 = all).", ge=0)


@dataclass
class CheckpointConfig:
    every_n_steps: int = f(0, help="Save every N steps (0 = off).", ge=0)
    every_minutes: float = f(0.0, help="Save when this many minutes passed since the last save (0 = off).", ge=0.0)
    keep_last: int = f(2, help="Checkpoints kept on disk.", ge=1)
    save_final: bool = f(True, help="Save at the end of training (and on Ctrl-C).")


@dataclass
class LoggingConfig:
    tensorboard: bool = f(True, help="Write TensorBoard event files.")
    wandb: bool = f(False, help="Log to Weights & Biases.")
    wandb_mode: str = f("offline", help="W&B mode.", choices=["online", "offline", "disabled"])
    wandb_project: str = f("relayrl", help="W&B project.")
    rollouts_per_step: int = f(4, help="Rollouts (prompt, completion, reward, version) saved per step.", ge=0)
    progress: str = f("auto", help="Progress display: auto (a live bar on a terminal, lines otherwise), bar, lines, off.", choices=["auto", "bar", "lines", "off"])


@dataclass
class RunConfig:
    """A whole training run (``relayrl train``)."""

    run_dir: str = f("runs/default", help="Directory for config, metrics, checkpoints and rollouts.")
    seed: int = f(1, help="Global seed (data order, init, sampling).")
    total_steps: int = f(100, help="Training steps (one batch and one weight update each).", ge=1)
    torch_threads: int = f(1, help="torch threads per process (1 is fastest on small shared CPUs).", ge=1)
    recover: str = f("off", help="off; auto (resume if a checkpoint exists); resume (must resume).", choices=["off", "auto", "resume"])
    workflow: str = f("rlvr", help="Rollout workflow.", choices=["rlvr", "multi_turn", "remax", "tool_agent"])
    model: ModelConfig = f(ModelConfig(), help="Policy model.")
    train: TrainEngineConfig = f(TrainEngineConfig(), help="Train engine.")
    actor: ActorConfig = f(ActorConfig(), help="Algorithm.")
    gconfig: GenerationConfig = f(GenerationConfig(max_new_tokens=32), help="Generation for training rollouts.")
    inference: InferenceConfig = f(InferenceConfig(), help="Generators.")
    rollout: RolloutConfig = f(RolloutConfig(), help="Rollout executor.")
    data: DataConfig = f(DataConfig(), help="Datasets.")
    eval: EvalConfig = f(EvalConfig(), help="Evaluation.")
    checkpoint: CheckpointConfig = f(CheckpointConfig(), help="Checkpoints and recovery.")
    logging: LoggingConfig = f(LoggingConfig(), help="Metrics and progress.")

    def validate(self) -> None:
        """Rules across sections (checked after each section's own)."""
        limit = self.actor.overlong_max_len or self.gconfig.max_new_tokens
        if self.actor.overlong_buffer and limit <= self.actor.overlong_buffer:
            raise ValueError(f"actor.overlong_buffer={self.actor.overlong_buffer} must be below the generation limit "
                             f"(actor.overlong_max_len or gconfig.max_new_tokens = {limit})")


@dataclass
class ServerConfig:
    """``relayrl serve``: an HTTP server around LocalEngine."""

    model: ModelConfig = f(ModelConfig(), help="Model to serve.")
    inference: InferenceConfig = f(InferenceConfig(), help="Engine settings (max batch, seed).")
    host: str = f("127.0.0.1", help="Bind address; loopback unless told otherwise.")
    port: int = f(30000, help="TCP port (0 = pick a free one and print it).", ge=0, le=65535)
    admin_token: str = f("", help="Bearer token required by admin endpoints (also RELAYRL_ADMIN_TOKEN).")
    allowed_weight_roots: list[str] = f([], help="Directories /update_weights_from_disk may read (empty = none but uploads).")
    torch_threads: int = f(1, help="torch threads of the server process.", ge=1)
    max_upload_mb: int = f(4096, help="Largest weight upload accepted over HTTP.", ge=1)


# --------------------------------------------------------------------------------------
# Supervised fine-tuning (``relayrl sft``).
# --------------------------------------------------------------------------------------


@dataclass
class SFTDataConfig:
    task: str = f(
        "arithmetic", help="'file': read train_path/eval_path; a synthetic task name: its demonstrations.",
        choices=["arithmetic", "countdown", "count", "file"],
    )
    train_path: str = f("", help="jsonl / json / parquet rows: prompt + completion, or messages (+ answer).")
    eval_path: str = f("", help="Held-out rows in the same format (empty = no eval loss).")
    prompt_key: str = f("prompt", help="Column with the raw prompt text (used as is, no chat template).")
    completion_key: str = f("completion", help="Column with the completion text (EOS is appended).")
    messages_key: str = f("messages", help="Column with chat turns: the chat template makes the prompt.")
    answer_key: str = f("answer", help="Completion column for chat rows without a completion column.")
    max_seq_len: int = f(1024, help="Rows longer than this (prompt + completion tokens) are rejected.", ge=2)
    skip_invalid_rows: bool = f(False, help="Skip (and count) bad rows instead of stopping with an error.")
    n_train: int = f(2000, help="Synthetic task: training demonstrations.", ge=1)
    n_eval: int = f(200, help="Synthetic task: held-out rows (eval loss).", ge=0)
    difficulty: int = f(2, help="Synthetic task: digits / numbers (count: length scale, median 3x numbers).", ge=1, le=6)
    error_rate: float = f(0.0, help="Synthetic task: fraction of demonstrations that are wrong.", ge=0.0, le=1.0)


@dataclass
class SFTConfig:
    """Supervised fine-tuning (``relayrl sft``): loss on completion tokens only."""

    run_dir: str = f("runs/sft", help="Directory for config, metrics.jsonl and the final checkpoint.")
    seed: int = f(1, help="Seed of data order and model init.")
    torch_threads: int = f(1, help="torch threads (1 is fastest on small shared CPUs).", ge=1)
    epochs: int = f(1, help="Passes over the training rows (ignored when total_steps > 0).", ge=1)
    total_steps: int = f(0, help="Optimizer steps (0 = epochs * batches per epoch).", ge=0)
    batch_size: int = f(32, help="Rows per optimizer step.", ge=1)
    eval_every_n_steps: int = f(0, help="Eval loss every N steps (0 = only at the end).", ge=0)
    log_every_n_steps: int = f(10, help="Progress line every N steps.", ge=1)
    save_final: bool = f(True, help="Save an HF checkpoint (and tokenizer) to run_dir/final at the end.")
    model: ModelConfig = f(ModelConfig(), help="Model to fine-tune.")
    train: TrainEngineConfig = f(
        TrainEngineConfig(optimizer=OptimizerConfig(lr=1e-4, lr_schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)),
        help="Train engine (optimizer, schedule, micro-batch token budget).",
    )
    data: SFTDataConfig = f(SFTDataConfig(), help="SFT data.")
    logging: LoggingConfig = f(LoggingConfig(tensorboard=False), help="Metrics sinks.")


# --------------------------------------------------------------------------------------
# Loading and validation.
# --------------------------------------------------------------------------------------


def _type_name(tp: object) -> str:
    if get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) is list:
        return f"list[{_type_name(get_args(tp)[0])}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: YamlValue, tp: object, name: str) -> object:
    """Convert a YAML value to ``tp`` or raise ConfigError naming the field."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{name}: {value!r} is not a {_type_name(tp)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return [_coerce(v, get_args(tp)[0], f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{name}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping of fields, got {value!r}")
        return _build(typing.cast(type, tp), value, name + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an int too large for a float
                raise ConfigError(f"{name}: {value!r} is too large for a number") from None
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads "1e-5" as a string
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (e.g. undecodable bytes in argv)
                raise ConfigError(f"{name}: {value!r} is not valid UTF-8 text") from None
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    raise ConfigError(f"{name}: unsupported field type {_type_name(tp)}")


def _check_rules(value: object, meta: typing.Mapping[str, object], name: str) -> None:
    if value is None:
        return
    choices = meta.get("choices")
    if choices is not None and value not in typing.cast(list, choices):
        raise ConfigError(f"{name}={value!r} is not allowed; choose one of {choices}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}={value!r} is not a finite number")
        for rule, ok, word in (
            ("ge", lambda v, b: v >= b, ">="),
            ("gt", lambda v, b: v > b, ">"),
            ("le", lambda v, b: v <= b, "<="),
            ("lt", lambda v, b: v < b, "<"),
        ):
            bound = meta.get(rule)
            if bound is not None and not ok(value, bound):
                raise ConfigError(f"{name}={value!r} is out of range: must be {word} {bound} ({_range_text(meta)})")


def _range_text(meta: typing.Mapping[str, object]) -> str:
    lo = f"[{meta['ge']}" if "ge" in meta else f"({meta['gt']}" if "gt" in meta else "(-inf"
    hi = f"{meta['le']}]" if "le" in meta else f"{meta['lt']})" if "lt" in meta else "inf)"
    return f"allowed range {lo}, {hi}"


def _build(cls: type[T], values: typing.Mapping[str, YamlValue], prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    fields = {fl.name: fl for fl in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known fields: {', '.join(fields)}"
            shown = f"{prefix}{key}"
            shown = shown if shown.isprintable() else shown.encode("unicode_escape").decode()  # one line, always
            raise ConfigError(f"unknown config key '{shown}'{hint}")
    kwargs: dict[str, object] = {}
    for name in fields:
        if name not in values:
            continue
        value = values[name]
        tp = hints[name]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            default = getattr(cls(), name) if _has_defaults(cls) else None
            merged = {**_to_plain_dict(default), **value} if default is not None else value
            kwargs[name] = _build(typing.cast(type, tp), merged, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, f"{prefix}{name}")
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{prefix or 'config'}: {e}") from None
    validate_config(obj, prefix)
    return obj


def _has_defaults(cls: type) -> bool:
    return all(
        fl.default is not dataclasses.MISSING or fl.default_factory is not dataclasses.MISSING
        for fl in dataclasses.fields(cls)
    )


def _to_plain_dict(obj: object) -> dict[str, YamlValue]:
    return typing.cast(dict[str, YamlValue], dataclasses.asdict(obj))  # type: ignore[call-overload]


def validate_config(obj: object, prefix: str = "") -> None:
    """Check every field's type-independent rules (ranges, choices) recursively."""
    for fl in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, fl.name)
        name = f"{prefix}{fl.name}"
        if dataclasses.is_dataclass(value):
            validate_config(value, name + ".")
        else:
            _check_rules(value, fl.metadata, name)
    check = getattr(obj, "validate", None)  # cross-field rules of a section
    if check is not None:
        try:
            check()
        except ValueError as e:
            raise ConfigError(f"{prefix}{e}") from None


def parse_override(text: str) -> tuple[list[str], YamlValue]:
    """``"actor.lr=1e-5"`` -> (["actor", "lr"], 1e-5). Values are parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value")
    key, raw = text.split("=", 1)
    if not key or any(not part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"override {text!r}: {key!r} is not a dotted field name")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError):  # ValueError: an integer literal too long to convert
        value = raw
    return key.split("."), typing.cast(YamlValue, value)


def _load_yaml(text: str) -> YamlValue:
    """``yaml.safe_load``, through libyaml when PyYAML has it (~9x faster on a full config).

    libyaml rejects a few escapes PyYAML accepts (surrogate ``\\uD800``), so a file it refuses
    is read again by the pure-Python loader, whose error (if any) is the one reported.
    """
    loader = getattr(yaml, "CSafeLoader", None)
    if loader is not None:
        try:
            return typing.cast(YamlValue, yaml.load(text, Loader=loader))
        except (yaml.YAMLError, ValueError):
            pass
    return typing.cast(YamlValue, yaml.safe_load(text))


def load_config(cls: type[T], path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None) -> T:
    """Build ``cls`` from a YAML file (optional) and dotted overrides, fully validated."""
    values: dict[str, YamlValue] = {}
    if path is not None:
        try:
            loaded = _load_yaml(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        except OSError as e:  # a directory, no permission ...
            raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
        except (yaml.YAMLError, ValueError) as e:  # ValueError: an integer literal too long to convert
            raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(loaded).__name__}")
        values = loaded or {}
    for text in overrides or []:
        keys, value = parse_override(text)
        node: dict[str, YamlValue] = values
        for part in keys[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[keys[-1]] = value
    return _build(cls, values)


def config_to_yaml(cfg: object) -> str:
    return yaml.safe_dump(_to_plain_dict(cfg), sort_keys=False)


def save_config(cfg: object, run_dir: str | os.PathLike[str]) -> Path:
    """Write the resolved config to ``run_dir/config.yaml`` (what the run really used)."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(config_to_yaml(cfg))
    return out


def config_reference(classes: tuple[type, ...] = (RunConfig, ServerConfig, SFTConfig)) -> str:
    """Markdown reference of every field (the content of ``docs/config.md``)."""
    lines = [
        "# Config reference",
        "",
        "Generated by `python -m relayrl.api.config > docs/config.md`; a test keeps it in sync.",
        "Set fields in a YAML file or on the command line as dotted overrides (`train.optimizer.lr=1e-5`).",
        "",
    ]

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        nested: list[tuple[type, str]] = []
        rows = []
        for fl in dataclasses.fields(cls):
            tp = hints[fl.name]
            if dataclasses.is_dataclass(tp):
                nested.append((typing.cast(type, tp), f"{prefix}{fl.name}."))
                continue
            default = fl.default if fl.default is not dataclasses.MISSING else fl.default_factory()  # type: ignore[misc]
            rules = []
            if "choices" in fl.metadata:
                rules.append("one of " + ", ".join(f"`{c}`" for c in fl.metadata["choices"]))
            if any(k in fl.metadata for k in ("ge", "gt", "le", "lt")):
                rules.append(_range_text(fl.metadata).removeprefix("allowed range "))
            rows.append(
                f"| `{prefix}{fl.name}` | {_type_name(tp).replace('|', 'or')} | `{default!r}` | {'; '.join(rules)} | {str(fl.metadata.get('help', '')).replace('|', '/')} |"
            )
        if rows:
            lines.extend([f"## `{prefix.rstrip('.') or cls.__name__}`", "", "| field | type | default | allowed | help |", "|---|---|---|---|---|", *rows, ""])
        for sub, sub_prefix in nested:
            walk(sub, sub_prefix)

    for cls in classes:
        lines.extend([f"# {cls.__name__}", "", (cls.__doc__ or "").strip(), ""])
        walk(cls, "")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(config_reference(), end="")
