"""LoRA adapters on the train engine's policy, built with ``peft``.

The trainer's model becomes a ``peft.PeftModel`` whose only trainable parameters are the
adapters. What leaves the trainer is derived from full (unsharded) state dicts, so the same
code serves one process and FSDP2:

- generators get *merged* weights, ``W + (alpha / r) * B @ A`` per adapted tensor, computed
  into new tensors under the base model's Hugging Face names (the trainer's base weights are
  never modified);
- checkpoints hold the adapter exactly as ``PeftModel.save_pretrained`` writes it
  (``adapter_config.json`` + ``adapter_model.safetensors``), so
  ``PeftModel.from_pretrained(base, dir)`` loads it anywhere.
"""

from __future__ import annotations

import os
import typing

import torch
from torch import nn
from transformers import PreTrainedModel

from relayrl.api.config import LoraConfig

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # the one adapter the trainer trains
ADAPTER_WEIGHTS = "adapter_model.safetensors"

if typing.TYPE_CHECKING:
    from peft import PeftModel


def _family(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "model_type", type(model).__name__)


def resolve_targets(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """``cfg.target_modules``, each checked to match at least one linear module; by default the family's
    attention and MLP projections (the distinct last name parts of its linear modules)."""
    from transformers.pytorch_utils import Conv1D

    # the modules LoRA could adapt: the output head excluded; GPT-2's transposed Conv1D linear counts (peft adapts it)
    head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear | Conv1D) and m is not head]
    family = _family(model)
    if not linear:
        raise ValueError(f"model.lora.rank > 0: model family {family!r} has no linear module LoRA can adapt")
    names = sorted({n.rsplit(".", 1)[-1] for n in linear})
    targets = list(cfg.target_modules) or names
    for pattern in targets:
        if not any(name == pattern or name.endswith("." + pattern) for name in linear):
            raise ValueError(
                f"model.lora.target_modules: {pattern!r} matches no linear module of this {family} model; "
                f"its linear modules are {names} (e.g. {linear[0]!r})"
            )
    return targets


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap ``model`` with fresh adapters (B = 0, so the wrapped model computes what the base does)."""
    try:
        import peft
    except ImportError as e:  # peft comes with the lora (and dev) extras
        raise ImportError("model.lora.rank > 0 needs peft: pip install 'relayrl[lora]'") from e
    targets = resolve_targets(model, cfg)
    config = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # (peft annotates int, takes any number)
        lora_dropout=cfg.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return peft.get_peft_model(model, config)
    except (ValueError, TypeError, NotImplementedError, AttributeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"model.lora: peft cannot wrap model family {_family(model)!r}: {first}") from e


def lora_layers(model: nn.Module) -> dict[str, tuple[float, bool]]:
    """State-dict prefix of every adapted module -> (scaling alpha/r, fan_in_fan_out)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer) and ADAPTER in m.scaling:
            out[name] = (float(m.scaling[ADAPTER]), bool(getattr(m, "fan_in_fan_out", False)))
    return out


def merged_state_dict(state: dict[str, torch.Tensor], layers: dict[str, tuple[float, bool]]) -> dict[str, torch.Tensor]:
    """The base model's state dict (HF names) with every adapter merged in, as new tensors.

    ``state`` is the PeftModel's full state dict; ``layers`` is ``lora_layers(model)``.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        prefix = key.rsplit(".base_layer.", 1)[0]
        if key.endswith(".base_layer.weight") and prefix in layers:
            scaling, fan_in_fan_out = layers[prefix]
            a = state[f"{prefix}.lora_A.{ADAPTER}.weight"].float()
            b = state[f"{prefix}.lora_B.{ADAPTER}.weight"].float()
            delta = (b.to(a.device) @ a) * scaling
            value = (value.float() + (delta.T if fan_in_fan_out else delta).to(value.device)).to(value.dtype)
        out[name] = value
    return out


def adapter_key(model_key: str) -> str:
    """The name peft saves an adapter tensor under (the adapter's name dropped)."""
    return model_key.replace(f".{ADAPTER}.", ".")


def adapter_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a full PeftModel state dict, named as in ``adapter_model.safetensors``."""
    return {adapter_key(k): v for k, v in state.items() if ".lora_" in k}


def adapter_config_json(model: nn.Module, base_path: str) -> str:
    """The ``adapter_config.json`` text peft writes for the trainer's adapter (written by peft itself)."""
    import tempfile

    config = typing.cast("PeftModel", model).peft_config[ADAPTER]
    config.base_model_name_or_path = base_path
    with tempfile.TemporaryDirectory() as d:
        config.save_pretrained(d)
        with open(os.path.join(d, "adapter_config.json")) as fh:
            return fh.read()


def read_adapter(path: str, model_keys: list[str]) -> dict[str, torch.Tensor]:
    """Adapter tensors saved at ``path`` renamed to the model's state-dict keys; every adapter key
    of the model must be there and nothing else."""
    from safetensors.torch import load_file

    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no {ADAPTER_WEIGHTS} in {path} (a LoRA run's checkpoints are peft adapters)")
    saved = load_file(file)
    wanted = {adapter_key(k): k for k in model_keys if ".lora_" in k}
    missing, extra = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
    if missing or extra:
        raise ValueError(
            f"adapter at {path} does not fit model.lora (rank/target_modules changed?): "
            f"missing {missing[:3]}, unexpected {extra[:3]}"
        )
    return {wanted[k]: v for k, v in saved.items()}
