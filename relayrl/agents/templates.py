"""``tool_tokenizer``: the offline character tokenizer with a tool-calling template's markers as
single special tokens (the templates themselves are in ``relayrl.data.templates``); a model for it
needs ``vocab_size=len(tokenizer)``.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from relayrl.data.templates import LLAMA3_TEMPLATE, hermes_template

MARKERS = {
    "hermes": ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"],
}


def tool_tokenizer(
    style: str = "hermes",
    default_system: str = "You are a helpful assistant.",
    compact_tools: bool = False,
) -> PreTrainedTokenizerFast:
    """The offline character tokenizer with ``style``'s markers as special tokens and its template."""
    from relayrl.data.models import build_tokenizer

    if style not in MARKERS:
        raise ValueError(f"style must be one of {sorted(MARKERS)}, got {style!r}")
    tok = build_tokenizer()
    tok.add_tokens(MARKERS[style], special_tokens=True)
    if style == "hermes":
        tok.eos_token = "<|im_end|>"
        tok.chat_template = hermes_template(default_system, compact_tools)
    else:
        tok.eos_token, tok.bos_token = "<|eot_id|>", "<|begin_of_text|>"
        tok.chat_template = LLAMA3_TEMPLATE
    return tok
