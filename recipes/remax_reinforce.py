"""ReMax + a user-written REINFORCE actor: seed 002's example, end to end on relayrl.

    python recipes/remax_reinforce.py [key=value ...]

1. The workflow (``ReMaxWorkflow``) samples one completion and a greedy one concurrently;
   the row keeps the sampled reward in ``rewards`` and the greedy one in ``baseline_rewards``.
2. The algorithm is the two-class pattern: ``ReinforceActor`` holds the backend-agnostic
   REINFORCE loss and calls only ``engine.train_batch``; ``TorchReinforceActor`` binds it to
   ``TorchTrainEngine`` (save/load/update_weights come with the engine).
3. The loop is seed 002's ``main``.
"""

from __future__ import annotations

import sys

import torch

from relayrl import wiring
from relayrl.api.config import RunConfig, load_config
from relayrl.data.models import load_model, load_tokenizer
from relayrl.inference.local import LocalEngine
from relayrl.rollout.executor import WorkflowExecutor
from relayrl.rollout.workflows import ReMaxWorkflow
from relayrl.train.actor import TorchReinforceActor
from relayrl.utils import stats


def main(overrides: list[str]) -> list[float]:
    cfg = load_config(RunConfig, None, ["total_steps=3", "rollout.group_size=1", "rollout.batch_size=8", *overrides])
    torch.set_num_threads(cfg.torch_threads)
    tokenizer = load_tokenizer(cfg.model)
    train_rows, _ = wiring.load_rows(cfg, tokenizer)

    rollout = LocalEngine(cfg.inference, model=load_model(cfg.model, cfg.seed), tokenizer=tokenizer)
    rollout.initialize()
    WorkflowExecutor(cfg.rollout, rollout).initialize()
    actor = TorchReinforceActor(cfg.train, cfg.model, model=load_model(cfg.model, cfg.seed), seed=cfg.seed)
    actor.initialize()
    workflow = ReMaxWorkflow(reward_fn=wiring.reward_fn_for(cfg), gconfig=cfg.gconfig, tokenizer=tokenizer)
    dataloader = iter(wiring.make_dataloader(cfg, train_rows))

    rewards = []
    for step in range(cfg.total_steps):
        with stats.record_timing("rollout"):
            batch = rollout.rollout_batch(next(dataloader), workflow=workflow)
        batch["rewards"] = batch["rewards"] - batch["baseline_rewards"]  # seed 002: reward difference
        with stats.record_timing("train_step"), stats.scope("actor"):
            stats.scalar(**actor.train_reinforce(batch))
        with stats.record_timing("update_weights"):
            actor.set_version(step + 1)
            actor.update_weights(rollout)
        rewards.append(float(batch["rewards"].mean()))
        print(f"step {step + 1}: reward - greedy = {rewards[-1]:+.3f}", stats.export())
    rollout.destroy()
    return rewards


if __name__ == "__main__":
    main(sys.argv[1:])
