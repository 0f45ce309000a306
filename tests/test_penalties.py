"""OpenAI's frequency / presence penalties in LocalEngine's sampling, checked against a reference
computed here from the model's logits: ``logit[t] -= f * count(t) + p * (count(t) > 0)`` over the
tokens generated so far (vLLM's rule), then temperature; the reported logprob is the penalised one."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relayrl.api.config import InferenceConfig
from relayrl.api.io import GenerationConfig, ModelRequest
from relayrl.inference.local import LocalEngine


def _reference_logprobs(model, prompt, out, g: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each generated token, argmax of each step) under the penalised, tempered distribution."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    lps, best = [], []
    for i, tok in enumerate(out):
        counts = torch.bincount(torch.tensor(out[:i], dtype=torch.long), minlength=logits.shape[-1]).float()
        row = logits[i] - g.frequency_penalty * counts - g.presence_penalty * (counts > 0).float()
        row = row if g.greedy else row / g.temperature
        logp = torch.log_softmax(row, -1)
        lps.append(logp[tok])
        best.append(int(row.argmax()))
    return torch.stack(lps), torch.tensor(best)


@pytest.mark.parametrize(
    "g",
    [
        GenerationConfig(max_new_tokens=24, greedy=True, ignore_eos=True, frequency_penalty=1.5),
        GenerationConfig(max_new_tokens=24, temperature=0.8, ignore_eos=True, presence_penalty=1.2),
        GenerationConfig(
            max_new_tokens=24, temperature=1.0, ignore_eos=True, frequency_penalty=0.7, presence_penalty=-0.5
        ),
    ],
)
def test_penalties_change_sampling_and_logprobs_as_the_reference_says(tiny_model, g):
    eng = LocalEngine(InferenceConfig(), model=tiny_model)
    eng.initialize()
    prompt = [3, 20, 21, 22, 4]
    try:

        async def both():
            return await asyncio.gather(
                eng.agenerate(ModelRequest("p", prompt, g)),
                eng.agenerate(ModelRequest("q", prompt, g.new(frequency_penalty=0.0, presence_penalty=0.0))),
            )

        pen, plain = asyncio.run(both())
    finally:
        eng.destroy()
    want, best = _reference_logprobs(tiny_model, prompt, pen.output_tokens, g)
    assert torch.allclose(torch.tensor(pen.output_logprobs), want, atol=1e-4)
    if g.greedy:  # greedy follows the penalised argmax, and repeats less than without the penalty
        assert pen.output_tokens == best.tolist()
        assert len(set(pen.output_tokens)) > len(set(plain.output_tokens))
    assert pen.output_tokens != plain.output_tokens  # the penalty changed what was drawn


def test_a_penalty_outside_openais_range_is_refused():
    with pytest.raises(ValueError, match="frequency_penalty must be in"):
        GenerationConfig(frequency_penalty=2.5).validate()
