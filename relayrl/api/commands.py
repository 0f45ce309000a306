"""Configs of the commands besides ``relayrl train``: ``relayrl serve`` (``ServerConfig``) and
``relayrl sft`` (``SFTConfig``). They reuse the run config's sections (model, inference, train
engine, logging); ``docs/config.md`` lists them after the run config (``config_reference``)."""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.api import fields
from relayrl.api.config import (
    InferenceConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    TrainEngineConfig,
    check_file_task,
)
from relayrl.api.fields import f


@dataclass
class ServerConfig:
    """``relayrl serve``: an HTTP server around LocalEngine."""

    model: ModelConfig = f(ModelConfig(), help="Model to serve.")
    inference: InferenceConfig = f(InferenceConfig(), help="Engine settings (max batch, seed).")
    host: str = f("127.0.0.1", help="Bind address; loopback unless told otherwise.")
    port: int = f(30000, help="TCP port (0 = pick a free one and print it).", ge=0, le=65535)
    admin_token: str = f(
        "",
        help="Bearer token required by admin endpoints (better: RELAYRL_ADMIN_TOKEN or --admin-token-file; "
        "empty: a random one, written to a file the server names). Never written to disk by relayrl.",
        secret=True,
    )
    allowed_weight_roots: list[str] = f(
        [], help="Directories /update_weights_from_disk may read (empty = none but uploads)."
    )
    torch_threads: int = f(1, help="torch threads of the server process.", ge=1)
    max_upload_mb: int = f(4096, help="Largest weight upload accepted over HTTP.", ge=1)
    max_request_mb: int = f(64, help="Largest JSON request body (413 beyond, before it is read).", ge=1)
    max_connections: int = f(512, help="Connections and requests served at once (503 beyond).", ge=1)
    body_timeout: float = f(30.0, help="Seconds a client has to send a request body (408 beyond).", gt=0)


# --------------------------------------------------------------------------------------
# Supervised fine-tuning (``relayrl sft``).
# --------------------------------------------------------------------------------------


@dataclass
class SFTDataConfig:
    task: str = f(
        "arithmetic",
        help="'file': read train_path/eval_path; a task (a registered name or 'package.module:function', as the run "
        "config's data.task): its rows as demonstrations.",
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
    difficulty: int = f(
        2, help="Synthetic task: digits / numbers (count: length scale, median 3x numbers).", ge=1, le=6
    )
    error_rate: float = f(0.0, help="Synthetic task: fraction of demonstrations that are wrong.", ge=0.0, le=1.0)

    def validate(self) -> None:
        check_file_task(self.task, self.train_path, self.eval_path)


@dataclass
class SFTConfig:
    """Supervised fine-tuning (``relayrl sft``): loss on completion tokens only."""

    run_dir: str = f("runs/sft", help="Directory for config, metrics.jsonl and the final checkpoint.")
    imports: list[str] = f([], help="Modules imported first (user tasks registered with @register_task).")
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
        TrainEngineConfig(
            optimizer=OptimizerConfig(lr=1e-4, lr_schedule="cosine", warmup_steps=10, min_lr_ratio=0.1), dropout=True
        ),
        help="Train engine (optimizer, schedule, micro-batch token budget); SFT keeps the model's dropout.",
    )
    data: SFTDataConfig = f(SFTDataConfig(), help="SFT data.")
    logging: LoggingConfig = f(LoggingConfig(tensorboard=False), help="Metrics sinks.")


def config_reference(classes: tuple[type, ...] = ()) -> str:
    """Markdown reference of every field of ``classes`` (default: the run, server and SFT configs;
    the content of ``docs/config.md``)."""
    return fields.config_reference(classes or (RunConfig, ServerConfig, SFTConfig))
