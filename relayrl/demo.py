"""The CPU demo: a tiny char-level model learns 2-digit addition, first by imitating
imperfect demonstrations (SFT), then by RL against the verifier.

Everything is built in code (model, tokenizer, task), so it runs offline on a laptop CPU:

1. ``make_task("arithmetic")`` -> training / held-out prompts with reference answers;
2. ``demonstrations(error_rate)`` -> SFT pairs of which ``error_rate`` are plausibly wrong;
3. SFT warm start (``run_sft``) of the ``demo`` model: the model learns addition well enough
   that greedy decoding is mostly right, but it also imitates the mistakes, so its
   *sampled* (temperature 1) accuracy is clearly short of perfect;
4. RL (GRPO, hook ``rl``) sharpens the policy towards the verified answers;
5. held-out sampled accuracy before and after, one JSON line at the end.

The recipe's numbers (``DemoSettings``) come from the tuning runs in ``notes/demo_tuning.md``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from relayrl.api.config import (
    InferenceConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    SFTConfig,
    SFTDataConfig,
    TrainEngineConfig,
)
from relayrl.api.io import GenerationConfig
from relayrl.data.models import build_tokenizer
from relayrl.data.tasks import demonstrations, make_task
from relayrl.evaluation import evaluate
from relayrl.rewards.tasks import task_reward_fn
from relayrl.sft import SFTResult, run_sft
from relayrl.utils.logging import MetricLogger, get_logger

log = get_logger("demo")
Row = dict[str, object]

# ~0.6M parameters: small enough that SFT + GRPO fit in minutes on 2 CPU cores, large enough
# to learn 2-digit addition (the 5M ``tiny`` preset learns no faster per second on a CPU).
DEMO_MODEL = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}


@dataclasses.dataclass
class DemoSettings:
    """The demo's recipe (see notes/demo_tuning.md for how these were chosen)."""

    difficulty: int = 2  # digits per operand
    n_train: int = 2000
    n_eval: int = 200
    error_rate: float = 0.3  # fraction of wrong demonstrations
    sft_steps: int = 1000  # at most; SFT stops once greedy accuracy on a probe of
    sft_probe_every: int = 100  # training prompts reaches sft_stop_greedy (the moment
    sft_stop_greedy: float = 0.6  # addition is learned varies by seed: ~300-700 steps)
    sft_batch_size: int = 128
    sft_lr: float = 3e-3  # constant after warmup: addition is learned in a phase transition
    sft_warmup_steps: int = 50  # that a decaying LR can miss (notes/demo_tuning.md)
    eval_samples: int = 4  # samples per held-out prompt for the sampled accuracy
    max_new_tokens: int = 8
    torch_threads: int = 1


def build_demo_model(seed: int = 0) -> PreTrainedModel:
    """The demo's randomly initialised Qwen2-style model over the offline char tokenizer."""
    tok = build_tokenizer()
    cfg = AutoConfig.for_model(
        "qwen2", vocab_size=len(tok), max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, **DEMO_MODEL,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def generation_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A copy for decoding: KV cache on, standard attention (the train engine packs instead)."""
    gen = copy.deepcopy(model).eval()
    gen.config.use_cache = True
    gen.set_attn_implementation("sdpa")
    return gen


def held_out_accuracy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: list[Row], n_samples: int = 4,
    max_new_tokens: int = 8, seed: int = 0,
) -> dict[str, float]:
    """``sampled``: mean accuracy of ``n_samples`` temperature-1 samples per prompt;
    ``greedy``: accuracy of argmax decoding. Uses ``LocalEngine`` on a copy of ``model``."""
    from relayrl.inference.local import LocalEngine

    engine = LocalEngine(InferenceConfig(seed=seed, max_batch_size=256), model=generation_copy(model), tokenizer=tokenizer)
    engine.initialize()
    reward_fn = task_reward_fn("arithmetic")
    try:
        g = GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, top_k=0)
        sampled = evaluate(engine, tokenizer, rows, g, reward_fn, n_samples=n_samples)
        greedy = evaluate(engine, tokenizer, rows, g.new(greedy=True), reward_fn, n_samples=1)
    finally:
        engine.destroy()
    return {"sampled": sampled.get("eval/accuracy_mean", sampled["eval/accuracy"]), "greedy": greedy["eval/accuracy"]}


def warm_start(
    s: DemoSettings, train: list[Row], held_out: list[Row], run_dir: Path, seed: int, logger: MetricLogger,
) -> SFTResult:
    """SFT on imperfect demonstrations of ``train`` (``s.error_rate`` of them wrong)."""
    cfg = SFTConfig(
        run_dir=str(run_dir / "sft"), seed=seed, torch_threads=s.torch_threads, total_steps=s.sft_steps,
        batch_size=s.sft_batch_size, log_every_n_steps=s.sft_probe_every, save_final=True,
        model=ModelConfig(path="tiny"),
        train=TrainEngineConfig(optimizer=OptimizerConfig(
            lr=s.sft_lr, lr_schedule="constant", warmup_steps=s.sft_warmup_steps,
        )),
        data=SFTDataConfig(task="arithmetic", difficulty=s.difficulty, error_rate=s.error_rate),
        logging=LoggingConfig(tensorboard=False),
    )
    demos = demonstrations(train, s.error_rate, seed)
    tokenizer = build_tokenizer()
    probe = train[:100]

    def learned(step: int, model: PreTrainedModel) -> bool:
        acc = held_out_accuracy(model, tokenizer, probe, 1, s.max_new_tokens, seed)
        log.info("sft step %d: probe greedy accuracy %.2f (stop at %.2f)", step, acc["greedy"], s.sft_stop_greedy)
        return acc["greedy"] >= s.sft_stop_greedy

    return run_sft(cfg, tokenizer=tokenizer, model=build_demo_model(seed), train_rows=demos,
                   eval_rows=held_out[:64], logger=logger, stop_fn=learned)


RLHook = Callable[[PreTrainedModel, list[Row], list[Row], Path], PreTrainedModel]
"""``rl(model, train_rows, eval_rows, run_dir) -> trained model`` (the GRPO stage)."""


def run_demo(
    run_dir: str = "runs/demo", seed: int = 1, settings: DemoSettings | None = None, rl: RLHook | None = None,
) -> dict[str, object]:
    """SFT warm start, held-out accuracy, optional RL stage, accuracy again; returns (and
    prints as the last line) ``{"accuracy_before", "accuracy_after", "seconds", "run_dir", ...}``."""
    s = settings or DemoSettings()
    t0 = time.monotonic()
    torch.set_num_threads(s.torch_threads)
    out_dir = Path(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train, held_out = make_task("arithmetic", s.n_train, s.n_eval, s.difficulty, seed)
    tokenizer = build_tokenizer()
    with MetricLogger(out_dir / "sft", tensorboard=False) as logger:
        sft = warm_start(s, train, held_out, out_dir, seed, logger)
        before = held_out_accuracy(sft.model, tokenizer, held_out, s.eval_samples, s.max_new_tokens, seed)
        logger.log({"eval/accuracy": before["sampled"], "eval/accuracy_greedy": before["greedy"]}, step=sft.steps)
    t_sft = time.monotonic() - t0
    log.info("after SFT (%.0fs): held-out sampled accuracy %.3f, greedy %.3f", t_sft, before["sampled"], before["greedy"])
    result: dict[str, object] = {
        "accuracy_before": round(before["sampled"], 4), "accuracy_after": None,
        "greedy_before": round(before["greedy"], 4), "greedy_after": None, "sft_seconds": round(t_sft, 1),
    }
    if rl is not None:
        model = rl(sft.model, train, held_out, out_dir)
        after = held_out_accuracy(model, tokenizer, held_out, s.eval_samples, s.max_new_tokens, seed)
        result.update(accuracy_after=round(after["sampled"], 4), greedy_after=round(after["greedy"], 4))
        log.info("after RL: held-out sampled accuracy %.3f, greedy %.3f", after["sampled"], after["greedy"])
    result.update(seconds=round(time.monotonic() - t0, 1), run_dir=str(out_dir))
    (out_dir / "result.json").write_text(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)
    return result
