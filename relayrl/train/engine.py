"""TorchTrainEngine: packed micro-batches, AdamW, LR schedules, FSDP2, checkpoints, weight sync.

One process needs no torch.distributed. Under ``torchrun`` every rank is handed the same
padded batch; each rank takes a token-balanced share of its sequences, packs them into
micro-batches of at most ``mb_max_tokens`` tokens (the same count on every rank) and
weights each micro-batch's loss by ``loss_weight_fn(mb) / sum of weights over all ranks``,
so the summed gradient equals the gradient of the unsplit batch on one process.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import inspect
import math
import os
import typing
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForTokenClassification, PreTrainedModel

from relayrl.api.config import ModelConfig, TrainEngineConfig
from relayrl.api.engine import InferenceEngine, LossFn, LossWeightFn, PostFn, TensorDict, TrainEngine
from relayrl.api.io import SaveLoadMeta, WeightUpdate
from relayrl.rewards.model import RewardModelFn
from relayrl.train import lora
from relayrl.train.fastpath import CheckedForward
from relayrl.train.heads import last_token_post, scalar_head_from_lm, token_values
from relayrl.train.lmhead import TokenStats, wants_token_stats
from relayrl.train.mismatch import disable_dropout
from relayrl.train.packing import (
    VARLEN_ATTN,
    model_inputs,
    pack,
    resolve_attn_impl,
    split_by_token_budget,
    token_logprobs,
    unpack,
    vision_tokens,
)
from relayrl.train.prefix import SharedPrefix, plan_micro_batches, shared_layout
from relayrl.train.schedule import lr_factor
from relayrl.train.vision import vision_forward
from relayrl.utils import dist as dist_utils
from relayrl.utils.moe import RoutingReplay, routing_shape
from relayrl.utils.safeload import load_state_file

HEADS = ("lm", "value", "reward")
TRAIN_STATE = "train_state.pt"


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a NaN/inf loss or gradient."""


class TorchTrainEngine(TrainEngine):
    """A TrainEngine over any HF causal LM (``head="lm"``), a critic (``"value"``: one scalar
    per token) or a reward model (``"reward"``: the last token's scalar). ``trainable=False``
    makes a frozen model (e.g. the reference policy) with no optimizer. A trainable policy with
    ``model.lora.rank > 0`` trains LoRA adapters only (``relayrl.train.lora``)."""

    def __init__(
        self,
        config: TrainEngineConfig,
        model_config: ModelConfig,
        model: PreTrainedModel | None = None,
        head: str = "lm",
        trainable: bool = True,
        seed: int = 0,
    ):
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {head!r}")
        self.config, self.model_config = config, model_config
        self.head, self.trainable, self.seed = head, trainable, seed
        self._init_model = model
        self.model: PreTrainedModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.device = torch.device("cpu")
        self._version = 0
        self._steps = 0  # optimizer steps taken (skipped ones excluded)
        self._nan_skips = 0  # consecutive skipped steps
        self.lora = head == "lm" and trainable and model_config.lora.rank > 0
        self._head_ok: bool | None = None  # the LM-head fast path applies to this model (decided once)
        self._moe: RoutingReplay | None = None  # MoE models: routed-experts replay and the router statistics
        # model.dtype=float16, trainable: fp32 master weights, fp16 autocast and dynamic loss scaling
        self.fp16 = trainable and model_config.dtype == "float16"
        self.scaler: torch.amp.GradScaler | None = None

    # ---------------------------------------------------------------- setup

    def initialize(self) -> None:
        dist_utils.maybe_init_process_group(self.config.collective_timeout)
        self.device = dist_utils.device_for_rank()
        torch.manual_seed(self.seed)
        model = self._build_model()
        model.config.use_cache = False
        if not self.config.dropout:  # before LoRA: the adapters' own dropout is model.lora.dropout's
            disable_dropout(model)
        model.set_attn_implementation(resolve_attn_impl(self.model_config.attn_impl, self.device))
        if self.model_config.gradient_checkpointing and self.trainable:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:  # before sharding: FSDP2 then shards the adapters with their layers
            model = typing.cast(PreTrainedModel, lora.apply_lora(model, self.model_config.lora))
        typing.cast(nn.Module, model).to(self.device)  # (transformers types PreTrainedModel.to oddly)
        if not self.trainable:
            model.requires_grad_(False)
        if self.fp16:  # fp16 parameters cannot take small AdamW updates: the optimizer keeps fp32 ones
            typing.cast(nn.Module, model).float()
            self.scaler = torch.amp.GradScaler(self.device.type)
        if dist_utils.is_distributed() and self.config.fsdp:
            dist_utils.apply_fsdp2(model)
        elif dist_utils.is_distributed():  # replicated: start from rank 0's weights
            for p in model.parameters():
                dist_utils.broadcast_(p.data, src=0)
        self.model = model
        self._checked = CheckedForward(model, self.config.bf16, self.device)  # flash-attn / bf16: checked at first use
        self.model.train(self.trainable)
        # the policy's MoE routers replay the generator's experts (a value/reward head routes on its own)
        self._moe = RoutingReplay(model) if self.head == "lm" and routing_shape(model) is not None else None
        if self.trainable:
            opt = self.config.optimizer
            if opt.lr_schedule != "constant" and self.config.total_steps <= 0:
                raise ValueError(f"train.total_steps must be > 0 for optimizer.lr_schedule={opt.lr_schedule!r}")
            self.optimizer = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad],
                lr=opt.lr,
                betas=(opt.beta1, opt.beta2),
                eps=opt.eps,
                weight_decay=opt.weight_decay,
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda s: lr_factor(s, opt, self.config.total_steps)
            )

    def _build_model(self) -> PreTrainedModel:
        from relayrl.data.models import TINY_PRESETS, load_model

        given = self._init_model
        if self.head == "lm":
            return given if given is not None else load_model(self.model_config, seed=self.seed)
        if given is not None:
            # a ready-made critic / reward model keeps its head: ``score``, or ``classifier`` (GPT-2, GPT-NeoX)
            has_head = hasattr(given, "score") or hasattr(given, "classifier")
            is_scalar = getattr(given.config, "num_labels", 0) == 1 and has_head
            return given if is_scalar else scalar_head_from_lm(given, self.seed)
        if self.model_config.path in TINY_PRESETS:
            return scalar_head_from_lm(load_model(self.model_config, seed=self.seed), self.seed)
        # a saved critic / reward model (or an LM checkpoint, whose head is then new)
        return AutoModelForTokenClassification.from_pretrained(
            self.model_config.path, num_labels=1, classifier_dropout=0.0, dtype=getattr(torch, self.model_config.dtype)
        )

    def destroy(self) -> None:
        self.model = self.optimizer = self.scheduler = self._init_model = None

    def train(self, mode: bool = True) -> None:
        self._require().train(mode)

    def _require(self) -> PreTrainedModel:
        if self.model is None:
            raise RuntimeError("TorchTrainEngine is not initialized; call initialize() first")
        return self.model

    # ---------------------------------------------------------------- micro-batches

    def _plan(self, batch: TensorDict, shared: bool = False) -> list[list[int]]:
        """Rows of each of this rank's micro-batches (possibly empty lists: dummy micro-batches); ``shared``:
        a tree's rows together, the budget counting the tokens the shared-prefix layout computes."""
        if "attention_mask" not in batch or "input_ids" not in batch:
            raise ValueError(f"batch needs 'input_ids' and 'attention_mask', got keys {sorted(batch)}")
        # the vision tower's patches count too: a row with images costs its tokens plus its patches
        lengths = [
            n + v for n, v in zip(batch["attention_mask"].bool().sum(1).tolist(), vision_tokens(batch), strict=True)
        ]
        budget = self.config.mb_max_tokens
        world = dist_utils.world_size()
        if world == 1 and shared:
            return plan_micro_batches(batch["input_ids"], lengths, budget)
        if world == 1:
            return split_by_token_budget(lengths, budget)
        if len(lengths) < world:
            raise ValueError(f"batch has {len(lengths)} sequences, fewer than the {world} ranks that share it")
        shares = split_by_token_budget(lengths, sum(lengths) + 1, min_groups=world, multiple_of=world)
        n_mb = max(len(split_by_token_budget([lengths[i] for i in s], budget)) for s in shares)
        mine = shares[dist_utils.rank()]
        return [
            [mine[j] for j in g] for g in split_by_token_budget([lengths[i] for i in mine], budget, min_groups=n_mb)
        ]

    def _micro_batches(self, batch: TensorDict, shared: bool = False) -> Iterator[tuple[TensorDict, bool]]:
        """(packed micro-batch on the device, is_dummy); a dummy re-packs row 0 so every rank runs alike."""
        for rows in self._plan(batch, shared):
            yield self._to_device(pack(batch, rows or [0])), not rows

    @contextlib.contextmanager
    def _forward_on(self, packed: TensorDict) -> Iterator[TensorDict]:
        """``packed`` on the device, for one forward of the model. MoE models: the routers use its
        ``routed_experts`` when it has them (replay; the ids stay set until the next micro-batch, so
        activation checkpointing recomputes the same routing), and after the forward
        ``packed["moe_aux_loss"]`` holds its 0-d, differentiable load-balancing loss and
        ``packed["moe_expert_flips"]`` how many routings differ from ``recorded_experts``."""
        moved = self._to_device(packed)
        if self._moe is not None:
            self._moe.ids = moved.get("routed_experts")
            self._moe.recorded = moved.get("recorded_experts")
        yield moved
        if self._moe is not None:
            packed["moe_aux_loss"] = self._moe.aux_loss()
            packed["moe_expert_flips"] = torch.tensor(self._moe.flips, dtype=torch.float64)

    def _logits(self, packed: TensorDict, shared: bool = False) -> torch.Tensor:
        """``[T, V]`` logits (``[T, 1]`` for value/reward heads) of one packed micro-batch; ``shared``:
        in the shared-prefix layout where it applies (``_shared_layout``), the same logits.
        Vision-language models: the vision tower runs on the micro-batch's images (``image_grid_thw``)."""
        with self._forward_on(packed) as moved:
            model, inputs = self._require(), model_inputs(moved)
            layout = self._shared_layout(moved) if shared else None
            if layout is not None:  # the model lays the plain layout's positions out itself (hidden[index])
                inputs = {**layout.model_inputs(), "logits_to_keep": layout.index}
            images: contextlib.AbstractContextManager[dict[str, object]] = (
                vision_forward(model, moved) if "image_grid_thw" in moved else contextlib.nullcontext({})
            )
            fp16: contextlib.AbstractContextManager[None] = (
                torch.autocast(self.device.type, dtype=torch.float16) if self.fp16 else contextlib.nullcontext()
            )
            with fp16, images as extra:
                return self._checked(lambda: model(**{**inputs, **extra}).logits[0])

    # logits a softcap / scale changes after lm_head: the fast path would differ, so they keep full logits
    _SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")

    def _head_stats_ok(self, packed: TensorDict) -> bool:
        """Whether this micro-batch may take the LM-head fast path (``relayrl.train.lmhead``): only where it
        gives the plain path's numbers (a plain ``nn.Linear`` head, unscaled logits, no autocast) and can run
        (no images; no FSDP2, whose head weight is sharded outside the root forward)."""
        model = self._require()
        if not self._plain_lm(packed) or "loss_mask" not in packed or dist_utils.is_fsdp(model):
            return False
        if self._head_ok is None:
            head = model.get_output_embeddings()
            cfgs = [model.config, getattr(model.config, "text_config", None)]
            scaled = any(
                getattr(c, a, None) not in (None, 1, 1.0) for c in cfgs if c is not None for a in self._SCALED_LOGITS
            )
            self._head_ok = (
                type(head) is nn.Linear
                and not scaled
                and self._takes_logits_to_keep()
                and not any(hasattr(p, "full_tensor") for p in model.parameters())
            )
        return self._head_ok

    def _plain_lm(self, batch: TensorDict) -> bool:
        """A policy forward without adapters, fp16 / bf16 autocast or images: what both fast paths need."""
        return self.head == "lm" and not (self.lora or self.fp16 or self._checked.bf16 or "image_grid_thw" in batch)

    def _takes_logits_to_keep(self) -> bool:
        return "logits_to_keep" in inspect.signature(self._require().forward).parameters

    def _shares(self, batch: TensorDict) -> bool:
        """Whether the shared-prefix layout (``relayrl.train.prefix``) may run on this (packed) batch: a plain
        ``lm`` forward in one process on ``relayrl_varlen`` attention (not under MoE, whose routing replay and
        load-balancing loss are per plain token)."""
        if self.config.shared_prefix == "off" or not self._plain_lm(batch) or self._moe is not None:
            return False
        if hasattr(self._require(), "peft_config") or self._checked.flash or self._checked.tested_attn != VARLEN_ATTN:
            return False
        return not dist_utils.is_distributed() and self._takes_logits_to_keep()

    def _shared_layout(self, packed: TensorDict) -> SharedPrefix | None:
        """The micro-batch's shared-prefix layout on the device, or None (no rows share a prompt, or not ``_shares``)."""
        layout = shared_layout(packed) if self._shares(packed) else None
        return None if layout is None else layout.to(self.device)

    def _head_stats(self, packed: TensorDict) -> TokenStats:
        """The model body's final hidden states ``[T, H]`` wrapped as a ``TokenStats``. The model's own
        forward runs (its hooks, MoE replay, FSDP's root hooks all as usual) with ``logits_to_keep=1``;
        a forward hook on the base model takes its ``last_hidden_state``."""
        model = self._require()
        body = getattr(model, model.base_model_prefix)
        seen: list[torch.Tensor] = []

        def grab(_m: nn.Module, _a: object, out: object) -> None:
            seen.append(out[0] if isinstance(out, tuple) else out.last_hidden_state)  # type: ignore[attr-defined]

        with self._forward_on(packed) as moved:
            layout = self._shared_layout(moved)
            inputs = model_inputs(moved) if layout is None else layout.model_inputs()

            def run() -> torch.Tensor:
                seen.clear()
                handle = body.register_forward_hook(grab)
                try:
                    model(**inputs, logits_to_keep=1)
                finally:
                    handle.remove()
                return seen[-1][0] if layout is None else seen[-1][0][layout.index]

            hidden = self._checked(run)
        return TokenStats(hidden, typing.cast(nn.Linear, model.get_output_embeddings()), moved)

    def _shares_loss(self, loss_fn: LossFn, batch: TensorDict) -> bool:
        """Whether ``loss_fn``'s micro-batches take the shared-prefix layout: a ``token_stats_loss`` on the LM-head fast path."""
        return wants_token_stats(loss_fn) and self._head_stats_ok(batch) and self._shares(batch)

    def _loss_input(self, loss_fn: LossFn, packed: TensorDict) -> torch.Tensor:
        """What ``loss_fn`` gets: a ``TokenStats`` for a ``token_stats_loss`` where the fast path
        applies (it speaks ``token_logprobs`` / ``token_entropy``), else the ``[T, V]`` logits."""
        if wants_token_stats(loss_fn) and self._head_stats_ok(packed):
            return typing.cast(torch.Tensor, self._head_stats(packed))
        return self._logits(packed)

    def _to_device(self, packed: TensorDict) -> TensorDict:
        return {k: v.to(self.device) for k, v in packed.items()}

    # ---------------------------------------------------------------- forward / eval

    @torch.no_grad()
    def forward(self, batch: TensorDict, post_fn: PostFn | None = None, temperature: float = 1.0) -> torch.Tensor:
        """``[B, L]`` token-aligned values (0 on padding); default: logprobs at ``temperature``
        for ``head="lm"``, per-token values for ``"value"``, the score at each sequence's last
        token for ``"reward"``. A ``post_fn`` returning ``[T, ...]`` gives ``[B, L, ...]`` (e.g. the
        teacher's distributions of distillation). Every rank returns the full ``[B, L, ...]``."""
        lm_post = functools.partial(token_logprobs, temperature=temperature)
        defaults: dict[str, PostFn] = {"lm": lm_post, "value": token_values, "reward": last_token_post}
        post = post_fn or defaults[self.head]
        bsz, seqlen = batch["input_ids"].shape
        out: torch.Tensor | None = None
        shared = self._shares(batch)
        for packed, dummy in self._micro_batches(batch, shared):
            values = post(self._logits(packed, shared), packed)
            if out is None:
                out = torch.zeros(bsz, seqlen, *values.shape[1:], dtype=torch.float32)
            if not dummy:
                out += unpack(values.float().cpu(), packed, bsz, seqlen)
        assert out is not None  # (every rank runs at least one micro-batch, a dummy one if need be)
        return dist_utils.all_reduce(out)  # every rank computed its share of the rows

    @torch.no_grad()
    def score(self, batch: TensorDict) -> torch.Tensor:
        """``[B]`` last-token scores (``head="reward"``)."""
        lengths = batch["attention_mask"].bool().sum(1)
        values = self.forward(batch, post_fn=last_token_post)
        return values[torch.arange(values.shape[0]), lengths - 1]

    def as_reward_fn(self, max_batch: int = 64) -> RewardModelFn:
        """An async reward fn scoring prompt_ids + completion_ids; calls made together share one forward
        (``relayrl.rewards.model``)."""
        if self.head != "reward":
            raise ValueError(f"as_reward_fn needs head='reward', this engine has head={self.head!r}")
        return RewardModelFn(self.score, max_batch)

    @torch.no_grad()
    def eval_batch(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> float:
        total = weight = 0.0
        for packed, dummy in self._micro_batches(batch, self._shares_loss(loss_fn, batch)):
            loss = loss_fn(self._loss_input(loss_fn, packed), packed)
            if not dummy:
                w = float(loss_weight_fn(packed))
                total += float(loss) * w
                weight += w
        weight = dist_utils.all_reduce_sum(weight)
        if weight <= 0:
            raise ValueError("eval_batch: loss_weight_fn gave a total weight of 0 (no loss tokens?)")
        return dist_utils.all_reduce_sum(total) / weight

    # ---------------------------------------------------------------- training

    def train_batch(self, batch: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """One optimizer step: ``sum_mb loss_fn(mb) * w(mb) / sum_w`` over all ranks' micro-batches."""
        model = self._require()
        if self.optimizer is None:
            raise RuntimeError("train_batch on a frozen engine (trainable=False)")
        shared = self._shares_loss(loss_fn, batch)
        mbs = list(self._micro_batches(batch, shared))
        weights = [0.0 if dummy else float(loss_weight_fn(p)) for p, dummy in mbs]
        total_w = dist_utils.all_reduce_sum(sum(weights))
        if not total_w > 0:
            raise ValueError(f"train_batch: total loss weight is {total_w}; loss_weight_fn must be > 0 on the batch")
        fsdp = dist_utils.is_fsdp(model)
        # FSDP2 averages gradients over ranks; we want the sum of the weighted losses.
        scale = dist_utils.world_size() if fsdp else 1.0
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, n_tokens = 0.0, 0
        for i, ((packed, dummy), w) in enumerate(zip(mbs, weights, strict=True)):
            if fsdp:
                typing.cast(FSDPModule, model).set_requires_gradient_sync(i == len(mbs) - 1)
            loss = loss_fn(self._loss_input(loss_fn, packed), packed)
            part = loss * (0.0 if dummy else w / total_w * scale)
            (part if self.scaler is None else self.scaler.scale(part)).backward()
            if not dummy:
                loss_sum += float(loss.detach()) * w
                n_tokens += int(packed["input_ids"].numel())
        params = [p for p in model.parameters() if p.requires_grad]
        if dist_utils.is_distributed() and not fsdp:
            for p in params:
                if p.grad is not None:
                    dist_utils.all_reduce_(p.grad)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = self.config.optimizer.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        loss_value = dist_utils.all_reduce_sum(loss_sum) / total_w
        lr = float(self.optimizer.param_groups[0]["lr"])
        finite = math.isfinite(float(grad_norm)) and math.isfinite(loss_value)
        # fp16: an overflowed step (finite loss, inf gradient) is skipped and the loss scale halved, no error
        overflow = self.scaler is not None and math.isfinite(loss_value) and not finite
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # (skips the step itself when the gradients overflowed)
            self.scaler.update()
        if finite:
            if self.scaler is None:
                self.optimizer.step()
            if self.scheduler is not None:  # stepped where the optimizer steps: no training loop can forget it
                self.scheduler.step()
            self._steps += 1
            self._nan_skips = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self._nan_skips += 0 if overflow else 1
            if self._nan_skips > self.config.max_nan_skips:
                raise NonFiniteError(
                    f"{self._nan_skips} consecutive steps had a non-finite loss ({loss_value}) or grad norm "
                    f"({float(grad_norm)}); train.max_nan_skips={self.config.max_nan_skips}"
                )
        out = {
            "loss": loss_value,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "skipped": 0.0 if finite else 1.0,
            "n_tokens": dist_utils.all_reduce_sum(n_tokens),
            "n_mbs": float(len(mbs)),
        }
        if self.scaler is not None:
            out["loss_scale"] = float(self.scaler.get_scale())
        return out

    def get_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else 0.0

    # ---------------------------------------------------------------- versions, weights

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = int(version)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU state dict (a collective under FSDP2: call on every rank)."""
        return dist_utils.full_model_state_dict(self._require())

    def update_weights(self, target: InferenceEngine | None) -> None:
        """Push the full weights to ``target`` as ``WeightUpdate(kind="tensors")`` from rank 0
        (with LoRA: the base weights with the adapters merged in, under the base model's names; or,
        to a target that ``accepts_adapters``, the adapter alone as ``kind="adapter"``).

        Every rank must call it (the weights are gathered collectively); only rank 0 talks to
        the target, which picks the transport (in-process copy; for servers a disk dir, an HTTP
        upload or a collective broadcast: ``inference.weight_sync``).
        """
        if self.head != "lm":
            raise ValueError(f"update_weights pushes policy weights; this engine has head={self.head!r}")
        model = self._require()
        # unsharded: the tensors stay on the trainer's device (an engine on the same GPU copies them
        # device to device, no trip through host memory); FSDP2 gathers a full CPU copy
        tensors = self.state_dict() if dist_utils.is_fsdp(model) else dict(model.state_dict())
        if dist_utils.rank() == 0:
            if target is None:
                raise ValueError("update_weights: rank 0 needs the inference engine to push to (None on other ranks)")
            if self.lora and target.accepts_adapters:  # the adapter alone, as peft saves it
                adapter = {k: v.detach().to("cpu").clone() for k, v in lora.adapter_state_dict(tensors).items()}
                config = lora.adapter_config_json(model, self.model_config.path)
                update = WeightUpdate(
                    kind="adapter", version=self.get_version(), tensors=adapter, adapter_config=config
                )
            else:
                if self.lora:  # merged into new tensors: the base weights are never touched
                    tensors = lora.merged_state_dict(tensors, lora.lora_layers(model))
                tensors = {k: v.detach().clone() for k, v in tensors.items()}
                update = WeightUpdate(kind="tensors", version=self.get_version(), tensors=tensors)
            target.update_weights(update)
        dist_utils.barrier()

    # ---------------------------------------------------------------- checkpoints

    def save(self, meta: SaveLoadMeta) -> None:
        """HF weights (safetensors) at ``meta.path`` (with LoRA: the peft adapter, as
        ``PeftModel.save_pretrained`` writes it); with ``with_optim`` also ``train_state.pt``
        (optimizer, scheduler, step, version). The RNGs are the trainer's to save (``rng.pt``, taken
        at the step boundary): the engine's own copy, taken later, was overwritten on every resume."""
        model = self._require()
        os.makedirs(meta.path, exist_ok=True)
        weights = self.state_dict()
        optim = dist_utils.full_optim_state_dict(model, self.optimizer) if meta.with_optim and self.optimizer else None
        if dist_utils.rank() == 0:
            if self.lora:  # the base model's path goes into adapter_config.json, as peft records it
                base = self.model_config.path  # absolute when a directory: the adapter loads from anywhere
                model.peft_config[lora.ADAPTER].base_model_name_or_path = (
                    str(Path(base).resolve()) if Path(base).is_dir() else base
                )
                weights = lora.adapter_state_dict(weights)
            model.save_pretrained(meta.path, state_dict=weights)
            if meta.with_optim:
                torch.save(
                    {
                        "optimizer": optim,
                        "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                        "steps": self._steps,
                        "version": self._version,
                        "nan_skips": self._nan_skips,
                    },
                    os.path.join(meta.path, TRAIN_STATE),
                )
        dist_utils.barrier()

    def load(self, meta: SaveLoadMeta) -> None:
        """Load HF weights (with LoRA: the adapter) from ``meta.path``; with ``with_optim`` the
        training state as well."""
        model = self._require()
        if self.lora:
            dist_utils.load_full_model_state_dict(
                model, lora.read_adapter(meta.path, list(model.state_dict())), partial=True
            )
        else:
            files = sorted(glob.glob(os.path.join(meta.path, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no *.safetensors weights in {meta.path}")
            state = {k: v for fname in files for k, v in load_file(fname).items()}
            if not state.keys() <= model.state_dict().keys():  # saved in the hub format transformers converts from
                from relayrl.data.models import checkpoint_state_dict

                state = checkpoint_state_dict(meta.path)
            dist_utils.load_full_model_state_dict(model, state)
        if not meta.with_optim:
            return
        path = os.path.join(meta.path, TRAIN_STATE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found; was the checkpoint saved with with_optim=True?")
        ts = load_state_file(path)
        if self.optimizer is not None and ts["optimizer"] is not None:
            dist_utils.load_full_optim_state_dict(model, self.optimizer, ts["optimizer"])
        if self.scheduler is not None and ts["scheduler"] is not None:
            self.scheduler.load_state_dict(ts["scheduler"])
        self._steps, self._version, self._nan_skips = ts["steps"], ts["version"], ts["nan_skips"]


__all__ = ["NonFiniteError", "TorchTrainEngine", "lr_factor"]
