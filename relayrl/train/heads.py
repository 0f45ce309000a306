"""Scalar heads: a critic (value per token) and a reward model (score of the last token).

Both are Hugging Face ``*ForTokenClassification`` models with ``num_labels=1``: the same
backbone as the policy plus a linear ``score`` (``classifier`` in GPT-2 / GPT-NeoX) head, so they save and reload with
``from_pretrained`` like any HF model. (``*ForSequenceClassification`` finds the last token
through padding, which does not exist in a packed micro-batch; we take it from ``cu_seqlens``.)
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForTokenClassification, PreTrainedModel

from relayrl.api.engine import TensorDict


def scalar_head_from_lm(lm: PreTrainedModel, seed: int = 0) -> PreTrainedModel:
    """A ``num_labels=1`` token-classification model sharing ``lm``'s backbone weights.

    The score head starts at zero (values/scores 0 at init), dropout is off.
    """
    cfg = copy.deepcopy(lm.config)
    cfg.num_labels = 1
    cfg.classifier_dropout = 0.0
    cfg.architectures = None
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForTokenClassification.from_config(cfg, dtype=lm.dtype)
    backbone = getattr(model, model.base_model_prefix)
    backbone.load_state_dict(getattr(lm, lm.base_model_prefix).state_dict())
    # the linear head: ``score`` (Llama, Qwen, Mistral, Gemma, Phi) or ``classifier`` (GPT-2, GPT-NeoX)
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear 'score' / 'classifier' head to start at zero")
    with torch.no_grad():
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()
    return model


def token_values(logits: torch.Tensor, packed: TensorDict) -> torch.Tensor:
    """``[T]`` per-token values: the head's output at token i (it has seen tokens <= i)."""
    return logits[:, 0].float()


def last_token_post(logits: torch.Tensor, packed: TensorDict) -> torch.Tensor:
    """``[T]`` token-aligned: the sequence score at each sequence's last token, 0 elsewhere."""
    out = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    last = packed["cu_seqlens"][1:].long().to(logits.device) - 1
    out[last] = logits[last, 0].float()
    return out
