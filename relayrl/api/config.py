"""The config of a run (``relayrl train``: ``RunConfig`` and its sections): dataclasses with ``help``
metadata, validated at load time. ``relayrl serve`` and ``relayrl sft`` configs: ``relayrl.api.commands``.

Load a run config from YAML plus dotted overrides::

    cfg = load_config(RunConfig, "recipes/grpo.yaml", ["train.optimizer.lr=1e-5", "rollout.max_staleness=2"])

Sections with a module of their own (importable from here too): ``inference`` (``relayrl.api.inference``),
``actor.teacher`` (``relayrl.api.distill``), ``actor.rollout_correction`` (``relayrl.api.mismatch``).
How fields are declared, loaded and checked is ``relayrl.api.fields`` (its public functions are
importable from here too). ``docs/config.md`` is generated from these classes by
``relayrl.api.commands.config_reference()``.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, replace

from relayrl.api.distill import TeacherConfig
from relayrl.api.fields import (
    ConfigError,
    YamlValue,
    f,
    load_config,
    parse_override,
    save_config,
    to_plain_dict,
    validate_config,
)
from relayrl.api.inference import InferenceConfig
from relayrl.api.io import GenerationConfig
from relayrl.api.mismatch import RolloutCorrectionConfig

__all__ = ["ConfigError", "load_config", "parse_override", "save_config", "validate_config"]


def sampling_temperature(g: GenerationConfig) -> float:
    """The temperature of the distribution a generator's logprobs come from (greedy: softmax(logits))."""
    return 1.0 if g.greedy else g.temperature


# --------------------------------------------------------------------------------------
# Config classes. Each section documents its own fields; recipes/ show them in use.
# --------------------------------------------------------------------------------------


@dataclass
class LoraConfig:
    rank: int = f(0, help="LoRA rank of the policy's adapters (peft); 0 = off (full fine-tuning).", ge=0)
    alpha: float = f(16.0, help="LoRA alpha: the adapter's update is scaled by alpha / rank.", gt=0.0)
    dropout: float = f(0.0, help="Dropout on the adapters' input during training.", ge=0.0, lt=1.0)
    target_modules: list[str] = f(
        [],
        help="Module name suffixes (or one regex) that get adapters; empty = every linear projection of the "
        "decoder layers (attention and MLP).",
    )
    adapter_path: str = f(
        "",
        help="A peft adapter directory merged into the model at model.path when it loads (eval, serve, or a "
        "start point for training).",
    )
    sync: str = f(
        "auto",
        help="What a LoRA trainer sends to SGLang / vLLM servers: 'adapter' (the peft adapter, written to "
        "inference.weight_sync_dir and loaded as relayrl-<run>-v<version>; the servers need --enable-lora), 'merged' "
        "(full weights with the adapter merged in), 'auto' (adapter when inference.protocol is sglang or vllm, "
        "weight_sync_dir is set and every server loads adapters at run time, else merged). In-process engines and relayrl servers always get merged weights.",
        choices=["auto", "merged", "adapter"],
    )


@dataclass
class ModelConfig:
    path: str = f(
        "tiny",
        help="HF model directory, a .gguf file (converted once into $RELAYRL_CACHE: docs/real_models.md), or 'tiny' / 'tiny-30m' (a text model) or 'tiny-vl' / 'tiny-vl2.5' (Qwen2-VL / Qwen2.5-VL, takes images) built from a config in code.",
    )
    tokenizer_path: str = f(
        "", help="Tokenizer directory; empty means the model path (or the offline tokenizer for tiny models)."
    )
    chat_template: str = f(
        "",
        help="The chat template prompts are rendered with: empty = the tokenizer's own; 'hermes' / 'llama3' = relayrl's tool-calling templates (for models whose template renders no tools, e.g. SmolLM2; hermes keeps the model's default system prompt); else a Jinja file.",
    )
    dtype: str = f("float32", help="Parameter dtype.", choices=["float32", "bfloat16", "float16"])
    attn_impl: str = f(
        "auto",
        help="Attention for packed training: 'varlen' (relayrl per-document), 'flash' (flash-attn), 'auto'.",
        choices=["auto", "varlen", "flash", "sdpa"],
    )
    gradient_checkpointing: bool = f(False, help="Recompute activations in backward to save memory.")
    vocab_size: int = f(0, help="Override the vocabulary size of a tiny model (0 = tokenizer's).", ge=0)
    lora: LoraConfig = f(LoraConfig(), help="LoRA adapters (parameter-efficient training; docs/lora.md).")


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
    mb_max_tokens: int = f(
        8192, help="Token budget of one packed micro-batch (an image's vision patches count as tokens).", ge=16
    )
    bf16: bool = f(False, help="bf16 autocast (GPU only; ignored on CPU).")
    dropout: bool = f(
        False, help="Keep the model config's dropout while training (RL: off, so the trainer scores what was sampled)."
    )
    shared_prefix: str = f(
        "auto",
        help="'auto': rows of a micro-batch that share at least 16 leading tokens (a GRPO group's prompt) compute "
        "them once in the built-in actor loss's forward and backward and in the no-grad logprob forwards, with the "
        "same results (single process, relayrl_varlen attention, no LoRA / MoE / images / autocast); 'off': every "
        "row computes its own prompt.",
        choices=["auto", "off"],
    )
    fsdp: bool = f(True, help="Shard with FSDP2 when torch.distributed runs with more than one rank.")
    max_nan_skips: int = f(3, help="Consecutive non-finite steps skipped before the run stops.", ge=0)
    collective_timeout: float = f(
        1800.0,
        help="Seconds a trainer rank waits in a collective or barrier for the other ranks (the process group's "
        "timeout, gloo and NCCL; under torchrun); past it the run stops naming the wait.",
        gt=0.0,
    )
    total_steps: int = f(0, help="Optimizer steps for the LR schedule (0 = taken from the trainer).", ge=0)


@dataclass
class RolloutConfig:
    batch_size: int = f(8, help="Prompts per training step (each yields group_size episodes).", ge=1)
    group_size: int = f(4, help="Episodes per prompt (GRPO group).", ge=1)
    max_staleness: int = f(0, help="eta: most versions a trajectory may lag the trainer; 0 = synchronous RL.", ge=0)
    max_concurrent_rollouts: int = f(
        0, help="Most prompts in flight at once (0 = batch_size * (max_staleness + 1)).", ge=0
    )
    dynamic_filter: bool = f(
        False, help="DAPO dynamic sampling: drop groups whose rewards are all equal and over-sample."
    )
    filter_patience: int = f(
        20,
        help="Stop with an error when this many batch_size-worth of groups in a row were filtered "
        "(dynamic_filter or accept fn) while one batch was being filled: the task gives no learning signal (0 = never).",
        ge=0,
    )
    max_failure_rate: float = f(
        0.5, help="Stop the run when more than this fraction of recent episodes failed.", ge=0.0, le=1.0
    )
    failure_window: int = f(50, help="Episodes over which the failure rate is measured.", ge=1)
    tail_batch: str = f(
        "requeue",
        help="What happens to aborted/expired prompts: discard, requeue (at once), requeue_after (N pile up).",
        choices=["discard", "requeue", "requeue_after"],
    )
    tail_batch_trigger: int = f(8, help="requeue_after: prompts that pile up before they are re-run together.", ge=1)
    reward_timeout: float = f(30.0, help="Seconds before one reward call is abandoned (counted as failed).", gt=0.0)
    batch_timeout: float = f(
        7200.0,
        help="Seconds the trainer waits for one batch of rollouts; past it the run stops with one line saying "
        "how many groups were ready, running and queued.",
        gt=0.0,
    )
    reward_workers: int = f(0, help="Reward worker processes (0 = run reward fns in the rollout thread).", ge=0)
    max_turns: int = f(
        2,
        help="workflow=multi_turn: most attempts per episode (a wrong answer gets feedback and another try); "
        "workflow=openenv: most actions per episode.",
        ge=1,
    )
    turn_discount: float = f(
        0.9, help="workflow=multi_turn: the reward of attempt t is multiplied by turn_discount**t.", gt=0.0, le=1.0
    )
    max_tool_calls: int = f(3, help="workflow=tool_agent: most tool calls per episode.", ge=0)
    tool: str = f(
        "calc",
        help="workflow=tool_agent: the sandboxed tool (calc: arithmetic; python: restricted Python).",
        choices=["calc", "python"],
    )
    tool_timeout: float = f(
        5.0,
        help="workflow=tool_agent: seconds of wall time one tool call may take (its child also gets "
        "tool_timeout+1 CPU seconds); past it the model reads 'error: timed out'. Starting the child is "
        "part of it: a loaded machine needs a few seconds for that alone.",
        gt=0.0,
    )
    tool_format: str = f(
        "markers",
        help="workflow=tool_agent: markers (call_start/call_end text) or template (the chat template's "
        "tool calling, Hermes/Qwen2.5 or Llama-3.1, through relayrl.agents).",
        choices=["markers", "template"],
    )


@dataclass
class ActorConfig:
    adv_estimator: str = f(
        "grpo",
        help="Advantage estimator, a name registered with @register_advantage: grpo, dr_grpo, rloo, reinforce, reinforce_pp, remax, gae, or your own, or 'package.module:function' (checked when the trainer or actor is built, before any model loads).",
    )
    loss: str = f(
        "ppo",
        help="Policy loss, a name registered with @register_loss: ppo, decoupled_ppo, gspo, reinforce, distill (reverse KL to actor.teacher alone), or your own, or 'package.module:function' (checked when the trainer or actor is built, before any model loads).",
    )
    eps_clip: float = f(
        0.2, help="PPO clip range (lower side, and upper unless eps_clip_higher is set).", gt=0.0, lt=1.0
    )
    eps_clip_higher: float | None = f(
        None, help="DAPO clip-higher: upper clip range; None = eps_clip.", gt=0.0, lt=10.0
    )
    c_clip: float | None = f(None, help="Dual-clip factor for negative advantages, must be > 1; None disables.", gt=1.0)
    behav_imp_weight_cap: float | None = f(5.0, help="Decoupled PPO: cap on pi_prox / pi_behav; None disables.", gt=1.0)
    behav_imp_weight_floor: float | None = f(
        None, help="Decoupled PPO: weights below this leave the loss (a lower bound; None = none).", gt=0.0, lt=1.0
    )
    behav_weight_level: str = f(
        "token",
        help="Decoupled PPO: one behaviour weight per token (AReaL) or per sequence "
        "(the geometric mean of its tokens').",
        choices=["token", "sequence"],
    )
    behav_weight_clip: str = f(
        "mask",
        help="Decoupled PPO: a weight above the cap leaves the loss (mask, AReaL) or is cut to the cap (truncate).",
        choices=["mask", "truncate"],
    )
    kl_coef: float = f(0.0, help="KL(pi || ref) coefficient (0 disables the reference model).", ge=0.0)
    kl_estimator: str = f("k3", help="KL estimator.", choices=["k1", "k2", "k3"])
    kl_in_reward: bool = f(False, help="Apply KL as a per-token reward penalty instead of a loss term.")
    entropy_coef: float = f(0.0, help="Entropy bonus coefficient.", ge=0.0)
    loss_agg_mode: str = f(
        "token-mean",
        help="How token losses become one number (seq-mean-token-sum-norm divides by n_seqs * loss_norm_len: Dr.GRPO).",
        choices=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
    )
    loss_norm_len: int = f(
        0, help="seq-mean-token-sum-norm: the constant per-sequence divisor, usually gconfig.max_new_tokens.", ge=0
    )
    temperature: float | None = f(
        None,
        help="Temperature the trainer recomputes logprobs at. None (default) = gconfig.temperature, the one the "
        "rollouts were sampled at (1.0 for greedy rollouts, or for an actor built alone); a different value is a load-time error.",
        gt=0.0,
    )
    ppo_epochs: int = f(1, help="Passes over each batch.", ge=1)
    n_minibatches: int = f(1, help="Optimizer steps per pass.", ge=1)
    recompute_logp: bool | None = f(
        None,
        help="PPO-style losses: the ratio's old logprobs from the trainer (true) or the generator (false). None "
        "(default): the trainer's when the batch is on-policy (every loss token made by the current weights: exact and "
        "reproducible), the generator's when it is stale, so the clip is a trust region around the policy that generated "
        "the tokens (recomputing would anchor it at the current policy). decoupled_ppo always recomputes (its proximal policy).",
    )
    reuse_update_logp: bool = f(
        True,
        help="With ppo_epochs=1 and n_minibatches=1 the policy before the update is the one the update's own "
        "forward runs: its detached logprobs serve as the old / proximal ones, saving a forward pass per step "
        "(identical unless the model has dropout).",
    )
    reward_scale: float = f(1.0, help="Rewards are multiplied by this ...", gt=0.0)
    reward_bias: float = f(0.0, help="... then shifted by this ...")
    reward_clip: float = f(0.0, help="... then clipped to [-c, c] (0 disables).", ge=0.0)
    overlong_buffer: int = f(
        0, help="DAPO overlong penalty: tokens before max_new_tokens where the penalty ramps (0 disables).", ge=0
    )
    overlong_penalty: float = f(1.0, help="DAPO overlong penalty at max_new_tokens.", ge=0.0)
    overlong_max_len: int = f(
        0,
        help="DAPO overlong penalty: the generation limit (gconfig.max_new_tokens); needed when overlong_buffer > 0.",
        ge=0,
    )
    mask_truncated: bool = f(False, help="Drop completions that hit max_new_tokens from the loss.")
    gamma: float = f(1.0, help="Discount for GAE / REINFORCE returns.", ge=0.0, le=1.0)
    lam: float = f(1.0, help="GAE lambda.", ge=0.0, le=1.0)
    adv_norm: bool = f(
        True,
        help="grpo: divide by group std; reinforce_pp: normalise over the batch; gae: whiten over "
        "the batch's loss tokens (as verl / TRL PPO).",
    )
    adv_eps: float = f(
        1e-6, help="grpo / reinforce_pp: added to the std before dividing; gae: to the variance.", gt=0.0
    )
    baseline: bool = f(True, help="reinforce: subtract the batch-mean reward as a baseline.")
    value_clip: float = f(0.2, help="Critic: value clipping range.", gt=0.0)
    critic_lr: float = f(1e-5, help="Critic learning rate (PPO with critic).", gt=0.0)
    replay_routing: bool = f(
        True,
        help="MoE models: the trainer's forward uses the experts the generator chose for each token (the batch's "
        "routed_experts) instead of its own top-k; gate weights still come from the trainer's router. No effect on "
        "dense models or batches without routed_experts.",
    )
    rollout_correction: RolloutCorrectionConfig = f(
        RolloutCorrectionConfig(),
        help="Truncated / masked importance sampling against the generator (docs/mismatch.md).",
    )
    distill_coef: float = f(
        0.0,
        help="On-policy distillation added to any policy loss: distill_coef x the per-token reverse KL from the "
        "policy to actor.teacher on the policy's own tokens (docs/distillation.md); 0 = off.",
        ge=0.0,
    )
    teacher: TeacherConfig = f(
        TeacherConfig(), help="The teacher of actor.loss=distill / actor.distill_coef (docs/distillation.md)."
    )
    moe_aux_loss_coef: float = f(
        0.0,
        help="MoE models: coefficient of the load-balancing auxiliary loss added to the policy loss (logged as "
        "moe_aux_loss whatever the coefficient).",
        ge=0.0,
    )

    def validate(self) -> None:
        """Cross-field rules (``ValueError`` naming the fields; field prefix added by the loader)."""
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_norm_len <= 0:
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' needs loss_norm_len > 0 (e.g. gconfig.max_new_tokens)"
            )


@dataclass
class DataConfig:
    task: str = f(
        "arithmetic",
        help="'file' to read train_path/eval_path; a synthetic task: arithmetic, countdown, count, count_squares "
        "(images: needs a vision-language model), 'reasoning_gym:NAME' (a reasoning-gym generator, scored by its "
        "own score_answer; docs/environments.md), a name registered with @register_task, or "
        "'package.module:function' returning (train_rows, eval_rows).",
    )
    task_kwargs: dict[str, YamlValue] = f(
        {},
        help="Keyword arguments for the task function (e.g. arithmetic: ops='+-'; reasoning_gym:NAME: the "
        "generator's config fields, and system_prompt).",
    )
    train_path: str = f("", help="jsonl / parquet / json file of training rows (task=file).")
    eval_path: str = f("", help="Held-out rows (task=file).")
    prompt_key: str = f("question", help="Column holding the prompt text (or 'messages' for chat rows).")
    answer_key: str = f("answer", help="Column holding the reference answer.")
    n_train: int = f(2000, help="Synthetic task: training prompts.", ge=1)
    n_eval: int = f(200, help="Synthetic task: held-out prompts.", ge=1)
    max_prompt_len: int = f(1024, help="Prompts longer than this (tokens) are rejected.", ge=1)
    prompt_format: str = f(
        "chat",
        help="chat: the tokenizer's chat template; plain: the prompt text as is (base models; "
        "chosen with a warning when the tokenizer has no chat template).",
        choices=["chat", "plain"],
    )
    skip_invalid_rows: bool = f(False, help="Skip (and count) bad rows instead of stopping with an error.")
    shuffle: bool = f(True, help="Shuffle the training set each epoch (seeded).")
    difficulty: int = f(
        2, help="Synthetic task: number of digits / operands (count: length scale, median 3x numbers).", ge=1, le=6
    )

    def validate(self) -> None:
        check_file_task(self.task, self.train_path, self.eval_path)


def check_file_task(task: str, train_path: str, eval_path: str) -> None:
    """A data file named beside a synthetic task would be ignored without a word: refuse it
    (``data`` and ``relayrl sft``'s ``data`` share the rule)."""
    named = " and ".join(name for name, path in (("train_path", train_path), ("eval_path", eval_path)) if path)
    if named and task != "file":
        raise ValueError(
            f"{named} would be ignored: data.task={task!r} is a synthetic task; add data.task=file to use the "
            f"file (or drop {named} to use the task)"
        )


@dataclass
class EvalConfig:
    every_n_steps: int = f(0, help="Evaluate every N steps (0 = never, except before/after when asked).", ge=0)
    before_training: bool = f(False, help="Evaluate once before the first step.")
    gconfig: GenerationConfig = f(
        GenerationConfig(greedy=True, max_new_tokens=32),
        help="Generation for evaluation. Fields left unset take the training gconfig's value, except greedy (default true).",
    )
    n_samples: int = f(1, help="Samples per prompt; >1 reports pass@k as well.", ge=1)
    max_prompts: int = f(0, help="Evaluate on at most this many prompts (0 = all).", ge=0)


@dataclass
class CheckpointConfig:
    every_n_steps: int = f(0, help="Save every N steps (0 = off).", ge=0)
    every_minutes: float = f(0.0, help="Save when this many minutes passed since the last save (0 = off).", ge=0.0)
    keep_last: int = f(2, help="Checkpoints kept on disk.", ge=1)
    save_final: bool = f(True, help="Save at the end of training (and on Ctrl-C or SIGTERM: the last complete step).")


@dataclass
class LoggingConfig:
    tensorboard: bool = f(True, help="Write TensorBoard event files.")
    wandb: bool = f(False, help="Log to Weights & Biases.")
    wandb_mode: str = f("offline", help="W&B mode.", choices=["online", "offline", "disabled"])
    wandb_project: str = f("relayrl", help="W&B project.")
    rollouts_per_step: int = f(
        256,
        help="Rollouts saved per step (whole GRPO groups first) with per-token ids, logprobs, advantages and "
        "versions, for `relayrl show` and `relayrl inspect`; 0 saves none. The default keeps every rollout of "
        "small runs (about 30 bytes a token).",
        ge=0,
        le=1_000_000,
    )
    doctor_every: int = f(
        50, help="Save what `relayrl doctor` replays (weights + batch) at step 1 and every N-th step (0 = never).", ge=0
    )
    progress: str = f(
        "auto",
        help="Progress display: auto (a live bar on a terminal, lines otherwise), bar, lines, off.",
        choices=["auto", "bar", "lines", "off"],
    )


@dataclass
class RayConfig:
    """``launcher=ray``: where the trainer ranks and servers run (docs/scale_out.md)."""

    address: str = f(
        "",
        help="Ray cluster to join: host:port of its head (GCS), 'auto' (the cluster started on this node), "
        "or empty: the cluster in RAY_ADDRESS when set (`ray job submit`), else a new one on this machine.",
    )
    num_cpus: int = f(0, help="CPUs of a Ray instance started here (address empty; 0 = all of this machine's).", ge=0)
    trainer_ranks: int = f(1, help="Trainer ranks (Ray actors forming the torch.distributed group).", ge=1)
    trainer_cpus: float = f(1.0, help="CPUs reserved per trainer rank (fractions allowed).", ge=0.0)
    trainer_gpus: float = f(0.0, help="GPUs per trainer rank (1 for FSDP2 over NCCL; 0 = gloo on CPU).", ge=0.0)
    server_cpus: float = f(1.0, help="CPUs reserved per inference server (inference.n_servers of them).", ge=0.0)
    server_gpus: float = f(0.0, help="GPUs per inference server.", ge=0.0)
    strategy: str = f(
        "PACK",
        help="Placement strategy of the trainer and server bundles (Ray placement group).",
        choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
    )
    placement_timeout: float = f(
        120.0, help="Seconds to wait for the cluster to place every bundle before failing.", gt=0.0
    )
    server_max_restarts: int = f(
        5, help="Times Ray restarts a dead server actor (it is re-admitted on return); -1 = without limit.", ge=-1
    )


@dataclass
class WatchdogConfig:
    stall_s: float = f(
        1800.0,
        help="When no training step has finished for this many seconds, write every thread's stack, the rollout "
        "loop's tasks and the executor/engine state to RUN_DIR/stall_<step>.txt and one line to the log "
        "(0 = off). Again after each further stall_s.",
        ge=0.0,
    )
    action: str = f(
        "dump",
        help="After the dump: 'dump' keeps waiting; 'exit' ends the process (exit code 75: resume with --recover).",
        choices=["dump", "exit"],
    )


@dataclass
class RunConfig:
    """A whole training run (``relayrl train``)."""

    run_dir: str = f("runs/default", help="Directory for config, metrics, checkpoints and rollouts.")
    seed: int = f(1, help="Global seed (data order, init, sampling).")
    total_steps: int = f(100, help="Training steps (one batch and one weight update each).", ge=1)
    torch_threads: int = f(1, help="torch threads per process (1 is fastest on small shared CPUs).", ge=1)
    recover: str = f(
        "off",
        help="off; auto (resume if a checkpoint exists); resume (must resume).",
        choices=["off", "auto", "resume"],
    )
    imports: list[str] = f(
        [], help="Modules imported first, so their @register_* decorators add user workflows, rewards, tasks, losses."
    )
    workflow: str = f(
        "rlvr",
        help="Rollout workflow: rlvr, multi_turn, remax, tool_agent, openenv (an OpenEnv server; docs/environments.md), "
        "a name registered with @register_workflow, or 'package.module:attr' (a RolloutWorkflow subclass or a "
        "function returning one; docs/extend.md; verifiers: relayrl.agents.verifiers:VerifiersWorkflow).",
    )
    workflow_kwargs: dict[str, YamlValue] = f(
        {}, help="Keyword arguments for the workflow (after the standard ones its signature names)."
    )
    reward_fn: str = f(
        "",
        help="Reward function: empty = the task's verifier (math-verify gsm8k for data.task=file, score_answer for reasoning_gym:NAME); a registered name "
        "(arithmetic, countdown, count, gsm8k, reasoning_gym, or @register_reward) or 'package.module:function'.",
    )
    reward_kwargs: dict[str, YamlValue] = f({}, help="Keyword arguments bound to the reward function.")
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
    watchdog: WatchdogConfig = f(WatchdogConfig(), help="What a run that stops making progress writes, and does.")
    launcher: str = f(
        "local",
        help="local: this process (or torchrun's ranks) trains and n_servers start here; ray: trainer ranks and "
        "servers are Ray actors placed by `ray` (`relayrl train` only).",
        choices=["local", "ray"],
    )
    ray: RayConfig = f(RayConfig(), help="launcher=ray: cluster, resources per trainer rank and server, placement.")

    def __post_init__(self) -> None:
        # shown resolved in a loaded or saved config (a copy: an ActorConfig passed in is not written to);
        # the run itself takes it from ``derived``, which resolves it the same way
        if self.actor.temperature is None:  # one source of truth: the sampling temperature
            self.actor = replace(self.actor, temperature=sampling_temperature(self.gconfig))

    @staticmethod
    def inherit(values: dict[str, YamlValue]) -> None:
        """Before building: ``eval.gconfig`` starts from the training ``gconfig`` with ``greedy: true``,
        so a length, stop or temperature set once applies to both (load_config calls this)."""
        train_g, ev = values.get("gconfig", {}), values.get("eval", {})
        if not isinstance(train_g, dict) or not isinstance(ev, dict) or not isinstance(ev.get("gconfig", {}), dict):
            return  # a malformed section: building reports it
        base = to_plain_dict(GenerationConfig(max_new_tokens=32))  # RunConfig.gconfig's default
        ev_g = typing.cast(dict[str, YamlValue], ev.get("gconfig", {}))
        values["eval"] = {**ev, "gconfig": {**base, **train_g, "greedy": True, **ev_g}}

    def validate(self) -> None:
        """Rules across sections (checked after each section's own): ``actor.temperature``, when set, is
        the sampling temperature (one source of truth); the overlong buffer fits the generation limit."""
        if self.actor.temperature not in (None, sampling_temperature(self.gconfig)):
            raise ValueError(
                f"actor.temperature={self.actor.temperature} differs from the rollouts' sampling temperature "
                f"(gconfig.temperature={self.gconfig.temperature}, greedy={self.gconfig.greedy}): the importance ratios "
                "would compare logprobs of two distributions. Set gconfig.temperature only (actor.temperature follows it)"
            )
        if self.launcher == "ray" and self.inference.n_servers and self.inference.launch_gpus:
            raise ValueError(
                f"inference.launch_gpus={self.inference.launch_gpus} with launcher=ray: Ray hands each server "
                "its GPUs (ray.server_gpus); leave launch_gpus empty"
            )
        check_overlong(self.actor, self.actor.overlong_max_len or self.gconfig.max_new_tokens)

    def derived(self) -> RunConfig:
        """What the run uses, derived once from a validated config and never written back into it:
        ``actor.temperature`` the sampling temperature, ``actor.overlong_max_len`` the generation
        limit (DAPO's penalty ramps up to it) and ``train.total_steps`` the optimizer steps of the
        LR schedule, where they are left unset."""
        a, t = self.actor, self.train
        actor = replace(
            a,
            temperature=sampling_temperature(self.gconfig),
            overlong_max_len=a.overlong_max_len or (self.gconfig.max_new_tokens if a.overlong_buffer else 0),
        )
        steps = t.total_steps or (
            self.total_steps * a.ppo_epochs * a.n_minibatches if t.optimizer.lr_schedule != "constant" else 0
        )
        return replace(self, actor=actor, train=replace(t, total_steps=steps))


def check_overlong(actor: ActorConfig, limit: int) -> None:
    """DAPO's overlong penalty ramps over the ``overlong_buffer`` tokens before the generation ``limit``
    (``actor.overlong_max_len``, or in a run ``gconfig.max_new_tokens``): the buffer must be shorter."""
    if actor.overlong_buffer and limit <= actor.overlong_buffer:
        raise ValueError(
            f"actor.overlong_buffer={actor.overlong_buffer} must be below the generation limit "
            f"(actor.overlong_max_len or gconfig.max_new_tokens = {limit})"
        )
