"""torch.distributed helpers of the train engine: process group, FSDP2, full state dicts.

Everything degrades to a no-op on a single process, which never touches torch.distributed.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from relayrl.utils import dist as dist_utils

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def is_distributed() -> bool:
    """More than one rank (a group of one behaves like no group)."""
    return dist_utils.world_size() > 1


def maybe_init_process_group() -> None:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1) and not yet joined."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available() and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=30))


def device_for_rank() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def all_reduce_sum(value: float) -> float:
    """Sum a float over ranks (identity on one process)."""
    if not is_distributed():
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return float(t.item())


def all_reduce_tensor_(t: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks (identity on one process)."""
    if is_distributed():
        dist.all_reduce(t)
    return t


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF model (each becomes one FSDP2 unit)."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def apply_fsdp2(model: nn.Module) -> nn.Module:
    """Shard every decoder layer, then the root (embeddings, norm and tied head stay together)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU state dict; a collective under FSDP2 (call on every rank).

    Tied weights (``lm_head`` = ``embed_tokens``) stay one tensor, as in the model, so a saved
    checkpoint stores them once whether or not the model was sharded."""
    if not is_fsdp(model):
        return {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    state = get_model_state_dict(model, options=FULL)
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):  # type: ignore[operator, union-attr]
        for target, source in (getattr(model, "_tied_weights_keys", None) or {}).items():
            if target in state and source in state:
                state[target] = state[source]
    return state


def load_full_model_state_dict(model: nn.Module, state: dict[str, torch.Tensor], partial: bool = False) -> None:
    """Load a full state dict (every rank passes the same one); missing keys must be tied weights
    unless ``partial`` (a LoRA adapter: only the keys given are loaded)."""
    if is_fsdp(model):
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"checkpoint has keys the model does not: {unexpected[:5]}")
    if partial:
        return
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if set(missing) - tied:
        raise ValueError(f"checkpoint lacks model keys: {sorted(set(missing) - tied)[:5]}")


def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, object]:
    """Optimizer state keyed by parameter names, unsharded; a collective under FSDP2."""
    return get_optimizer_state_dict(model, optim, options=FULL)  # type: ignore[return-value]


def load_full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, object]) -> None:
    set_optimizer_state_dict(model, optim, state, options=StateDictOptions(full_state_dict=True))  # type: ignore[arg-type]
