"""Separate producer: the executor generates in the background while the trainer trains
(seed 001's third usage mode), and evaluation takes priority over production.

    python recipes/separate_producer.py [key=value ...]

The producer is ``executor.prepare_batch``: with ``rollout.max_staleness`` = eta > 0 it keeps
up to eta batches in flight on its own thread, so generation of the next batches overlaps
this loop's training. ``executor.pause()`` stops new episodes while evaluation requests go
straight to the engine; the decoupled PPO loss keeps the off-policy update stable.
"""

from __future__ import annotations

import sys

import torch

from relayrl import wiring
from relayrl.api.config import RunConfig, load_config
from relayrl.data.models import load_model, load_tokenizer
from relayrl.evaluation import evaluate
from relayrl.rollout.executor import WorkflowExecutor
from relayrl.train.actor import PPOActor
from relayrl.train.engine import TorchTrainEngine


def main(overrides: list[str]) -> dict[str, float]:
    cfg = load_config(
        RunConfig,
        None,
        ["total_steps=4", "rollout.max_staleness=2", "actor.loss=decoupled_ppo", "eval.every_n_steps=2", *overrides],
    )
    torch.set_num_threads(cfg.torch_threads)
    tokenizer = load_tokenizer(cfg.model)
    train_rows, eval_rows = wiring.load_rows(cfg, tokenizer)
    reward_fn = wiring.reward_fn_for(cfg)

    engine = wiring.make_inference_engine(cfg, tokenizer)  # LocalEngine, or RemoteEngine to servers
    engine.initialize()
    executor = WorkflowExecutor(cfg.rollout, engine)
    executor.initialize()
    actor_engine = TorchTrainEngine(cfg.train, cfg.model, model=load_model(cfg.model, cfg.seed), seed=cfg.seed)
    actor_engine.initialize()
    actor = PPOActor(cfg.actor, actor_engine)
    actor_engine.update_weights(engine)
    workflow = wiring.make_workflow(cfg, tokenizer, reward_fn)
    eval_workflow = wiring.make_workflow(cfg, tokenizer, reward_fn, cfg.eval.gconfig)
    dataloader = wiring.make_dataloader(cfg, train_rows)

    result: dict[str, float] = {}
    for step in range(1, cfg.total_steps + 1):
        batch = executor.prepare_batch(dataloader, workflow)  # the producer keeps running meanwhile
        batch["prox_logp"] = actor.compute_logp(batch)
        actor.compute_advantages(batch)
        actor.ppo_update(batch)
        actor_engine.set_version(step)
        actor_engine.update_weights(engine)
        lag = step - 1 - batch["versions"][batch["loss_mask"].bool()]
        result = {"step": step, "reward": float(batch["rewards"].mean()), "staleness_max": int(lag.max())}
        if step % cfg.eval.every_n_steps == 0:
            executor.pause()  # evaluation first: no new training episodes start meanwhile
            try:
                result.update(evaluate(engine, eval_workflow, eval_rows[:8]))
            finally:
                executor.resume()
        print(result)
    executor.destroy()
    engine.destroy()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
