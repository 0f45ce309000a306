"""Colocated, high-level: the whole run in a few lines (the ``fit``-style way to use relayrl).

    python recipes/colocated_highlevel.py [key=value ...]     # e.g. total_steps=20

Everything (data, LocalEngine, executor, actor, evaluation, checkpoints, metrics) is built
from the config; ``recipes/algorithms/*.yaml`` pick other algorithms. The config is
recipes/algorithms/grpo.yaml, which starts from the demo's SFT warm start (tests/data/demo_sft:
random weights never earn a reward on 2-digit addition), so the outcome is grpo.yaml's (seed 1,
measured on the 2-core development machine while shared):
    sampled held-out accuracy 0.375 -> 0.546 at step 20 -> 0.725 at step 60 (about 3 min, 48 s of CPU)
The last line printed sums the run up (``step 60 | reward ... | sampled 0.725 | ...``);
tests/test_recipes.py runs the 20-step horizon.
"""

import sys

from relayrl.api.config import RunConfig, load_config
from relayrl.trainer import train
from relayrl.utils.logging import summary

if __name__ == "__main__":
    cfg = load_config(RunConfig, "recipes/algorithms/grpo.yaml", ["run_dir=runs/highlevel", *sys.argv[1:]])
    print(summary(train(cfg)))
