"""Vision-language GRPO on a synthetic visual task: count the coloured squares in a picture.

    python recipes/vlm_grpo.py [key=value ...]      # e.g. total_steps=40 rollout.group_size=8

Each prompt is "How many squares?" about a 56x56 image with 1-3 squares (``data.task=count_squares``);
the policy is the tiny Qwen2-VL (``model.path=tiny-vl``; ``tiny-vl2.5`` for Qwen2.5-VL). A random
model almost never answers with a digit, so a short format warm-up first teaches the answer's
shape with *random* counts (it cannot teach counting: its labels ignore the image); GRPO then
has to learn to look at the picture, and the reward rises from about 1/3 (guessing) upwards.
The warm start is saved as a checkpoint directory (weights, tokenizer, image processor), which
is also how a real Qwen2-VL checkpoint is given (``model.path=/path/to/Qwen2-VL-2B-Instruct``).
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

import torch

from relayrl.api.config import ModelConfig, OptimizerConfig, RunConfig, TrainEngineConfig, load_config
from relayrl.api.workflow import concat_trajectories
from relayrl.data.models import load_model, load_tokenizer
from relayrl.data.tasks import make_task
from relayrl.data.vision import attach_vision, build_image_processor
from relayrl.train.engine import TorchTrainEngine
from relayrl.train.packing import token_logprobs
from relayrl.trainer import train

DEFAULTS = [
    "model.path=tiny-vl",
    "data.task=count_squares",
    "data.difficulty=2",
    "data.n_train=256",
    "data.n_eval=32",
    "total_steps=30",
    "rollout.batch_size=8",
    "rollout.group_size=8",
    "gconfig.max_new_tokens=2",
    "gconfig.temperature=1.0",
    "eval.gconfig.max_new_tokens=2",
    "train.optimizer.lr=3e-3",
    "actor.adv_estimator=grpo",
    "logging.tensorboard=false",
    "logging.progress=lines",
    "checkpoint.save_final=false",
]


def format_warmup(cfg: RunConfig, out_dir: Path, steps: int = 30) -> Path:
    """A checkpoint of ``cfg.model`` trained for ``steps`` to answer "<digit><eos>" with a random count
    in the task's range: the answer format, no counting. Returns the checkpoint directory."""
    tok, proc = load_tokenizer(cfg.model), build_image_processor()
    rows, _ = make_task("count_squares", 64, 0, cfg.data.difficulty, seed=cfg.seed + 1)
    rows = attach_vision(rows, tok, proc)
    rng = random.Random(cfg.seed)
    eos = tok.convert_tokens_to_ids("<eos>")
    engine = TorchTrainEngine(
        TrainEngineConfig(optimizer=OptimizerConfig(lr=3e-3)),
        cfg.model,
        model=load_model(cfg.model, cfg.seed),
        seed=cfg.seed,
    )
    engine.initialize()

    def nll(logits: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = packed["loss_mask"].bool()
        return -token_logprobs(logits, packed)[mask].mean()

    for _ in range(steps):
        batch = []
        for row in rng.sample(rows, 16):
            vp = row["vision"]
            answer = tok(str(rng.randint(1, cfg.data.difficulty + 1)))["input_ids"] + [eos]
            n, m = len(vp.input_ids), len(answer)
            batch.append(
                {
                    "input_ids": torch.tensor([vp.input_ids + answer]),
                    "attention_mask": torch.ones(1, n + m, dtype=torch.bool),
                    "loss_mask": torch.tensor([[0] * n + [1] * m], dtype=torch.bool),
                    "pixel_values": vp.vision.pixel_values[None],
                    "image_grid_thw": vp.vision.image_grid_thw[None],
                }
            )
        engine.train_batch(concat_trajectories(batch), nll, lambda p: float(p["loss_mask"].sum()))
    engine.model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    proc.save_pretrained(out_dir)
    return out_dir


def main(overrides: list[str], warmup_steps: int = 30) -> dict[str, float]:
    cfg = load_config(RunConfig, None, [*DEFAULTS, *overrides])
    torch.set_num_threads(cfg.torch_threads)
    with tempfile.TemporaryDirectory() as tmp:
        if cfg.model.path.startswith("tiny-vl") and warmup_steps:
            cfg.model = ModelConfig(
                path=str(format_warmup(cfg, Path(tmp) / "warm", warmup_steps)), dtype=cfg.model.dtype
            )
        return train(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
