"""RL against a learned reward model instead of a verifier.

    python recipes/reward_model.py [rm=PATH] [key=value ...]   # e.g. rm=my-org/my-rm total_steps=100

The reward model is the train engine with a scalar head (``head="reward"``), frozen
(``trainable=False``): a Hugging Face sequence-classification checkpoint with one label loads
as is, a causal-LM checkpoint gets a fresh scalar head. ``as_reward_fn()`` makes it a reward
function with the usual signature (prompt, completions, prompt_ids, completion_ids, **data),
scoring the last token of prompt + completion, so the ordinary RLVR workflow uses it unchanged.
Here the ``tiny`` preset with a random score head stands in for a trained reward model (a fresh
head starts at zero and would score everything 0).
"""

import sys

import torch

from relayrl.api.config import ModelConfig, RunConfig, TrainEngineConfig, load_config
from relayrl.train.engine import TorchTrainEngine
from relayrl.trainer import train
from relayrl.utils.logging import summary


def reward_model(path: str, seed: int) -> TorchTrainEngine:
    """The frozen reward model at ``path`` (``tiny``: the stand-in, a random score head)."""
    rm = TorchTrainEngine(TrainEngineConfig(), ModelConfig(path=path), head="reward", trainable=False, seed=seed)
    rm.initialize()
    if path == "tiny":
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            torch.nn.init.normal_(rm.model.score.weight, std=0.1)  # type: ignore[union-attr]
    return rm


def main(argv: list[str]) -> dict[str, float]:
    rm_path = next((a.split("=", 1)[1] for a in argv if a.startswith("rm=")), "tiny")
    cfg = load_config(
        RunConfig,
        "recipes/algorithms/grpo.yaml",
        ["run_dir=runs/reward_model", *[a for a in argv if not a.startswith("rm=")]],
    )
    rm = reward_model(rm_path, cfg.seed)
    try:
        return train(cfg, reward_fn=rm.as_reward_fn())
    finally:
        rm.destroy()


if __name__ == "__main__":
    print(summary(main(sys.argv[1:])))
