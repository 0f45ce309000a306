"""Mixture-of-experts routers: find them, record the experts they pick, replay recorded picks.

Routed-experts replay (from the xtuner design): the generator records, for every token it
runs, the expert ids each MoE layer's router chose; the trainer's forward then uses those ids
instead of its own top-k, so it scores the computation that was sampled from (in bf16 small
numeric differences otherwise flip near-tied top-k choices and inflate the mismatch). The
gate weights still come from the trainer's router (softmax of its logits gathered at the
recorded ids, renormalised as the family does), so the router keeps its gradient.

Families declare where their router sits and how they renormalise (``ROUTER_FAMILIES``);
the hooks are ordinary forward hooks on the router modules, no model code is forked. A
family's router must return ``(router_logits [T, E], top-k weights [T, k], top-k ids [T, k])``
for the flattened tokens of the forward, as transformers' Mixtral and Qwen3-MoE routers do.

Layout: ``[tokens, n_moe_layers, top_k]`` int ids, ``-1`` where nothing was recorded (the
router then picks its own experts for that token).
"""

from __future__ import annotations

import base64
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import PretrainedConfig


@dataclass(frozen=True)
class RouterFamily:
    """Where a family's router sits in a decoder layer and whether its top-k weights are renormalised."""

    path: str  # attribute path from a decoder layer to its router module
    renormalize: Callable[[object], bool]  # config -> whether the top-k weights are divided by their sum


ROUTER_FAMILIES: dict[str, RouterFamily] = {
    "mixtral": RouterFamily("mlp.gate", lambda cfg: True),
    "qwen3_moe": RouterFamily("mlp.gate", lambda cfg: bool(getattr(cfg, "norm_topk_prob", True))),
}


def _family(model: nn.Module) -> RouterFamily | None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    return ROUTER_FAMILIES.get(getattr(cfg.get_text_config(), "model_type", ""))


def _layer_routers(model: nn.Module) -> list[nn.Module | None]:
    """Per decoder layer of ``model``, in order, its MoE router or None (a dense layer, or not an MoE family)."""
    family = _family(model)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if family is None:
        return [None] * len(layers)
    out: list[nn.Module | None] = []
    for layer in layers:
        mod: nn.Module | None = layer
        for name in family.path.split("."):
            mod = getattr(mod, name, None)
        out.append(mod if hasattr(mod, "top_k") else None)  # dense layers (Qwen3-MoE mlp_only_layers) have none
    return out


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router of every MoE layer of ``model``, in layer order ([] for dense models or unknown families)."""
    return [r for r in _layer_routers(model) if r is not None]


def moe_layer_indices(model: nn.Module) -> list[int]:
    """The decoder-layer indices of ``model``'s MoE layers: SGLang reports routed experts for every layer,
    relayrl keeps these."""
    return [i for i, r in enumerate(_layer_routers(model)) if r is not None]


def _top_k(router: nn.Module) -> int:
    return int(typing.cast(int, router.top_k))


def routing_shape(model: nn.Module) -> tuple[int, int] | None:
    """``(n_moe_layers, top_k)`` of an MoE model, None for a dense one."""
    routers = moe_routers(model)
    return (len(routers), _top_k(routers[0])) if routers else None


class RoutingRecorder:
    """Keeps the expert ids each router chose in the latest forward (generator side)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        self._last: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, out: tuple[torch.Tensor, ...]) -> None:
            self._last[i] = out[2]

        return hook

    def take(self) -> torch.Tensor:
        """``[tokens, n_moe_layers, top_k]`` int32 ids of the latest forward (on its device)."""
        last = [x for x in self._last if x is not None]
        if len(last) < len(self._last):
            raise RuntimeError("RoutingRecorder.take: a router did not run in the latest forward")
        ids = torch.stack(last, 1).to(torch.int32)
        self._last = [None] * len(self.routers)
        return ids

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class RoutingReplay:
    """Makes the routers use recorded expert ids (trainer side) and keeps their logits for the
    load-balancing loss. Set ``ids`` ([tokens, n_moe_layers, top_k], -1 = own choice) before a
    forward; None lets the routers choose as usual."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        family = _family(model)
        self.renormalize = bool(
            family and family.renormalize(typing.cast(PretrainedConfig, model.config).get_text_config())
        )
        self.num_experts = int(getattr(self.routers[0], "num_experts", 0)) if self.routers else 0
        self.top_k = _top_k(self.routers[0]) if self.routers else 0
        self.ids: torch.Tensor | None = None
        # the generator's recorded ids, compared (not replayed) when ``ids`` is None: expert flips
        self.recorded: torch.Tensor | None = None
        self.flips = [0, 0]  # (token, layer) routings of the latest forward: own top-k != recorded, recorded
        self.logits: list[torch.Tensor] = []  # router logits of the latest forward, per layer
        self.chosen: list[torch.Tensor] = []  # expert ids actually used, per layer
        self._handles: list[RemovableHandle] = [
            r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)
        ]

    def _hook(self, i: int) -> Callable[..., tuple[torch.Tensor, ...] | None]:
        def hook(module: nn.Module, args: object, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
            logits, scores, own = out[0], out[1], out[2]
            if i == 0:
                self.logits, self.chosen, self.flips = [], [], [0, 0]
            self.logits.append(logits)
            seen = self.ids if self.ids is not None else self.recorded
            if seen is not None and seen.shape[0] == own.shape[0]:
                rec = seen[:, i].to(own.device, torch.long)
                has = (rec >= 0).all(-1)
                differ = (rec.sort(-1).values != own.sort(-1).values).any(-1) & has
                self.flips = [self.flips[0] + int(differ.sum()), self.flips[1] + int(has.sum())]
            if self.ids is None:
                self.chosen.append(own)
                return None
            want = self.ids[:, i].to(own.device, torch.long)
            if want.shape != own.shape:
                raise ValueError(
                    f"routed_experts has {want.shape[0]} tokens x top_k {want.shape[1]} for MoE layer {i}, "
                    f"the forward routes {own.shape[0]} x {own.shape[1]}"
                )
            ids = torch.where(want >= 0, want, own)
            weights = torch.softmax(logits.float(), dim=-1).gather(1, ids)
            if self.renormalize:
                weights = weights / weights.sum(-1, keepdim=True)
            self.chosen.append(ids)
            return logits, weights.to(scores.dtype), ids

        return hook

    def aux_loss(self) -> torch.Tensor:
        """Switch-style load-balancing loss of the latest forward: ``E * sum_e f_e * P_e`` with
        ``f_e`` the share of (token, slot) picks of expert e and ``P_e`` its mean router
        probability, both pooled over the MoE layers (transformers' ``load_balancing_loss_func``
        with the experts actually used)."""
        if not self.logits:
            raise RuntimeError("RoutingReplay.aux_loss: no MoE forward ran")
        e = self.num_experts
        counts = torch.stack([torch.nn.functional.one_hot(c, e).sum((0, 1)).float() for c in self.chosen]).sum(0)
        probs = torch.stack([torch.softmax(lg.float(), -1).sum(0) for lg in self.logits]).sum(0)
        rows = float(sum(lg.shape[0] for lg in self.logits))
        return e * torch.sum((counts / rows) * (probs / rows))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def encode_routed_experts(ids: torch.Tensor) -> str:
    """SGLang's wire form of routed experts: base64 of the int32 ids, little-endian, row-major."""
    return base64.b64encode(ids.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()).decode("ascii")


def decode_routed_experts(data: str, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """The int32 tensor of ``shape`` that ``encode_routed_experts`` (or SGLang) sent as ``data``."""
    import numpy as np

    flat = np.frombuffer(base64.b64decode(data), dtype="<i4")
    n = math.prod(int(d) for d in shape)
    if flat.size != n:
        raise ValueError(f"routed_experts holds {flat.size} ids, shape {list(shape)} needs {n}")
    return torch.from_numpy(flat.astype(np.int32)).view(*[int(d) for d in shape])
