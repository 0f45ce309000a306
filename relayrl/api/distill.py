"""``actor.teacher``: the teacher of on-policy distillation (``actor.loss=distill`` or ``actor.distill_coef``;
docs/distillation.md)."""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.api.fields import f


@dataclass
class TeacherConfig:
    path: str = f(
        "",
        help="The teacher model, loaded in the trainer like the reference policy: any model.path relayrl loads (a "
        "Hugging Face directory or id, a checkpoint directory, a tiny preset); it must share the student's "
        "tokenizer. Empty: no local teacher, the batch must carry teacher_logp (and teacher_ids) from the workflow.",
    )
    top_k: int = f(
        0,
        help="0: the reverse KL over the full vocabulary (the teacher's whole next-token distribution at every "
        "loss token, [B, L, vocab] floats per batch); k > 0: over the teacher's k most likely tokens at each "
        "position, both distributions renormalised on them (the estimate a server's top-k logprobs give).",
        ge=0,
    )
