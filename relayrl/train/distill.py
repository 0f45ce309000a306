"""On-policy distillation: the per-token reverse KL from the policy (student) to a teacher, on the
student's own sampled tokens.

At every loss token ``t`` of a rollout the student's next-token distribution ``s_t`` (the policy's
logits before token ``t``, at the sampling temperature) and the teacher's ``q_t`` (the teacher run on
the same tokens) give ``KL(s_t || q_t) = sum_v s_t(v) (log s_t(v) - log q_t(v))``, differentiated
through ``s_t`` exactly (no sampling over the vocabulary). Two ways the teacher arrives (batch keys,
token-aligned like ``logprobs``: position ``t`` holds the distribution token ``t`` was drawn from):

- ``teacher_logp [B, L, V]`` alone: the teacher's full log-distribution (a local teacher,
  ``actor.teacher.top_k=0``): the exact reverse KL.
- ``teacher_logp [B, L, K]`` with ``teacher_ids [B, L, K]``: the teacher's top-k tokens and their
  logprobs (``actor.teacher.top_k=K``, or a server's top-k logprobs): both distributions are
  renormalised on those K tokens and the KL is taken there. It is exact when the K tokens hold all
  of both distributions' mass, and never negative; what it ignores is the mass outside them.

``actor.loss=distill`` (``relayrl.train.algorithms.distill_loss``) trains on the KL alone; ``actor.distill_coef`` adds ``coef x KL`` to any
policy loss (aggregated like it, over the same tokens, reweighted by a rollout correction).
"""

from __future__ import annotations

import torch

from relayrl.api.engine import TensorDict, TrainEngine
from relayrl.train.lmhead import loss_positions
from relayrl.train.packing import shifted

Tensor = torch.Tensor


def reverse_kl(student_logp: Tensor, teacher_logp: Tensor, teacher_ids: Tensor | None = None) -> Tensor:
    """``[N]`` KL(student || teacher) per row of ``student_logp [N, V]`` (log-softmaxed) and the teacher's
    ``[N, V]`` log-distribution, or its top-k ``[N, K]`` logprobs at token ids ``teacher_ids [N, K]``."""
    if teacher_ids is None:
        if teacher_logp.shape != student_logp.shape:
            raise ValueError(
                f"teacher_logp {tuple(teacher_logp.shape)} must match the student's {tuple(student_logp.shape)} "
                "over the full vocabulary (same tokenizer), or come with teacher_ids (top-k)"
            )
        s, t = student_logp, teacher_logp
    else:
        s = student_logp.gather(-1, teacher_ids.long())
        s = s - torch.logsumexp(s, -1, keepdim=True)
        t = teacher_logp - torch.logsumexp(teacher_logp, -1, keepdim=True)
    return (s.exp() * (s - t)).sum(-1)


def token_reverse_kl(
    logits: Tensor, packed: TensorDict, temperature: float = 1.0, teacher: TensorDict | None = None
) -> Tensor:
    """``[T]`` per-token reverse KL of the packed micro-batch (0 off the loss tokens), differentiable
    through ``logits [T, V]``; the teacher from ``teacher`` or the packed batch (``teacher_logp``/``_ids``)."""
    source = packed if teacher is None else teacher
    if "teacher_logp" not in source:
        raise ValueError(
            "distillation needs the batch key 'teacher_logp': set actor.teacher.path (a local teacher), or attach "
            "teacher_logp [1, L, K] and teacher_ids [1, L, K] to each trajectory in the workflow (a server teacher)"
        )
    pos = loss_positions(packed)
    student = torch.log_softmax(logits[pos - 1].float() / temperature, -1)  # logits[p - 1] predicted token p
    ids = source.get("teacher_ids")
    kl = reverse_kl(student, source["teacher_logp"][pos].float(), None if ids is None else ids[pos])
    return logits.new_zeros(logits.shape[0], dtype=torch.float32).index_put((pos,), kl)


@torch.no_grad()
def teacher_targets(engine: TrainEngine, batch: TensorDict, top_k: int, temperature: float) -> TensorDict:
    """The teacher's batch keys for ``batch``: ``teacher_logp`` ``[B, L, V]``, or with ``top_k`` its top-k
    logprobs ``[B, L, k]`` and their ``teacher_ids`` (the forward carries both as ``2k`` floats: ids exact below 2^24)."""

    def post(logits: Tensor, packed: TensorDict) -> Tensor:  # row t: the distribution token t is drawn from
        logp = torch.log_softmax(logits.float() / temperature, -1)
        if top_k:
            values, ids = logp.topk(min(top_k, logp.shape[-1]), -1)
            logp = torch.cat([values, ids.float()], -1)
        return shifted(logp[:-1], packed)

    engine.eval()
    out = engine.forward(batch, post_fn=post)
    if not top_k:
        return {"teacher_logp": out}
    k = out.shape[-1] // 2
    return {"teacher_logp": out[..., :k].contiguous(), "teacher_ids": out[..., k:].long()}
