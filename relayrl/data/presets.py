"""The names and shapes of the models relayrl builds in code (``model.path=tiny`` ...): plain data, so
that checking a config (``relayrl.data.preflight``) needs neither torch nor transformers."""

from __future__ import annotations

TINY_PRESETS: dict[str, dict[str, int | str]] = {
    # ~5M parameters with the offline vocabulary
    "tiny": {
        "hidden_size": 320,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    # ~30M parameters
    "tiny-30m": {
        "hidden_size": 512,
        "intermediate_size": 1920,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    # ~1M parameters: a Qwen3-MoE (8 experts, top-2, every layer sparse) for MoE recipes and tests
    "tiny-moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 128,
        "intermediate_size": 384,
        "moe_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
}

# the tiny vision-language presets: name -> the model type built (relayrl.data.vision)
VL_PRESETS = {"tiny-vl": "qwen2_vl", "tiny-vl2.5": "qwen2_5_vl"}

CHAT_TEMPLATES = ("hermes", "llama3")  # model.chat_template names (relayrl.data.templates)
