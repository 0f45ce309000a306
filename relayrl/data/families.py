"""Tiny random checkpoints of common Hugging Face causal-LM families (for tests and benches).

``tiny_family_config(name)`` returns a config of a few hundred thousand parameters that keeps
what makes the family different: sliding-window layers (Mistral, Gemma2/3), mixture-of-experts
MLPs (Mixtral, Qwen3-MoE), logit soft-capping (Gemma2), q/k norms (Qwen3, OLMo2), partial
rotary (GPT-NeoX, Phi-3), absolute positions (GPT-2). ``save_tiny_family(name, dir)`` builds
one with a fixed seed and saves it as a checkpoint directory, which is how users hand models
to relayrl (``model.path``). No hub access.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

VOCAB = 128
_COMMON = {"vocab_size": VOCAB, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
_DECODER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

# model_type -> config overrides; windows are short so that test sequences cross them
FAMILIES: dict[str, dict[str, object]] = {
    "llama": {**_DECODER},
    "qwen2": {**_DECODER, "tie_word_embeddings": True},
    "qwen3": {**_DECODER, "head_dim": 16},
    "mistral": {**_DECODER, "sliding_window": 12},
    "mixtral": {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    "qwen3_moe": {
        **_DECODER,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "gemma2": {
        **_DECODER,
        "head_dim": 16,
        "sliding_window": 12,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 16,
    },
    "gemma3_text": {
        **_DECODER,
        "head_dim": 16,
        "sliding_window": 12,
        "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "phi3": {**_DECODER, "num_key_value_heads": 4, "partial_rotary_factor": 0.5, "sliding_window": None},
    "olmo2": {**_DECODER},
    "gpt_neox": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "rotary_pct": 0.25,
        "max_position_embeddings": 512,
        "use_parallel_residual": True,
    },
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512},
}


def tiny_family_config(name: str, **overrides: object) -> PretrainedConfig:
    """A tiny config of family ``name`` (a key of ``FAMILIES``), with ``overrides`` applied."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; choose one of {sorted(FAMILIES)}")
    return AutoConfig.for_model(name, **{**_COMMON, **FAMILIES[name], **overrides})


def build_tiny_family(
    name: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: object
) -> PreTrainedModel:
    """A randomly initialised model of family ``name`` (weights scaled up so outputs are not uniform)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_family_config(name, **overrides), dtype=dtype)
        with torch.no_grad():  # default init (std 0.02) gives near-uniform logits: greedy would hinge on ties
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.15)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model.eval()


def save_tiny_family(name: str, path: str | Path, seed: int = 0) -> Path:
    """Build family ``name`` and save it as a Hugging Face checkpoint directory at ``path``."""
    path = Path(path)
    build_tiny_family(name, seed).save_pretrained(path)
    return path
