"""Tiny models and an offline tokenizer, built in code (no hub access).

``load_model`` / ``load_tokenizer`` are the one place that turns a ``ModelConfig`` into objects: a
Hugging Face path loads with ``from_pretrained``; the tiny presets (``relayrl.data.presets``) are built
from a config with the offline character-level tokenizer below (plus the vision special tokens for
``tiny-vl``), so tests and the CPU demo run anywhere.
"""

from __future__ import annotations

import json
import os
import string
import typing
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.image_processing_utils import BaseImageProcessor

from relayrl.api.config import ModelConfig
from relayrl.data.chat import prompt_ids
from relayrl.data.presets import TINY_PRESETS
from relayrl.data.real_models import resolve_model_path
from relayrl.data.templates import set_chat_template
from relayrl.data.vision import (
    VISION_TOKENS,
    VL_PRESETS,
    build_image_processor,
    is_vision_config,
    load_image_processor,
)

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<|user|>", "<|assistant|>", "<|tool|>", "<|call|>", "<|result|>"]
CHARS = string.digits + string.ascii_letters + " +-*/=()?.,:;!'\"<>[]{}_#%&^|~@$\\\n"

# A plain chat template over the special tokens; the generation prompt ends with the
# assistant tag, so completions start right after it.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<eos>"
    "{% else %}<|tool|>{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, plus chat special tokens."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(dict.fromkeys(CHARS)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="?",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


TOKEN_IDS = {"tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
"""The offline tokenizer's special ids, which every tiny model is built with (its head tied to the embeddings)."""


def seeded(from_config: Callable[..., PreTrainedModel], cfg: PretrainedConfig, seed: int) -> PreTrainedModel:
    """``from_config(cfg)`` in fp32 with weights drawn from ``seed`` (the global RNG left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = from_config(cfg, dtype=torch.float32)
    model.generation_config.pad_token_id = 0
    return model


def build_tiny_model(preset: str = "tiny", vocab_size: int | None = None, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised causal LM of a preset size (Qwen2-style unless the preset names a
    ``model_type``; fp32)."""
    if preset not in TINY_PRESETS:
        raise ValueError(f"unknown tiny model preset {preset!r}; choose one of {sorted(TINY_PRESETS)}")
    preset_kwargs = dict(TINY_PRESETS[preset])
    cfg = AutoConfig.for_model(
        str(preset_kwargs.pop("model_type", "qwen2")),
        vocab_size=vocab_size or len(build_tokenizer()),
        max_position_embeddings=2048,
        **TOKEN_IDS,
        **preset_kwargs,
    )
    return seeded(AutoModelForCausalLM.from_config, cfg, seed)


def build_vl_tokenizer() -> PreTrainedTokenizerFast:
    """The offline character tokenizer plus the Qwen2-VL vision special tokens."""
    tok = build_tokenizer()
    tok.add_tokens(VISION_TOKENS, special_tokens=True)
    return tok


def build_tiny_vl_model(preset: str = "tiny-vl", seed: int = 0) -> PreTrainedModel:
    """A randomly initialised ~0.16M-parameter Qwen2-VL (``tiny-vl``) or Qwen2.5-VL (``tiny-vl2.5``), fp32."""
    if preset not in VL_PRESETS:
        raise ValueError(f"unknown tiny vision model preset {preset!r}; choose one of {sorted(VL_PRESETS)}")
    tok = build_vl_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},  # sums to head_dim / 2
        **TOKEN_IDS,
    }
    vision: dict[str, object] = {"depth": 2, "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2}
    if preset == "tiny-vl":
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
    else:  # Qwen2.5-VL: windowed attention blocks with full attention in some
        vision.update(hidden_size=32, out_hidden_size=64, intermediate_size=64, window_size=56)
        vision["fullatt_block_indexes"] = [1]
    cfg = AutoConfig.for_model(
        VL_PRESETS[preset],
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        **TOKEN_IDS,
    )
    model = seeded(AutoModelForImageTextToText.from_config, cfg, seed)
    model.generation_config.eos_token_id = 1
    return model


# Token ids of a chat prompt ending with the assistant's generation prompt (plain text, with a warning,
# when the tokenizer has no chat template: see ``relayrl.data.chat``).
chat_ids = prompt_ids


_PLAIN_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")  # how build_tokenizer() saves itself


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerFast:
    """The tokenizer of ``cfg`` with ``model.chat_template`` applied (relayrl.data.templates)."""
    tok = _load_tokenizer(resolve_model_path(cfg.tokenizer_path or cfg.path))
    set_chat_template(tok, cfg.chat_template)
    return tok


def _load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    if path in TINY_PRESETS:
        return build_tokenizer()
    if path in VL_PRESETS:
        return build_vl_tokenizer()
    saved = Path(path) / "tokenizer_config.json"
    if saved.is_file() and json.loads(saved.read_text()).get("tokenizer_class") in _PLAIN_TOKENIZERS:
        # Loaded as saved: AutoTokenizer would pick the model type's class (qwen2 -> Qwen2Tokenizer), which
        # rebuilds the pre-tokenizer (byte-level regex) and silently drops the offline tokenizer's spaces.
        return PreTrainedTokenizerFast.from_pretrained(path)
    return typing.cast(PreTrainedTokenizerFast, AutoTokenizer.from_pretrained(path))  # (fast: tokenizers backend)


def load_model(cfg: ModelConfig, seed: int = 0) -> PreTrainedModel:
    """The policy model of ``cfg`` in its configured dtype, with ``model.lora.adapter_path`` merged in."""
    dtype = getattr(torch, cfg.dtype)
    path = resolve_model_path(cfg.path)  # a GGUF file: its converted directory (relayrl.data.real_models)
    if path in TINY_PRESETS:
        model = build_tiny_model(path, vocab_size=cfg.vocab_size or None, seed=seed).to(dtype)
    elif path in VL_PRESETS:
        model = build_tiny_vl_model(path, seed=seed).to(dtype)
    else:
        model = _auto_class(path).from_pretrained(path, dtype=dtype)
    return merge_adapter(model, cfg.lora.adapter_path) if cfg.lora.adapter_path else model


def checkpoint_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The weights of the Hugging Face checkpoint at ``path`` under the model's own parameter names.

    ``save_pretrained`` writes some architectures in their original hub format (Qwen2-VL's
    ``visual.*`` for ``model.visual.*``, MoE experts one by one for the fused tensors) and only
    ``from_pretrained`` converts them back, so the checkpoint is loaded through it, in its saved dtype."""
    return typing.cast(PreTrainedModel, _auto_class(path).from_pretrained(path, dtype="auto")).state_dict()


def _auto_class(path: str) -> type[AutoModelForCausalLM] | type[AutoModelForImageTextToText]:
    """The auto class that loads the checkpoint at ``path``: Qwen2-VL style (text + vision tower) or a causal LM."""
    return AutoModelForImageTextToText if is_vision_config(AutoConfig.from_pretrained(path)) else AutoModelForCausalLM


def merge_adapter(model: PreTrainedModel, path: str) -> PreTrainedModel:
    """``model`` with the peft adapter at ``path`` merged into its weights (a plain HF model again)."""
    if not (Path(path) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"model.lora.adapter_path={path!r} holds no adapter_config.json (a peft adapter)")
    from peft import PeftModel

    merged = PeftModel.from_pretrained(model, path).merge_and_unload()
    # peft froze the base for adapter training; merged, it is a plain model again, trainable as one loaded so
    # (model.path=ADAPTER with model.lora.rank=0 trains every weight; LoRA on top freezes them itself)
    return typing.cast(PreTrainedModel, merged.requires_grad_(True))


def vision_processor(model: ModelConfig) -> BaseImageProcessor | None:
    """The image processor of ``model`` when it takes images (a tiny VL preset, or a checkpoint whose
    config has a vision tower), else None."""
    if model.path in VL_PRESETS:
        return build_image_processor()
    if model.path in TINY_PRESETS or not os.path.isdir(model.path):
        return None
    return load_image_processor(model.path) if is_vision_config(AutoConfig.from_pretrained(model.path)) else None


def save_for_inference(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    model: torch.nn.Module | None,
    image_processor: BaseImageProcessor | None = None,
) -> None:
    """Make a checkpoint directory stand alone: the run's tokenizer (with its chat template), the
    model's generation config and, for a vision-language model, its image processor
    (``preprocessor_config.json``) beside the weights (peft adapters get them too), so
    ``from_pretrained``, ``relayrl serve --model`` and ``relayrl eval`` take the directory as it is."""
    tokenizer.save_pretrained(str(path))
    if image_processor is not None:
        image_processor.save_pretrained(str(path))
    generation = getattr(model, "generation_config", None)
    if generation is not None and not (Path(path) / "generation_config.json").is_file():
        generation.save_pretrained(str(path))
