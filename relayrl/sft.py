"""Supervised fine-tuning: the loss is the token-mean NLL of completion tokens only.

SFT runs on the same ``TorchTrainEngine`` (packed micro-batches, AdamW, LR schedule,
checkpoints) and the same ``MetricLogger`` (``run_dir/metrics.jsonl``) as RL, so a warm
start and the RL run that follows share everything but the loss.

Rows (from a jsonl / json / parquet file, or a synthetic task's imperfect demonstrations):

- ``{"prompt": str, "completion": str}``: prompt text tokenized as is, then completion + EOS;
- ``{"messages": [...], "completion" | "answer": str}``: the chat template makes the prompt
  (ending with the assistant tag), the completion follows with EOS;
- ``{"messages": [..., {"role": "assistant", "content": c}]}``: the last assistant turn is
  the completion, the turns before it the prompt.

Column names come from ``SFTDataConfig``. Each example is ``(input_ids, loss_mask)`` with
``loss_mask[i] = 1`` on completion tokens (EOS included), token-aligned like RL batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import random
import time
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from relayrl.api.commands import SFTConfig, SFTDataConfig
from relayrl.api.config import save_config
from relayrl.api.engine import TensorDict
from relayrl.api.io import SaveLoadMeta
from relayrl.data.datasets import read_records
from relayrl.data.models import chat_ids, load_tokenizer
from relayrl.train.algorithms import masked_mean
from relayrl.train.engine import TorchTrainEngine
from relayrl.train.packing import token_logprobs
from relayrl.utils.logging import MetricLogger, get_logger
from relayrl.utils.resolve import import_modules

Row = dict[str, object]
Example = tuple[list[int], list[int]]  # (input_ids, loss_mask)

log = get_logger("sft")


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


def encode_row(row: Row, tokenizer: PreTrainedTokenizerBase, cfg: SFTDataConfig) -> Example:
    """``(input_ids, loss_mask)`` of one row; ``ValueError`` says which field is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"expected an object with prompt/completion or messages, got {type(row).__name__}")
    messages = row.get(cfg.messages_key)
    completion = row.get(cfg.completion_key)
    if messages is not None:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise ValueError(f"{cfg.messages_key!r} must be a list of {{'role', 'content'}} turns")
        if completion is None:
            completion = row.get(cfg.answer_key)
        if completion is None and (row.get("tools") or sum(m["role"] == "assistant" for m in messages) > 1):
            # an agent conversation (tool calls, several assistant turns): every assistant turn is learned
            from relayrl.data.chat import conversation_example

            tools = typing.cast(list[dict[str, object]] | None, row.get("tools"))
            return _fits(conversation_example(tokenizer, messages, tools), cfg)
        if completion is None and messages and messages[-1]["role"] == "assistant":
            messages, completion = messages[:-1], messages[-1]["content"]
        if not messages:
            raise ValueError(f"{cfg.messages_key!r} has no prompt turns")
        prompt_ids = chat_ids(tokenizer, messages)
    elif cfg.prompt_key in row:
        prompt = row[cfg.prompt_key]
        if not isinstance(prompt, str):
            raise ValueError(f"{cfg.prompt_key!r} must be a string, got {type(prompt).__name__}")
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    else:
        raise ValueError(f"needs a {cfg.prompt_key!r} or a {cfg.messages_key!r} column; has {sorted(row)}")
    if completion is None:
        raise ValueError(f"needs a {cfg.completion_key!r} (or {cfg.answer_key!r}) column; has {sorted(row)}")
    if not isinstance(completion, (str, int, float)) or isinstance(completion, bool):
        raise ValueError(f"completion must be a string, got {type(completion).__name__}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; SFT appends EOS to every completion")
    completion_ids = tokenizer.encode(str(completion), add_special_tokens=False) + [tokenizer.eos_token_id]
    ids = [int(t) for t in prompt_ids] + completion_ids
    return _fits((ids, [0] * len(prompt_ids) + [1] * len(completion_ids)), cfg)


def _fits(example: Example, cfg: SFTDataConfig) -> Example:
    if len(example[0]) > cfg.max_seq_len:
        raise ValueError(f"{len(example[0])} tokens is longer than data.max_seq_len={cfg.max_seq_len}")
    return example


def encode_rows(
    rows: Sequence[Row], tokenizer: PreTrainedTokenizerBase, cfg: SFTDataConfig, source: str
) -> list[Example]:
    """Encode every row; a bad row stops with its index (or is skipped and counted)."""
    out: list[Example] = []
    for i, row in enumerate(rows):
        try:
            out.append(encode_row(row, tokenizer, cfg))
        except ValueError as e:
            if not cfg.skip_invalid_rows:
                raise ValueError(f"{source} row {i}: {e} (set data.skip_invalid_rows=true to skip bad rows)") from None
    if len(out) < len(rows):
        log.warning("%s: skipped %d invalid rows of %d", source, len(rows) - len(out), len(rows))
    if not out and rows:
        raise ValueError(f"{source}: no valid rows")
    return out


def sft_rows(cfg: SFTDataConfig, seed: int) -> tuple[list[Row], list[Row]]:
    """Training and held-out rows of ``cfg``: files, or a synthetic task's demonstrations
    (``error_rate`` of them wrong) with the task's eval rows (reference answers)."""
    if cfg.task == "file":
        if not cfg.train_path:
            raise ValueError("data.task='file' needs data.train_path")
        return read_records(cfg.train_path), (read_records(cfg.eval_path) if cfg.eval_path else [])
    from relayrl.data.tasks import demonstrations, make_task

    train, held_out = make_task(cfg.task, cfg.n_train, cfg.n_eval, cfg.difficulty, seed)
    return demonstrations(train, cfg.error_rate, seed), held_out


def collate(examples: Sequence[Example]) -> TensorDict:
    """Right-padded ``input_ids``, ``attention_mask``, ``loss_mask`` (``[B, L]``)."""
    ids = [torch.tensor(i, dtype=torch.long) for i, _ in examples]
    return {
        "input_ids": pad_sequence(ids, batch_first=True),
        "attention_mask": pad_sequence([torch.ones_like(i) for i in ids], batch_first=True),
        "loss_mask": pad_sequence([torch.tensor(m, dtype=torch.long) for _, m in examples], batch_first=True),
    }


def batches(examples: Sequence[Example], batch_size: int, seed: int) -> Iterator[tuple[int, list[Example]]]:
    """Endless ``(epoch, batch)`` stream; reshuffled (seeded) every epoch, last partial batch kept."""
    rng = random.Random(seed)
    for epoch in itertools.count():
        order = list(range(len(examples)))
        rng.shuffle(order)
        for s in range(0, len(order), batch_size):
            yield epoch, [examples[i] for i in order[s : s + batch_size]]


# --------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------


def sft_loss_fn(logits: torch.Tensor, packed: TensorDict) -> torch.Tensor:
    """Token-mean NLL over the micro-batch's completion tokens (``loss_mask == 1``)."""
    return -masked_mean(token_logprobs(logits, packed), packed["loss_mask"].to(logits.device))


def sft_loss_weight(packed: TensorDict) -> float:
    """Completion tokens of the micro-batch: the batch loss is then the exact token-mean."""
    return float(packed["loss_mask"].sum())


# --------------------------------------------------------------------------------------
# Loop
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class SFTResult:
    steps: int
    loss: float  # mean training loss over the last log window
    eval_loss: float | None
    seconds: float
    checkpoint: str | None  # run_dir/final, when saved
    model: PreTrainedModel  # the trained model (the engine's, still in memory)


def run_sft(
    cfg: SFTConfig,
    tokenizer: PreTrainedTokenizerBase | None = None,
    model: PreTrainedModel | None = None,
    train_rows: Sequence[Row] | None = None,
    eval_rows: Sequence[Row] | None = None,
    logger: MetricLogger | None = None,
    stop_fn: Callable[[int, PreTrainedModel], bool] | None = None,
) -> SFTResult:
    """Fine-tune on ``train_rows`` (default: from ``cfg.data``); loss on completion tokens.

    ``model`` (default: built from ``cfg.model``) is trained in place. Metrics go to
    ``run_dir/metrics.jsonl`` (``sft/loss``, ``sft/grad_norm``, ``sft/lr``, ``eval/loss``);
    the final HF checkpoint (with tokenizer) to ``run_dir/final`` when ``save_final``.
    ``stop_fn(step, model)``, asked every ``log_every_n_steps``, ends training early when true
    (e.g. once a probe accuracy is reached).
    """
    t0 = time.monotonic()
    torch.set_num_threads(cfg.torch_threads)
    tokenizer = tokenizer or load_tokenizer(cfg.model)
    import_modules(cfg.imports)  # user tasks registered with @register_task
    if train_rows is None:
        train_rows, default_eval = sft_rows(cfg.data, cfg.seed)
        eval_rows = default_eval if eval_rows is None else eval_rows
    train_ex = encode_rows(train_rows, tokenizer, cfg.data, "train")
    if not train_ex:
        raise ValueError("SFT needs at least one training row")
    eval_ex = encode_rows(eval_rows or [], tokenizer, cfg.data, "eval")
    total = cfg.total_steps or cfg.epochs * math.ceil(len(train_ex) / cfg.batch_size)
    train_cfg = dataclasses.replace(cfg.train, total_steps=cfg.train.total_steps or total)
    engine = TorchTrainEngine(train_cfg, cfg.model, model=model, seed=cfg.seed)
    engine.initialize()
    if logger is None:
        save_config(cfg, cfg.run_dir)

    def eval_loss() -> float | None:
        if not eval_ex:
            return None
        engine.eval()
        total_loss = total_w = 0.0
        for s in range(0, len(eval_ex), 256):
            b = collate(eval_ex[s : s + 256])
            w = float(b["loss_mask"].sum())
            total_loss += engine.eval_batch(b, sft_loss_fn, sft_loss_weight) * w
            total_w += w
        engine.train()
        return total_loss / total_w

    window: list[float] = []
    ev: float | None = None
    stream = batches(train_ex, cfg.batch_size, cfg.seed)
    sink = MetricLogger.from_config(cfg.logging, cfg.run_dir, cfg) if logger is None else contextlib.nullcontext(logger)
    with sink as logger:  # a logger passed in stays open
        engine.train()
        for step in range(1, total + 1):
            epoch, examples = next(stream)
            stats = engine.train_batch(collate(examples), sft_loss_fn, sft_loss_weight)
            window.append(stats["loss"])
            metrics = {f"sft/{k}": v for k, v in stats.items()} | {"sft/epoch": float(epoch)}
            if step == total or (cfg.eval_every_n_steps and step % cfg.eval_every_n_steps == 0):
                ev = eval_loss()
                if ev is not None:
                    metrics["eval/loss"] = ev
            logger.log(metrics, step=step)
            if step % cfg.log_every_n_steps == 0 or step == total:
                mean = sum(window) / len(window)
                extra = f" eval_loss {ev:.4f}" if ev is not None and "eval/loss" in metrics else ""
                log.info("sft step %d/%d loss %.4f lr %.2e%s", step, total, mean, stats["lr"], extra)
                if step < total:
                    window = []
                if stop_fn is not None and step < total and stop_fn(step, engine._require()):
                    log.info("sft: stop_fn ended training at step %d", step)
                    total, window, ev = step, [stats["loss"]], eval_loss()
                    if ev is not None:
                        logger.log({"eval/loss": ev}, step=step)
                    break
        checkpoint = None
        if cfg.save_final:
            checkpoint = str(Path(cfg.run_dir) / "final")
            engine.save(SaveLoadMeta(path=checkpoint))
            tokenizer.save_pretrained(checkpoint)
    mean_loss = sum(window) / max(1, len(window))
    return SFTResult(total, mean_loss, ev, time.monotonic() - t0, checkpoint, engine._require())
