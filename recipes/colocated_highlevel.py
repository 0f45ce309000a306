"""Colocated, high-level: the whole run in a few lines (seed 001's ``fit``-style usage mode).

    python recipes/colocated_highlevel.py [key=value ...]     # e.g. total_steps=20

Everything (data, LocalEngine, executor, actor, evaluation, checkpoints, metrics) is built
from the config; ``recipes/algorithms/*.yaml`` pick other algorithms.
"""

import sys

from relayrl.api.config import RunConfig, load_config
from relayrl.trainer import train
from relayrl.utils.logging import summary

if __name__ == "__main__":
    cfg = load_config(RunConfig, "recipes/algorithms/grpo.yaml", ["run_dir=runs/highlevel", *sys.argv[1:]])
    print(summary(train(cfg)))
