"""torch.distributed helpers: ranks and collectives that answer for a single process (rank 0 of 1)
when no process group exists, so callers run unchanged in one process, under ``torchrun`` or in tests;
joining torchrun's process group; the train engine's FSDP2 sharding and full (unsharded) state dicts.
"""

from __future__ import annotations

import contextlib
import os
import socket
import typing
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Literal, TypeVar, cast

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
from transformers import PreTrainedModel

from relayrl.utils.deadline import Stalled

ReduceOpName = Literal["sum", "min", "max"]
T = TypeVar("T")


def _joined() -> bool:
    """Whether a default process group exists (``rank`` / ``world_size`` ask it only then)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if _joined() else 0


def world_size() -> int:
    return dist.get_world_size() if _joined() else 1


def is_distributed() -> bool:
    """More than one rank: a group of one behaves like no group, and every helper here is then the identity."""
    return world_size() > 1


def is_main() -> bool:
    """True on global rank 0 (and in a single process): the rank that writes logs and files."""
    return rank() == 0


_timeout_s = 1800.0  # the process group's timeout (train.collective_timeout), named when a wait expires


@contextlib.contextmanager
def _deadline(what: str) -> Iterator[None]:
    """Turn a collective's timeout (the process group's, ``train.collective_timeout``) into one
    ``Stalled`` line naming ``what`` waited, instead of the backend's multi-line error."""
    try:
        yield
    except Stalled:
        raise
    except RuntimeError as e:  # gloo: "Timed out waiting ...", NCCL: "... Timeout"; DistBackendError is one
        text = str(e)
        if "timed out" not in text.lower() and "timeout" not in text.lower():
            raise
        raise Stalled(
            f"rank {rank()} of {world_size()} waited {_timeout_s:.0f}s at {what} for the other ranks: one stopped, "
            f"died or hangs (see its log and stall report); give them longer with train.collective_timeout "
            f"({text.strip().splitlines()[0][:200]})"
        ) from None


def barrier(what: str = "a barrier") -> None:
    """Wait for every rank; ``Stalled`` (one line) when one does not come within the group's timeout."""
    if not _joined():
        return
    with _deadline(what):
        dist.barrier()


def all_reduce(tensor: torch.Tensor, op: ReduceOpName = "sum") -> torch.Tensor:
    """Return ``tensor`` reduced over the ranks (a new tensor on ``tensor``'s device).

    Without a process group this is the identity. The tensor is moved to the backend's
    device for the collective (CPU for gloo, CUDA for NCCL) and moved back.
    """
    if op not in typing.get_args(ReduceOpName):
        raise ValueError(f"all_reduce op must be one of {list(typing.get_args(ReduceOpName))}, got {op!r}")
    if not is_distributed():
        return tensor.clone()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    buf = tensor.detach().to(device, copy=True)
    with _deadline(f"an all-reduce ({op})"):
        dist.all_reduce(buf, op=getattr(dist.ReduceOp, op.upper()))
    return buf.to(tensor.device)


def all_gather_object(obj: object) -> list[object]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` without a process group."""
    if not is_distributed():
        return [obj]
    out: list[object] = [None] * world_size()
    with _deadline("an all-gather"):
        dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: T, src: int = 0) -> T:
    """``obj`` of rank ``src`` on every rank (picklable; tensors travel inside the pickle);
    ``obj`` itself without a process group."""
    if not is_distributed():
        return obj
    box: list[object] = [obj]
    with _deadline(f"a broadcast (from rank {src})"):
        dist.broadcast_object_list(box, src=src)
    return cast(T, box[0])


def broadcast_(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In place: rank ``src``'s ``tensor`` on every rank (on the backend's device; identity on one process)."""
    if is_distributed():
        with _deadline(f"a broadcast (from rank {src})"):
            dist.broadcast(tensor, src=src)
    return tensor


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a process group or a test server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ process group, FSDP2, full state dicts

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def maybe_init_process_group(timeout_s: float = 1800.0) -> None:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1) and not yet joined; every
    collective and barrier (and the rendezvous) waits at most ``timeout_s`` (train.collective_timeout)."""
    global _timeout_s
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available() and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        _timeout_s = timeout_s
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def device_for_rank() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def all_reduce_sum(value: float) -> float:
    """Sum a float over ranks (identity on one process)."""
    return float(all_reduce(torch.tensor([float(value)], dtype=torch.float64)).item())


def all_reduce_(t: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks, ``t`` already on the backend's device (gradients); identity on one process."""
    if is_distributed():
        with _deadline("an all-reduce (sum)"):
            dist.all_reduce(t)
    return t


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF model (each becomes one FSDP2 unit)."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def apply_fsdp2(model: nn.Module) -> nn.Module:
    """Shard every decoder layer, then a vision tower's blocks and the tower (gathered only while it
    runs), then the root (embeddings, norm and tied head stay together)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    vision = getattr(getattr(model, "model", None), "visual", None)  # Qwen2-VL / Qwen2.5-VL vision tower
    if vision is not None:
        for block in vision.blocks:
            fully_shard(block)
        fully_shard(vision)
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
    if getattr(typing.cast(PreTrainedModel, model).config.get_text_config(), "tie_word_embeddings", False):
        for target, source in (getattr(model, "_tied_weights_keys", None) or {}).items():
            if target in state and source in state:
                state[target] = state[source]
    return typing.cast(dict[str, torch.Tensor], state)


def load_full_model_state_dict(model: nn.Module, state: dict[str, torch.Tensor], partial: bool = False) -> None:
    """Load a full state dict (every rank passes the same one); missing keys must be tied weights
    unless ``partial`` (a LoRA adapter: only the keys given are loaded)."""
    if is_fsdp(model):
        full = typing.cast(dict[str, Any], state)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
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
    return typing.cast(dict[str, object], get_optimizer_state_dict(model, optim, options=FULL))


def load_full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, object]) -> None:
    full = typing.cast(dict[str, Any], state)
    set_optimizer_state_dict(model, optim, full, options=StateDictOptions(full_state_dict=True))
