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
    url: str = f(
        "",
        help="A teacher served by real SGLang or vLLM (host:port or http://...): each row's tokens are scored there "
        "and its top-k logprobs (actor.teacher.top_k >= 1) are the teacher (relayrl.train.teacher_server). "
        "Exclusive with path; it must serve a model with the student's tokenizer.",
    )
    protocol: str = f("sglang", help="The teacher server's API: sglang (/generate: SGLang or relayrl serve) or vllm (/v1/completions).",
                      choices=["sglang", "vllm"])  # fmt: skip
    api_key_env: str = f(
        "",
        help="The environment variable holding the teacher server's API key (sent as a Bearer token; never "
        "written to the config or logs). Empty: no key.",
    )
    timeout: float = f(300.0, help="Seconds a teacher server has to score one row.", gt=0.0)

    def validate(self) -> None:
        if self.url and self.path:
            raise ValueError("path and actor.teacher.url are exclusive: a local teacher or a served one")
        if self.url and self.top_k < 1:
            raise ValueError("url gives the server's top-k logprobs: set actor.teacher.top_k >= 1 (e.g. 20)")
