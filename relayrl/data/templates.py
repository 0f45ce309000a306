"""Chat templates with tool calling in the Hermes / Qwen2.5 and Llama-3.1 formats, and
``model.chat_template``: the template a run renders prompts with.

They serve tests and CPU recipes (the offline tokenizer has only a minimal template) and real models
whose own template has no tool format (SmolLM2's ChatML template renders no ``tools``): the same
format a Qwen2.5 model was trained on, which vLLM's and SGLang's ``hermes`` tool parsers read.

- ``hermes``: ``<|im_start|>role\\n...<|im_end|>\\n`` turns; a system turn (a default one when the
  conversation has none) that lists the tool schemas in ``<tools></tools>``; calls written as
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; tool results as
  ``<tool_response>`` blocks inside a user turn (consecutive results share one turn).
- ``llama3``: ``<|begin_of_text|>`` then ``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``
  turns; a system turn with the knowledge-date preamble; the tool schemas in the first user turn;
  calls as ``{"name": ..., "parameters": {...}}``; results in ``ipython`` turns.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HERMES_TEMPLATE = (
    "{% set default_system = '__SYSTEM__' %}"
    "{% if messages and messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = default_system %}{% set rest = messages %}{% endif %}"
    "<|im_start|>system\n{{ system }}"
    "{% if tools %}{{ '\n' }}\n# Tools\n<tools>__TOOLS__{{ '\n' }}</tools>\n"
    "__HOWTO__{% endif %}"
    "<|im_end|>\n"
    "{% for m in rest %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant"
    "{% if m['content'] %}{{ '\n' }}{{ m['content'] }}{% endif %}"
    "{% for call in m.get('tool_calls') or [] %}{% set fn = call['function'] if call['function'] is defined else call %}"
    "{{ '\\n' }}<tool_call>\n{\"name\": \"{{ fn['name'] }}\", \"arguments\": {{ fn['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or rest[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or rest[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if tools %}Environment: ipython\n{% endif %}"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n{{ system }}<|eot_id|>"
    "{% set ns = namespace(first_user=true) %}"
    "{% for m in rest %}"
    "{% if m['role'] == 'user' and tools and ns.first_user %}{% set ns.first_user = false %}"
    "<|start_header_id|>user<|end_header_id|>\n\n"
    'Respond with a JSON function call {"name": function name, "parameters": dictionary of arguments}.\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{{ m['content'] }}<|eot_id|>"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for call in m['tool_calls'] %}{% set fn = call['function'] if call['function'] is defined else call %}"
    '{% if not loop.first %}; {% endif %}{"name": "{{ fn[\'name\'] }}", "parameters": {{ fn[\'arguments\'] | tojson }}}'
    "{% endfor %}<|eot_id|>"
    "{% elif m['role'] in ('tool', 'ipython') %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

_FULL_TOOLS = "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
_COMPACT_TOOLS = (
    "{% for tool in tools %}{% set fn = tool['function'] if tool['function'] is defined else tool %}{{ '\\n' }}"
    "{{ fn['name'] }}({{ (fn.get('parameters') or {}).get('properties', {}) | join(',') }}){% endfor %}"
)
_HOWTO = 'Call a function as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'


def hermes_template(default_system: str = "You are a helpful assistant.", compact_tools: bool = False) -> str:
    """The Hermes / Qwen2.5-style template with ``default_system`` as the system turn when none is given.

    ``compact_tools`` lists each tool as ``name(arg, ...)`` instead of its JSON schema and drops the
    how-to line: far fewer tokens for small CPU models (the call format is unchanged)."""
    system = default_system.replace("\\", "\\\\").replace("'", "\\'")
    return (
        HERMES_TEMPLATE.replace("__SYSTEM__", system)
        .replace("__TOOLS__", _COMPACT_TOOLS if compact_tools else _FULL_TOOLS)
        .replace("__HOWTO__", "" if compact_tools else _HOWTO)
    )


_PROBE = "relayrl-probe-7f3a"


def model_default_system(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The system prompt the tokenizer's own ChatML template adds to a conversation that has none
    (SmolLM2: "You are a helpful AI assistant named SmolLM, trained by Hugging Face"); None when it
    adds none or is not ChatML."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = str(tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False))
    system = re.match(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", text, re.DOTALL)
    return system[1] if system and _PROBE not in system[1] else None


def set_chat_template(tokenizer: PreTrainedTokenizerBase, choice: str) -> None:
    """``model.chat_template``: ``""`` keeps the tokenizer's own; ``hermes`` / ``llama3`` the templates
    above (``hermes`` keeps the model's own default system prompt, so a ChatML model's conversations
    without tools render exactly as its own template renders them); anything else is a Jinja file."""
    if not choice:
        return
    if choice == "hermes":
        system = model_default_system(tokenizer)
        tokenizer.chat_template = hermes_template(system) if system is not None else hermes_template()
    elif choice == "llama3":
        tokenizer.chat_template = LLAMA3_TEMPLATE
    elif Path(choice).expanduser().is_file():
        tokenizer.chat_template = Path(choice).expanduser().read_text()
    else:
        raise ValueError(f"model.chat_template={choice!r}: give hermes, llama3 or a Jinja file's path")
