"""What ``relayrl doctor`` needs from a training step, saved by the trainer: the policy's weights
before the update (an HF checkpoint), the batch's tokens, masks, generator logprobs and versions,
the trainer's logprobs from the update, and the settings that shape either side."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from relayrl.api.config import RunConfig
from relayrl.api.engine import TensorDict
from relayrl.api.io import SaveLoadMeta
from relayrl.train.actor import PPOActor
from relayrl.train.engine import TorchTrainEngine
from relayrl.utils import dist as dist_utils

KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "truncated", "routed_experts")
KEEP = 3  # records kept (the oldest is removed)


def record_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "doctor" / f"step_{step}"


class DoctorRecorder:
    """Saves step ``N``'s record when ``N == 1`` or ``N % logging.doctor_every == 0`` (0: never).
    ``before_update`` (every rank: the weights are gathered collectively) then ``after_update``."""

    def __init__(self, cfg: RunConfig, engine: TorchTrainEngine) -> None:
        self.cfg, self.engine = cfg, engine
        self.every = cfg.logging.doctor_every
        self.pending: Path | None = None

    def before_update(self, step: int) -> None:
        """``step``: the step being trained (1-based). Saves the weights the batch is scored at."""
        self.pending = None
        if self.every <= 0 or self.engine.lora or not (step == 1 or step % self.every == 0):
            return
        self.pending = record_dir(self.cfg.run_dir, step)
        self.engine.save(SaveLoadMeta(str(self.pending / "model"), with_optim=False))

    def after_update(self, batch: TensorDict, actor: PPOActor) -> None:
        if self.pending is None or not dist_utils.is_main():
            return
        c = self.cfg
        torch.save(
            {
                "batch": {k: batch[k].cpu() for k in KEYS if k in batch},
                "trainer_logp": actor.trainer_logp,
                "version": self.engine.get_version(),
                "temperature": actor.temperature,
                "gconfig": {"greedy": c.gconfig.greedy, "temperature": c.gconfig.temperature},
                "top_p": c.gconfig.top_p,
                "top_k": c.gconfig.top_k,
                "dtype": c.model.dtype,
                "bf16_autocast": c.train.bf16,
                "dropout": c.train.dropout,
                "replay_routing": c.actor.replay_routing,
                "mismatch": actor.mismatch,
            },
            self.pending / "record.pt",
        )
        done = sorted((self.pending.parent).glob("step_*"), key=lambda p: int(p.name.removeprefix("step_")))
        for old in done[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
