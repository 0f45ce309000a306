"""The actor, the critic and a minimal user-written actor, all on the ``TrainEngine`` interface.

Every algorithm of the family is a config of ``PPOActor``: the advantage estimator and the
policy loss are looked up by name in ``relayrl.train.algorithms``. The trainer step is::

    actor.prepare(batch, critic)     # old/prox/ref logprobs, values, advantages, returns
    stats = actor.ppo_update(batch)  # n_minibatches x ppo_epochs optimizer steps
    critic.update(batch)             # PPO with a critic only

Only ``engine.forward`` / ``engine.train_batch`` / ``engine.get_version`` are used, so the same
code runs on one process or under FSDP2. ``recipes/remax_reinforce.py`` shows the two-class pattern
for an algorithm of your own: a backend-agnostic actor plus whatever engine runs it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from relayrl.api.config import ActorConfig, ConfigError, check_overlong, validate_config
from relayrl.api.engine import TensorDict, TrainEngine
from relayrl.rollout.staleness import token_staleness
from relayrl.train import algorithms
from relayrl.train.distill import teacher_targets, token_reverse_kl
from relayrl.train.lmhead import token_stats_loss
from relayrl.train.mismatch import correction_weights, mismatch_metrics
from relayrl.train.packing import shifted, token_entropy, token_logprobs, unpack
from relayrl.train.teacher_server import server_teacher_targets
from relayrl.utils import dist as dist_utils
from relayrl.utils import stats as tracker


def minibatches(batch: TensorDict, n: int, generator: torch.Generator) -> Iterator[TensorDict]:
    """Shuffle the rows of ``batch`` and yield ``n`` (or fewer, for tiny batches) row subsets."""
    bsz = batch["input_ids"].shape[0]
    perm = torch.randperm(bsz, generator=generator)
    for idx in perm.chunk(min(n, bsz)):
        idx = idx.sort().values
        yield {k: v[idx] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == bsz}


def prefix_values(logits: torch.Tensor, packed: TensorDict) -> torch.Tensor:
    """``[T]`` token-aligned values of a value head: value ``t`` = V(tokens before ``t``).

    The head's output at token ``t - 1`` has seen exactly the prefix that token ``t`` was
    sampled from; 0 at the first token of each sequence.
    """
    return shifted(logits[:-1, 0].float(), packed)


class _StatsSink:
    """Collects per-micro-batch stats inside a loss closure, weighted like the loss."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}
        self.weight = 0.0

    def add(self, stats: dict[str, torch.Tensor], weight: float) -> None:
        self.weight += weight
        for k, v in stats.items():
            x = float(v.detach())
            if k.endswith("_max"):
                self.maxes[k] = max(self.maxes.get(k, x), x)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + x * weight

    def result(self) -> dict[str, float]:
        w = max(self.weight, 1e-12)
        return {**{k: v / w for k, v in self.sums.items()}, **self.maxes}


class _GapSink:
    """The trainer's logprobs and per-token entropies ``[B, L]`` of the update's first pass, scattered
    back from its packed micro-batches (rows by ``batch_row``), and the MoE expert flips the engine counted."""

    def __init__(self, batch: TensorDict) -> None:
        self.shape = tuple(batch["input_ids"].shape)
        self.sum = torch.zeros((3, *self.shape), dtype=torch.float64)  # logprobs, entropies, count
        self.flips = torch.zeros(2, dtype=torch.float64)  # (routings flipped, routings recorded)

    def add(self, before: torch.Tensor, entropy: torch.Tensor, packed: TensorDict) -> None:
        values = torch.stack([before.detach(), entropy.detach(), torch.ones_like(before)], -1).double().cpu()
        self.sum += unpack(values, {**packed, "row_index": packed["batch_row"]}, *self.shape).movedim(-1, 0)
        if "moe_expert_flips" in packed:
            self.flips += packed["moe_expert_flips"].cpu()

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs, entropies), every rank's share summed (a dummy micro-batch repeats a row: averaged away)."""
        total = dist_utils.all_reduce(self.sum)
        self.flips = dist_utils.all_reduce(self.flips)
        out = (total[:2] / total[2].clamp(min=1.0)).float()
        return out[0], out[1]


def check_actor_config(config: ActorConfig) -> None:
    """``ConfigError`` naming the ``actor.*`` field when the section is inconsistent or names an
    estimator / loss nobody registered. Runs before any model is built (Trainer) and again
    when an actor is made directly from code."""
    validate_config(config, "actor.")
    try:
        check_overlong(config, config.overlong_max_len)  # an actor alone has no gconfig: the limit is given
    except ValueError as e:
        raise ConfigError(str(e)) from None
    known = set(ActorConfig.__dataclass_fields__)
    for field, entry in (
        ("adv_estimator", algorithms.advantage_entry(config.adv_estimator)),
        ("loss", algorithms.loss_entry(config.loss)),
    ):
        unknown = [r for r in entry.reads if r not in known]
        if unknown:
            raise ConfigError(
                f"actor.{field}={getattr(config, field)!r} declares reads={unknown}, which are not actor.* fields"
            )


def needs_reference(config: ActorConfig) -> bool:
    """A reference model is built when ``kl_coef`` > 0 or the estimator or loss declares ``needs_ref``."""
    return (
        config.kl_coef > 0
        or algorithms.advantage_entry(config.adv_estimator).needs_ref
        or algorithms.loss_entry(config.loss).needs_ref
    )


def needs_teacher(config: ActorConfig) -> bool:
    """Distillation is on when ``distill_coef`` > 0 or the loss declares ``needs_teacher`` (``distill``)."""
    return config.distill_coef > 0 or algorithms.loss_entry(config.loss).needs_teacher


def needs_critic(config: ActorConfig) -> bool:
    """A value model is built when the estimator declares ``needs_critic`` (GAE)."""
    return algorithms.advantage_entry(config.adv_estimator).needs_critic


class PPOActor:
    """Policy-gradient actor: logprobs, advantages and the clipped update, configured by ``ActorConfig``."""

    def __init__(
        self,
        config: ActorConfig,
        engine: TrainEngine,
        ref_engine: TrainEngine | None = None,
        seed: int = 0,
        teacher_engine: TrainEngine | None = None,
    ):
        check_actor_config(config)
        self.config, self.engine, self.ref_engine = config, engine, ref_engine
        self.teacher_engine = teacher_engine  # distillation's local teacher (actor.teacher.path)
        self.needs_teacher = needs_teacher(config)
        # the registry entries: what the actor does follows their declarations, never their names
        self.advantage, self.loss = algorithms.advantage_entry(config.adv_estimator), algorithms.loss_entry(config.loss)
        self.needs_ref = needs_reference(config)
        # a run's actor config carries the sampling temperature (RunConfig.derived); an actor built alone: 1.0
        self.temperature = 1.0 if config.temperature is None else config.temperature
        self.generator = torch.Generator().manual_seed(seed)
        self.adv_stats: dict[str, float] = {}
        # the generator–trainer gap of the latest ppo_update (``mismatch/`` metrics) and the trainer's
        # logprobs it was measured on: the update's own forward before its first optimizer step
        self.mismatch: dict[str, float] = {}
        self.trainer_logp: torch.Tensor | None = None

    def reads(self, entry: algorithms.Algorithm[Any]) -> dict[str, object]:
        """The ``actor.*`` fields a registry entry declares (``reads=``), by name: its config arguments."""
        return {name: getattr(self.config, name) for name in entry.reads}

    # ---------------------------------------------------------------- forward passes

    def compute_logp(self, batch: TensorDict) -> torch.Tensor:
        """``[B, L]`` token-aligned logprobs of ``input_ids`` under the current policy at ``temperature``."""
        self.engine.eval()
        return self.engine.forward(self._routing(batch), temperature=self.temperature)

    def fill_teacher(self, batch: TensorDict) -> None:
        """Distillation: the teacher's ``teacher_logp`` (and ``teacher_ids``) for ``batch`` from the local teacher
        or the served one (``actor.teacher.url``), unless the batch already carries them (a workflow's own
        teacher) or distillation is off."""
        if not self.needs_teacher or "teacher_logp" in batch:
            return
        teacher = self.config.teacher
        if teacher.url:  # a served teacher: its top-k logprobs of each row's tokens
            key = os.environ.get(teacher.api_key_env, "") if teacher.api_key_env else ""
            batch.update(server_teacher_targets(batch, teacher.url, teacher.protocol, teacher.top_k,
                                                self.temperature, teacher.timeout, key))  # fmt: skip
        elif self.teacher_engine is not None:
            routed = self._routing(batch, replay=False)
            batch.update(teacher_targets(self.teacher_engine, routed, teacher.top_k, self.temperature))

    def _routing(self, batch: TensorDict, replay: bool | None = None) -> TensorDict:
        """The batch as the train engine should see it: without ``routed_experts`` unless routing is
        replayed (``actor.replay_routing``; the reference policy always picks its own experts)."""
        replay = self.config.replay_routing if replay is None else replay
        if replay or "routed_experts" not in batch:
            return batch
        # renamed, not dropped: the engine still counts where its own routing differs (expert flips)
        return {"recorded_experts" if k == "routed_experts" else k: v for k, v in batch.items()}

    def prepare(self, batch: TensorDict, critic: Critic | None = None) -> TensorDict:
        """The trainer's step before ``ppo_update``: every logprob the configured algorithm needs (the
        proximal / old policy's unless the update's own forward gives them, ``logp_from_update``; the
        reference's, the teacher's), the critic's values, then the advantages."""
        with tracker.record_timing("compute_logp"):
            self._fill_old_logp(batch)
            if self.needs_ref:  # the frozen reference's logprobs
                if self.ref_engine is None:
                    raise ValueError(
                        "actor.kl_coef > 0 (or an estimator / loss with needs_ref) needs a reference engine: "
                        "PPOActor(config, engine, ref_engine=...)"
                    )
                batch["ref_logp"] = self.ref_engine.forward(
                    self._routing(batch, replay=False), temperature=self.temperature
                )
            self.fill_teacher(batch)
            if self.advantage.needs_critic:
                if critic is None:
                    raise ValueError(
                        f"actor.adv_estimator={self.config.adv_estimator!r} needs a Critic: actor.prepare(batch, critic)"
                    )
                batch["values"] = critic.compute_values(batch)
        with tracker.record_timing("compute_advantages"):
            return self.compute_advantages(batch)

    # ---------------------------------------------------------------- advantages

    def compute_advantages(self, batch: TensorDict) -> TensorDict:
        """Reward shaping + the registered estimator; writes ``advantages`` and ``returns`` [B, L].

        With ``mask_truncated`` the rows flagged by the sequence-level key ``truncated`` leave
        the loss (their ``loss_mask`` becomes 0).
        """
        cfg = self.config
        mask = batch["loss_mask"].bool()
        lengths = mask.sum(1)
        if cfg.mask_truncated:
            if "truncated" not in batch:
                raise ValueError(
                    "actor.mask_truncated=true needs the sequence-level batch key 'truncated' [B] (set by the workflow)"
                )
            mask = mask & ~batch["truncated"].bool().unsqueeze(1)
            batch["loss_mask"] = mask.to(batch["loss_mask"].dtype)
        rewards = algorithms.shape_rewards(
            batch["rewards"].double(),
            cfg.reward_scale,
            cfg.reward_bias,
            cfg.reward_clip,
            response_lengths=lengths,
            max_len=cfg.overlong_max_len,
            overlong_buffer=cfg.overlong_buffer,
            overlong_penalty=cfg.overlong_penalty,
        )
        token_rewards = algorithms.last_token_rewards(rewards, mask)
        if cfg.kl_in_reward and cfg.kl_coef > 0:
            if "ref_logp" not in batch:
                raise ValueError("actor.kl_in_reward needs batch key 'ref_logp' (actor.prepare computes it)")
            logp = batch.get("prox_logp", batch.get("old_logp", batch["logprobs"]))
            kl = algorithms.kl_penalty(logp.double(), batch["ref_logp"].double(), cfg.kl_estimator) * mask
            token_rewards = token_rewards - cfg.kl_coef * kl
            rewards = token_rewards.sum(1)  # outcome estimators see the KL-penalised total
            self.adv_stats["kl_reward"] = float(algorithms.masked_mean(kl, mask))
        if self.advantage.needs_groups and "group_id" not in batch:
            raise ValueError(f"actor.adv_estimator={cfg.adv_estimator!r} needs the sequence-level batch key 'group_id'")
        values = batch.get("values")
        adv, ret = self.advantage.fn(
            rewards=rewards,
            loss_mask=mask,
            group_id=batch.get("group_id"),
            values=None if values is None else values.double(),
            baseline_rewards=batch.get("baseline_rewards"),
            token_rewards=token_rewards,
            **self.reads(self.advantage),
        )
        batch["advantages"], batch["returns"] = adv.float(), ret.float()
        self.adv_stats.update(
            {
                "reward_mean": float(batch["rewards"].float().mean()),
                "shaped_reward_mean": float(rewards.mean()),
                "adv_mean": float(algorithms.masked_mean(adv, mask)),
                "adv_abs_mean": float(algorithms.masked_mean(adv.abs(), mask)),
            }
        )
        return batch

    # ---------------------------------------------------------------- update

    def loss_weight(self, packed: TensorDict) -> float:
        """Micro-batch weight matching the aggregation: loss tokens, or sequences."""
        if self.config.loss_agg_mode == "token-mean":
            return float(packed["loss_mask"].bool().sum())
        return float(len(packed["cu_seqlens"]) - 1)

    def _loss_fn(self, sink: _StatsSink, gap: _GapSink | None = None):
        cfg = self.config
        policy_loss, reads = self.loss.fn, self.reads(self.loss)
        agg_mode, norm_len = cfg.loss_agg_mode, float(cfg.loss_norm_len)
        corr = cfg.rollout_correction

        def loss_fn(logits: torch.Tensor, packed: TensorDict) -> torch.Tensor:
            logp = token_logprobs(logits, packed, self.temperature)
            mask = packed["loss_mask"].bool()
            cu = packed["cu_seqlens"]
            before = logp.detach()  # the policy before this update, when logp_from_update
            # per-token entropy of this forward: the bonus's input (with grad) or, without one, detached;
            # the first pass records it (batch["entropy"]) with the logprobs
            if cfg.entropy_coef > 0:
                token_ent = token_entropy(logits, packed, self.temperature)
            else:
                with torch.no_grad():
                    token_ent = token_entropy(logits.detach(), packed, self.temperature)
            if gap is not None:
                gap.add(before, token_ent, packed)
            if self.loss.needs_prox_logp:
                prox = packed.get("prox_logp", before)
                # the loss's behaviour weight is pi_prox / pi_behav; with a rollout correction the correction's
                # weight (the same ratio, bounded) takes its place: old = prox makes the loss's own weight 1
                old = packed["logprobs"] if corr.mode == "off" else prox
            else:
                old, prox = packed.get("old_logp", before), None
            advantages = packed["advantages"]
            extra: dict[str, torch.Tensor] = {}  # stats of the correction and distillation
            if corr.mode != "off":  # the trainer's policy before the update (``old``) over the generator's
                w, keep = correction_weights(old, packed["logprobs"], mask, cu, corr)
                extra["correction_weight_mean"] = algorithms.masked_mean(w, mask)
                extra["correction_dropped_frac"] = algorithms.masked_mean((~keep).float(), mask)
                advantages = advantages * w
                mask = mask if corr.masked_in_norm else keep
            distill_kl = None
            if self.needs_teacher:  # per-token reverse KL to the teacher, reweighted like the advantages
                distill_kl = token_reverse_kl(logits, packed, self.temperature)
                distill_kl = distill_kl if corr.mode == "off" else distill_kl * w
                extra["distill_kl"] = algorithms.masked_mean(distill_kl.detach(), mask)
            loss, stats = policy_loss(
                logp=logp,
                old_logp=old,
                advantages=advantages,
                loss_mask=mask,
                cu_seqlens=cu,
                prox_logp=prox,
                ref_logp=packed.get("ref_logp"),
                distill_kl=distill_kl,
                **reads,
            )
            stats.update(extra, policy_loss=loss.detach())
            if distill_kl is not None and cfg.distill_coef > 0:
                loss = loss + cfg.distill_coef * algorithms.agg_loss(distill_kl, mask, cu, agg_mode, norm_len)
            # KL(behaviour || policy), k3 over the loss tokens: how far the policy has moved from the one
            # that generated them (staleness in async runs; any inference/training mismatch always)
            r = before - packed["logprobs"]
            stats["behav_kl"] = algorithms.masked_mean(r.exp() - 1 - r, mask)
            if cfg.kl_coef > 0 and not cfg.kl_in_reward:
                kl = algorithms.kl_loss(logp, packed["ref_logp"], mask, cu, cfg.kl_estimator, agg_mode, norm_len)
                loss = loss + cfg.kl_coef * kl
                stats["kl_loss"] = kl.detach()
            if cfg.entropy_coef > 0:
                ent = algorithms.entropy_bonus(token_ent, mask, cu, agg_mode, norm_len)
                loss = loss - cfg.entropy_coef * ent
            else:
                ent = algorithms.masked_mean(token_ent, mask)
            stats["entropy"] = ent.detach()
            if "moe_aux_loss" in packed:  # MoE models: the engine's load-balancing loss of this forward
                stats["moe_aux_loss"] = packed["moe_aux_loss"].detach()
                if cfg.moe_aux_loss_coef > 0:
                    loss = loss + cfg.moe_aux_loss_coef * packed["moe_aux_loss"]
            sink.add(stats, self.loss_weight(packed))
            return loss

        # it reads logprobs / entropies at loss tokens only: the engine may compute the LM head just there
        # (relayrl.train.lmhead); distillation's reverse KL needs the full distributions, so it keeps logits
        return loss_fn if self.needs_teacher else token_stats_loss(loss_fn)

    def recomputes_logp(self, batch: TensorDict) -> bool:
        """Whether the policy's logprobs before the update come from the trainer: a ``needs_prox_logp``
        loss's proximal policy; else ``recompute_logp``, or when it is None, whether the batch is on-policy
        (every loss token generated by the current weights). Otherwise the generator's logprobs are
        the old policy: the clip is then a trust region around the policy that generated the tokens."""
        c = self.config
        if self.loss.needs_prox_logp or c.rollout_correction.mode != "off":
            return True
        if c.recompute_logp is not None:
            return c.recompute_logp
        mask = batch["loss_mask"].bool()
        return not bool(mask.any()) or bool((batch["versions"][mask] == self.engine.get_version()).all())

    @property
    def logp_from_update(self) -> bool:
        """One optimizer step per batch (and ``reuse_update_logp``): when the trainer's logprobs are
        wanted (``recomputes_logp``), the update's own forward gives them: no separate pass."""
        c = self.config
        kl_reward = c.kl_in_reward and c.kl_coef > 0  # needs the policy's logprobs before the advantages
        return c.reuse_update_logp and c.ppo_epochs == 1 and c.n_minibatches == 1 and not kl_reward

    def _fill_old_logp(self, batch: TensorDict) -> None:
        """The ratio's denominator: ``prox_logp`` for a loss with ``needs_prox_logp`` (decoupled PPO), else ``old_logp``: the
        generator's ``logprobs`` unless ``recomputes_logp``, then the trainer's (``prox_logp`` if the
        trainer stored it under that name); nothing when the update's own forward gives them."""
        recompute = self.recomputes_logp(batch)
        if recompute and self.logp_from_update:
            return
        if self.loss.needs_prox_logp:
            if "prox_logp" not in batch:
                batch["prox_logp"] = self.compute_logp(batch)
        elif "old_logp" not in batch and not recompute:
            batch["old_logp"] = batch["logprobs"]
        elif "old_logp" not in batch:
            batch["old_logp"] = batch["prox_logp"] if "prox_logp" in batch else self.compute_logp(batch)

    def _logp_before_update(self, batch: TensorDict) -> torch.Tensor | None:
        """The trainer's logprobs at the weights before this update, for the ``mismatch/`` metrics:
        the proximal / recomputed old logprobs when the batch has them; None when the update's
        first pass gives them (one minibatch: no optimizer step before any row's forward); else one
        forward now, since a later minibatch's forward runs after the first optimizer step."""
        if "prox_logp" in batch:
            return batch["prox_logp"]
        if "old_logp" in batch and batch["old_logp"] is not batch["logprobs"]:
            return batch["old_logp"]
        if self.config.n_minibatches == 1:
            return None
        return self.compute_logp(batch)

    def ppo_update(self, batch: TensorDict) -> list[dict[str, float]]:
        """``ppo_epochs`` passes of ``n_minibatches`` optimizer steps each; one stats dict per step."""
        cfg = self.config
        self._fill_old_logp(batch)
        needed = ["advantages"] + (["ref_logp"] if self.needs_ref else [])  # (kl_coef > 0 needs the reference)
        self.fill_teacher(batch)
        missing = [k for k in needed if k not in batch]
        if missing:
            raise ValueError(f"ppo_update: batch is missing {missing}; call actor.prepare(batch) first")
        common = dict(self.adv_stats)
        if "versions" in batch:  # mean and max of engine version - token version over the loss tokens
            common.update(token_staleness(batch["versions"], batch["loss_mask"], self.engine.get_version()))
        before = self._logp_before_update(batch)
        self.engine.train()
        all_stats = []
        gap = _GapSink(batch)
        rows = {**batch, "batch_row": torch.arange(batch["input_ids"].shape[0])}
        for epoch in range(cfg.ppo_epochs):
            for mb in minibatches(rows, cfg.n_minibatches, self.generator):
                if not bool(mb["loss_mask"].bool().any()):
                    all_stats.append({**common, "epoch": float(epoch), "skipped": 1.0, "empty_minibatch": 1.0})
                    continue
                sink = _StatsSink()
                loss_fn = self._loss_fn(sink, gap if epoch == 0 else None)
                stats = self.engine.train_batch(self._routing(mb), loss_fn, self.loss_weight)
                all_stats.append({**common, **sink.result(), **stats, "epoch": float(epoch)})
        from_update, entropy = gap.result()  # (every rank joins its all-reduce)
        self.trainer_logp = from_update if before is None else before
        # per-token entropy of the update's first pass (saved rollouts carry it; relayrl inspect colours by it)
        batch["entropy"] = entropy
        self.mismatch = mismatch_metrics(
            batch["logprobs"],
            self.trainer_logp,
            batch["loss_mask"],
            batch.get("versions"),
            self.engine.get_version(),
            batch.get("truncated"),
            gap.flips.tolist(),
        )
        return all_stats


def report_steps(steps: list[dict[str, float]], scope: str) -> list[dict[str, float]]:
    """Report the means of per-optimizer-step stats over the steps not skipped, as ``scope/*``
    gauges (keys with a ``/`` and the bookkeeping ones stay out), plus the step counts; returns
    the skipped steps that had a non-finite loss or grad norm (the caller warns about them)."""
    done = [s for s in steps if not s.get("skipped")]
    means: dict[str, float] = {"optimizer_steps": float(len(steps)), "skipped_steps": float(len(steps) - len(done))}
    for key in done[0] if done else {}:
        if "/" not in key and key not in ("epoch", "skipped"):
            means[key] = sum(s[key] for s in done if key in s) / len(done)
    with tracker.scope(scope):
        tracker.gauge(**means)
    return [s for s in steps if s.get("skipped") and not s.get("empty_minibatch")]


class Critic:
    """A value model on a ``TrainEngine`` with a value head (``TorchTrainEngine(head="value")``)."""

    def __init__(self, config: ActorConfig, engine: TrainEngine, seed: int = 0):
        self.config, self.engine = config, engine
        self.generator = torch.Generator().manual_seed(seed)

    def compute_values(self, batch: TensorDict) -> torch.Tensor:
        """``[B, L]``: value ``t`` estimates the return from the state before token ``t``."""
        self.engine.eval()
        return self.engine.forward(batch, post_fn=prefix_values)

    def update(self, batch: TensorDict) -> list[dict[str, float]]:
        """Clipped value regression of ``values`` onto ``returns`` (minibatches x epochs)."""
        cfg = self.config
        for key in ("values", "returns"):
            if key not in batch:
                raise ValueError(f"Critic.update: batch is missing {key!r}; run actor.prepare(batch, critic) first")

        def weight(packed: TensorDict) -> float:
            return float(packed["loss_mask"].bool().sum())

        self.engine.train()
        out = []
        for _ in range(cfg.ppo_epochs):
            for mb in minibatches(batch, cfg.n_minibatches, self.generator):
                if not bool(mb["loss_mask"].bool().any()):
                    continue
                sink = _StatsSink()

                def loss_fn(logits: torch.Tensor, packed: TensorDict, sink: _StatsSink = sink) -> torch.Tensor:
                    loss, stats = algorithms.value_loss(
                        prefix_values(logits, packed),
                        packed["values"],
                        packed["returns"],
                        packed["loss_mask"].bool(),
                        packed["cu_seqlens"],
                        cfg.value_clip,
                    )
                    sink.add(stats, weight(packed))
                    return loss

                step = self.engine.train_batch(mb, loss_fn, weight)
                out.append({f"critic/{k}": v for k, v in {**sink.result(), **step}.items()})
        return out
