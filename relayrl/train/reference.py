"""The KL reference of a LoRA policy without a second copy of the base weights (``trainer.py`` builds it
when ``model.lora.rank > 0`` and the algorithm needs a reference): the policy's own model, adapters disabled."""

from __future__ import annotations

import typing

import torch

from relayrl.api.engine import PostFn, TensorDict
from relayrl.train.engine import TorchTrainEngine

if typing.TYPE_CHECKING:
    from peft import PeftModel


class AdapterOffReference(TorchTrainEngine):
    """The KL reference of a LoRA policy: the policy's own model with its adapters disabled, so
    the base weights are in memory once. Frozen; only ``forward`` (and what builds on it) is for use."""

    def __init__(self, policy: TorchTrainEngine):
        if not policy.lora:
            raise ValueError("AdapterOffReference needs a policy engine with LoRA (model.lora.rank > 0)")
        super().__init__(policy.config, policy.model_config, head="lm", trainable=False, seed=policy.seed)
        self.policy = policy

    def initialize(self) -> None:
        self.model, self.device = self.policy._require(), self.policy.device
        self._checked = self.policy._checked  # the same model: the same fast paths

    def train(self, mode: bool = True) -> None:
        """The shared model's mode is the policy's to set."""

    @torch.no_grad()
    def forward(self, batch: TensorDict, post_fn: PostFn | None = None, temperature: float = 1.0) -> torch.Tensor:
        with typing.cast("PeftModel", self._require()).disable_adapter():
            return super().forward(batch, post_fn, temperature)
