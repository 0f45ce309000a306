"""Prompts from chat turns, through the model's own chat template, and appending turns as tokens.

Two facts shape this module:

- A real chat template (Qwen2.5, Llama-3) renders the *whole* conversation: a default system
  prompt, a BOS token, the tool schemas. Rendering a new turn on its own puts those in the
  middle of an episode, so a new turn is instead the *difference* between the rendering of
  the conversation with and without it (``continuation_ids``).
- The tokens the policy generated are kept as generated: a turn is appended after them, never
  re-encoded from their text (the template's own rendering of the assistant turn may differ:
  re-serialised tool-call JSON, dropped whitespace).

``prompt_format="plain"`` serves base models without a template: the prompt is the text of
the turns, encoded with the tokenizer's own special tokens (BOS); chosen automatically, with a
warning, when the tokenizer has no ``chat_template``.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping, Sequence

from transformers import PreTrainedTokenizerBase

from relayrl.utils.logging import get_logger

logger = get_logger("data")

Message = dict[str, object]
PROMPT_FORMATS = ("chat", "plain")
_warned_plain: set[int] = set()


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_prompt_format(tokenizer: PreTrainedTokenizerBase, prompt_format: str = "chat") -> str:
    """``chat`` unless asked for ``plain`` or the tokenizer has no chat template (then a warning, once)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {list(PROMPT_FORMATS)}, got {prompt_format!r}")
    if prompt_format == "chat" and not has_chat_template(tokenizer):
        if id(tokenizer) not in _warned_plain:
            _warned_plain.add(id(tokenizer))
            logger.warning(
                "the tokenizer has no chat template: prompts are plain text (data.prompt_format=plain); "
                "set a template or data.prompt_format=plain to silence this"
            )
        return "plain"
    return prompt_format


def encode(tokenizer: PreTrainedTokenizerBase, text: str, special: bool = False) -> list[int]:
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=special)]


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, object]],
    tools: Sequence[Mapping[str, object]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The chat template's text of ``messages`` (with the tool schemas when given)."""
    if not has_chat_template(tokenizer):
        raise ValueError(
            "tokenizer.chat_template is not set: use data.prompt_format=plain (plain-text prompts) "
            "or give the tokenizer a chat template"
        )
    if tools and "tools" not in str(tokenizer.chat_template):
        raise ValueError(
            "the tokenizer's chat template does not render tools (it never reads `tools`); "
            "use a template with tool support: model.chat_template=hermes (Hermes / Qwen2.5 format) or llama3"
        )
    text = tokenizer.apply_chat_template(
        typing.cast(list[dict[str, str]], list(messages)),
        tools=[dict(t) for t in tools] if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )
    return str(text)


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, object]],
    prompt_format: str = "chat",
    tools: Sequence[Mapping[str, object]] | None = None,
) -> list[int]:
    """Token ids of a prompt that ends where the assistant's answer starts."""
    if resolve_prompt_format(tokenizer, prompt_format) == "plain":
        if tools:
            raise ValueError(
                "tools need a chat template (prompt_format=chat); the tokenizer has none or plain was asked"
            )
        text = "\n".join(str(m.get("content") or "") for m in messages)  # the turns' contents, one per line
        return encode(tokenizer, text, special=True)
    return encode(tokenizer, render(tokenizer, messages, tools))


def continuation_ids(
    tokenizer: PreTrainedTokenizerBase,
    history: Sequence[Mapping[str, object]],
    assistant: Mapping[str, object],
    new_turns: Sequence[Mapping[str, object]],
    end_token: int | None,
    tools: Sequence[Mapping[str, object]] | None = None,
) -> list[int] | None:
    """Tokens to append after a generated assistant turn so the sequence continues with ``new_turns``
    and ends with the generation prompt, as the template would render it.

    ``history`` is the conversation the assistant turn answered, ``assistant`` that turn as the
    template should see it, ``end_token`` the stop token the generation ended with (None when it
    was cut by the length limit or a stop string: the template's end-of-turn token is added).
    Returns None when the template is not prefix-stable here (rendering the longer conversation
    rewrites the earlier text, as templates that drop old reasoning do): the caller starts a
    new sequence.
    """
    before = render(tokenizer, history, tools, add_generation_prompt=True)
    closed = render(tokenizer, [*history, assistant], tools, add_generation_prompt=False)
    full = render(tokenizer, [*history, assistant, *new_turns], tools, add_generation_prompt=True)
    if not closed.startswith(before) or not full.startswith(closed):
        return None
    turn = closed[len(before) :]  # the template's own text of the assistant turn, end-of-turn marker included
    head: list[int] = []
    end_text = str(tokenizer.decode([end_token], skip_special_tokens=False)) if end_token is not None else ""
    if not end_text or end_text not in turn:
        eos = tokenizer.eos_token
        if not isinstance(eos, str) or eos not in turn:
            return None  # the template closes assistant turns without a token we can name
        head, end_text = [int(tokenizer.eos_token_id)], eos
    tail = turn[turn.rindex(end_text) + len(end_text) :]  # e.g. the newline after Qwen's <|im_end|>
    return head + encode(tokenizer, tail + full[len(closed) :])


def user_turn_ids(
    tokenizer: PreTrainedTokenizerBase,
    history: Sequence[Mapping[str, object]],
    answer_ids: Sequence[int],
    content: str,
    prompt_format: str = "chat",
    role: str = "user",
) -> list[int]:
    """Tokens that follow a generated answer with one more turn (feedback, a tool result) and the
    generation prompt: only the new turn's tokens, never the template's preamble again."""
    eos_id = tokenizer.eos_token_id
    ended = bool(answer_ids) and eos_id is not None and int(answer_ids[-1]) == int(eos_id)
    if resolve_prompt_format(tokenizer, prompt_format) == "plain":
        return encode(tokenizer, f"\n{content}\n")
    body = list(answer_ids[:-1]) if ended else list(answer_ids)
    assistant = {"role": "assistant", "content": tokenizer.decode(body, skip_special_tokens=True)}
    ids = continuation_ids(
        tokenizer, history, assistant, [{"role": role, "content": content}], int(eos_id) if ended else None
    )
    if ids is None:
        raise ValueError(
            "the chat template is not prefix-stable (rendering a longer conversation changes earlier text), "
            "so a turn cannot be appended as tokens; use a template without history rewriting"
        )
    return ids


def conversation_example(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, object]],
    tools: Sequence[Mapping[str, object]] | None = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a whole conversation for supervised training: 1 on every
    assistant turn up to and including its end-of-turn token, 0 on everything the template or
    the environment adds. Each turn is cut from the template's own rendering, so what the model
    learns to write is exactly what the template shows it in later turns."""
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    eos = tokenizer.eos_token if isinstance(tokenizer.eos_token, str) else ""
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = render(tokenizer, messages[:k], tools, add_generation_prompt=True)
        closed = render(tokenizer, messages[: k + 1], tools, add_generation_prompt=False)
        if not before.startswith(done) or not closed.startswith(before):
            raise ValueError(f"messages[{k}]: the chat template is not prefix-stable, so turns cannot be cut from it")
        context = encode(tokenizer, before[len(done) :])
        turn = closed[len(before) :]
        cut = turn.rindex(eos) + len(eos) if eos and eos in turn else len(turn)
        answer = encode(tokenizer, turn[:cut])
        ids += context + answer
        mask += [0] * len(context) + [1] * len(answer)
        done = before + turn[:cut]
    if not any(mask):
        raise ValueError("the conversation has no assistant turn to learn from")
    return ids, mask
