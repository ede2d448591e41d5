"""Chat messages into a prompt.

A checkpoint whose tokenizer has a chat template gets it, as transformers applies it
(`apply_chat_template(messages, add_generation_prompt=True)`); its text is tokenized
without adding special tokens again (the template writes them). A checkpoint without one
(the embedded model) gets FALLBACK_TEMPLATE, a plain transcript:

    system: You are terse.
    user: Hello!
    assistant:

tokenized as a completion prompt is. The model was not trained on it, and responses say
so: their `psr.chat_template` field is "checkpoint" or "fallback" (or "file": a template
given with `psr serve --chat-template FILE`, which overrides both).
"""

from __future__ import annotations

from typing import Any

FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(
    tokenizer: Any, messages: list[dict[str, str]], template: str | None = None
) -> tuple[str, str]:
    """The prompt text of `messages`, and which template made it: "file" (`template`
    given), "checkpoint" or "fallback"."""
    own = has_template(tokenizer)
    if template is not None:
        chosen: str | None = template
    else:
        chosen = None if own else FALLBACK_TEMPLATE
    text = tokenizer.apply_chat_template(
        messages,
        chat_template=chosen,
        add_generation_prompt=True,
        tokenize=False,
    )
    if not isinstance(text, str):  # a template that renders several conversations
        raise TypeError(f"the chat template rendered {type(text).__name__}, not text")
    if template is not None:
        return text, "file"
    return text, "checkpoint" if own else "fallback"


def prompt_ids(
    tokenizer: Any, messages: list[dict[str, str]], template: str | None = None
) -> tuple[list[int], str]:
    """The token ids of `messages`' prompt, and the template's source (see `render`); a
    template from a file writes its own special tokens, as a checkpoint's does."""
    text, source = render(tokenizer, messages, template)
    ids = tokenizer(text, add_special_tokens=source == "fallback")["input_ids"]
    return list(ids), source
