"""A tiny model taught (by overfitting) to hold a few tool-using conversations, so agent tests
drive real tool calls through a real LocalEngine. The templates are ours (relayrl.agents.templates)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from relayrl.agents.builtin import CALC_TOOL as CALC  # the built-in tool agent's schema
from relayrl.data.chat import conversation_example


def small_model(vocab_size: int, eos_id: int, seed: int = 0):
    cfg = AutoConfig.for_model(
        "qwen2",
        vocab_size=vocab_size,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        eos_token_id=eos_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = 0
    return model


def overfit(tokenizer, conversations, tools=(CALC,), steps: int = 300, lr: float = 3e-3, seed: int = 0):
    """A model that reproduces the assistant turns of ``conversations`` under greedy decoding."""
    model = small_model(len(tokenizer), int(tokenizer.eos_token_id), seed)
    examples = [conversation_example(tokenizer, conv, list(tools)) for conv in conversations]
    width = max(len(ids) for ids, _ in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros(len(examples), width)
    for i, (x, m) in enumerate(examples):
        ids[i, : len(x)], mask[i, : len(m)] = torch.tensor(x), torch.tensor(m, dtype=torch.float)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    return model.eval(), loss.item()
