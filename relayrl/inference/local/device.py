"""Where LocalEngine runs (``resolve_device``), how big its KV cache may grow (``kv_capacity``) and
which decode path a model takes (``accepts_mask_dict``, ``takes_logits_to_keep``)."""

from __future__ import annotations

import inspect
import re

import torch
from transformers import DynamicCache, PreTrainedModel

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def check_device(spec: str) -> None:
    """Raise ``ValueError`` unless ``spec`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if not isinstance(spec, str) or not _DEVICE.match(spec):
        raise ValueError(f"device={spec!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N'")


def resolve_device(spec: str) -> torch.device:
    """The torch device of an ``inference.device`` value (``auto``: cuda when available)."""
    check_device(spec)
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"inference.device={spec!r} but torch sees no CUDA device (torch {torch.__version__})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(f"inference.device={spec!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes of keys + values one token occupies over all layers of ``model``'s KV cache."""
    cfg = model.config.get_text_config()
    layers = int(getattr(cfg, "num_hidden_layers", None) or cfg.n_layer)
    heads = int(getattr(cfg, "num_attention_heads", None) or cfg.n_head)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    hidden = int(getattr(cfg, "hidden_size", None) or cfg.n_embd)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    dtype = next(model.parameters()).dtype
    return 2 * layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def kv_capacity(model: PreTrainedModel, device: torch.device, fraction: float, max_tokens: int) -> tuple[int, str]:
    """(KV budget in tokens, the setting that bounds it) for ``model`` on ``device``: on CPU ``max_tokens``
    (``inference.max_tokens_in_flight``); on CUDA ``fraction`` of the free memory (measured after the weights
    loaded) over twice one token's KV bytes (a growing slab buffer holds up to twice the columns in use)."""
    if device.type != "cuda":
        return max_tokens, "inference.max_tokens_in_flight"
    free, _total = torch.cuda.mem_get_info(device)
    tokens = int(free * fraction) // (2 * kv_bytes_per_token(model))
    return max(tokens, 16), f"inference.kv_cache_fraction={fraction} of {free / 2**30:.1f} GiB free GPU memory"


def takes_logits_to_keep(model: PreTrainedModel) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def accepts_mask_dict(model: PreTrainedModel, device: torch.device) -> bool:
    """Whether ``model`` decodes with a ready ``{"full_attention": bool [B, 1, 1, L]}`` mask, which skips
    transformers' per-step mask building (in transformers 5.x Qwen2/Qwen3 do; Llama, Mistral, GPT-2 ...
    do not), and returns the same logits as with the 2D mask: one 3-token probe on a private cache."""
    ids = torch.tensor([[3, 4, 5]], device=device)
    pos = torch.arange(3, device=device)[None]

    def step(mask: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        cache = DynamicCache()
        model(
            input_ids=ids[:, :2],
            position_ids=pos[:, :2],
            attention_mask=torch.ones_like(ids[:, :2]),
            past_key_values=cache,
            use_cache=True,
        )
        return model(
            input_ids=ids[:, 2:], position_ids=pos[:, 2:], attention_mask=mask, past_key_values=cache, use_cache=True
        ).logits

    try:
        with torch.inference_mode():
            plain = step(torch.ones_like(ids))
            ready = step({"full_attention": torch.ones(1, 1, 1, 3, dtype=torch.bool, device=device)})
    except (AttributeError, TypeError, ValueError, KeyError, RuntimeError):
        return False
    return bool(torch.allclose(plain.float(), ready.float(), atol=1e-3, rtol=1e-3))
