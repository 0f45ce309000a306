"""A generative judge: ask an LLM to grade an answer, as a step inside any workflow.

The judge formats ``template`` with the question, the answer and the reference, sends it as
a user turn to an engine (its own, e.g. a second model, or the policy's engine passed at call
time) with greedy decoding, and turns the reply into a float with ``parse_fn`` (default: the
first number in the reply, clipped to [0, 1]; 0.0 when there is none).

It is an async reward fn: ``await judge(engine, prompt=..., completions=..., **data)``, so it
can be passed as ``reward_fn`` of ``RLVRWorkflow`` (which awaits async reward fns with the
engine), or called directly with ``await judge.grade(engine, question, answer, reference)``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from relayrl.api.engine import InferenceEngine
from relayrl.api.io import GenerationConfig, ModelRequest

DEFAULT_TEMPLATE = (
    "Grade the answer from 0 to 1.\nQuestion: {question}\nReference: {reference}\nAnswer: {answer}\nGrade:"
)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number(text: str) -> float:
    """The first number in ``text`` clipped to [0, 1]; 0.0 when there is none."""
    m = _NUMBER.search(text)
    return 0.0 if m is None else min(1.0, max(0.0, float(m.group())))


class GenerativeJudge:
    """Grades answers with an LLM (see module doc)."""

    def __init__(
        self,
        engine: InferenceEngine | None,
        tokenizer: PreTrainedTokenizerBase,
        template: str = DEFAULT_TEMPLATE,
        parse_fn: Callable[[str], float] = first_number,
        gconfig: GenerationConfig | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.parse_fn = parse_fn
        self.gconfig = gconfig or GenerationConfig(greedy=True, max_new_tokens=8)
        self.last_reply = ""

    def prompt_ids(self, question: str, answer: str, reference: str) -> list[int]:
        from relayrl.data.models import chat_ids

        text = self.template.format(question=question, answer=answer, reference=reference)
        return chat_ids(self.tokenizer, [{"role": "user", "content": text}])

    async def grade(self, engine: InferenceEngine | None, question: str, answer: str, reference: str = "") -> float:
        """Ask the judge's engine (or ``engine`` when the judge has none) for a grade."""
        target = self.engine or engine
        if target is None:
            raise ValueError("GenerativeJudge has no engine: pass one to the judge or to grade()")
        ids = self.prompt_ids(question, answer, reference)
        resp = await target.agenerate(ModelRequest(rid=uuid.uuid4().hex, input_ids=ids, gconfig=self.gconfig))
        self.last_reply = str(self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True))
        return float(self.parse_fn(self.last_reply))

    async def __call__(self, engine: InferenceEngine, prompt: str, completions: str, **data: object) -> float:
        """Async reward-fn form: the question is the row's last user turn (or ``prompt``)."""
        messages = data.get("messages")
        question = prompt
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
            question = str(messages[-1].get("content", prompt))
        return await self.grade(engine, question, completions, str(data.get("answer", "")))
