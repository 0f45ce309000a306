"""Colocated, low-level: every step of the RL loop written out (seed 001's second usage mode).

    python recipes/colocated_lowlevel.py [key=value ...]     # e.g. total_steps=20 train.optimizer.lr=1e-4

Generation (LocalEngine) runs in this process; the loop is the one of seed 002's ``main``:
rollout -> compute_logp -> compute_advantages -> ppo_update -> update_weights.
"""

from __future__ import annotations

import itertools
import sys

import torch

from relayrl.api.config import RunConfig, load_config
from relayrl.data.models import load_model, load_tokenizer
from relayrl.data.tasks import make_task
from relayrl.inference.local import LocalEngine
from relayrl.rewards.tasks import task_reward_fn
from relayrl.rollout.executor import WorkflowExecutor
from relayrl.rollout.workflows.rlvr import RLVRWorkflow
from relayrl.train.actor import PPOActor
from relayrl.train.engine import TorchTrainEngine
from relayrl.utils import stats


def main(overrides: list[str]) -> list[dict[str, float]]:
    cfg = load_config(RunConfig, None, ["total_steps=3", "rollout.batch_size=4", "rollout.group_size=4", *overrides])
    torch.set_num_threads(cfg.torch_threads)
    tokenizer = load_tokenizer(cfg.model)
    train_rows, _ = make_task("arithmetic", cfg.data.n_train, cfg.data.n_eval, cfg.data.difficulty, seed=cfg.seed)

    rollout = LocalEngine(cfg.inference, model=load_model(cfg.model, cfg.seed), tokenizer=tokenizer)
    rollout.initialize()
    WorkflowExecutor(cfg.rollout, rollout).initialize()  # gives the engine its rollout verbs
    actor_engine = TorchTrainEngine(cfg.train, cfg.model, model=load_model(cfg.model, cfg.seed), seed=cfg.seed)
    actor_engine.initialize()
    actor = PPOActor(cfg.actor, actor_engine)
    workflow = RLVRWorkflow(task_reward_fn("arithmetic"), cfg.gconfig, tokenizer)

    history = []
    batches = (train_rows[i : i + cfg.rollout.batch_size] for i in itertools.count(0, cfg.rollout.batch_size))
    for step in range(cfg.total_steps):
        with stats.record_timing("rollout"):
            batch = rollout.rollout_batch(next(batches), workflow)
        with stats.record_timing("compute_logp"):
            batch["prox_logp"] = actor.compute_logp(batch)
        with stats.record_timing("compute_advantages"):
            actor.compute_advantages(batch)
        with stats.record_timing("ppo_update"), stats.scope("actor"):
            for s in actor.ppo_update(batch):  # each optimizer step also advances the LR schedule
                stats.scalar(**{k: v for k, v in s.items() if isinstance(v, float)})
        with stats.record_timing("update_weights"):
            actor_engine.set_version(step + 1)
            actor_engine.update_weights(rollout)
        metrics = {"reward": float(batch["rewards"].mean()), **stats.export()}
        history.append(metrics)
        print(
            f"step {step + 1}: reward {metrics['reward']:.3f}  loss {metrics.get('actor/loss', float('nan')):.4f}  "
            f"lr {metrics['actor/lr']:.2e}"
        )
    rollout.destroy()
    return history


if __name__ == "__main__":
    main(sys.argv[1:])
