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

The template also decides the server's tool-call format (`features`: the family whose
markup it writes, or `psr serve --tool-parser NAME`) and whether replies open with a
`<think>` block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psr.serve.output import THINK_CLOSE, THINK_OPEN
from psr.serve.tools import FORMATS, ToolFormat, detect

FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def template_text(tokenizer: Any, template: str | None = None) -> str | None:
    """The Jinja text prompts are rendered with (`template` given, the checkpoint's, or
    None: the fallback), which the tool-call format and the reasoning markers are read
    from."""
    if template is not None:
        return template
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # named templates: the default one (tool_use where given)
        own = own.get("tool_use") or own.get("default")
    return own if isinstance(own, str) and own else None


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> tuple[str, str]:
    """The prompt text of `messages`, and which template made it: "file" (`template`
    given), "checkpoint" or "fallback". `tools` (OpenAI's shape) and `kwargs` (the
    request's chat_template_kwargs) reach the template as transformers passes them."""
    own = has_template(tokenizer)
    if template is not None:
        chosen: str | None = template
    else:
        chosen = None if own else FALLBACK_TEMPLATE
    text = tokenizer.apply_chat_template(
        messages,
        chat_template=chosen,
        tools=tools or None,
        add_generation_prompt=True,
        tokenize=False,
        **(kwargs or {}),
    )
    if not isinstance(text, str):  # a template that renders several conversations
        raise TypeError(f"the chat template rendered {type(text).__name__}, not text")
    if template is not None:
        return text, "file"
    return text, "checkpoint" if own else "fallback"


def prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], str, str]:
    """The token ids of `messages`' prompt, the template's source (see `render`) and the
    prompt's text; a template from a file writes its own special tokens, as a
    checkpoint's does."""
    text, source = render(tokenizer, messages, template, tools, kwargs)
    ids = tokenizer(text, add_special_tokens=source == "fallback")["input_ids"]
    return list(ids), source, text


@dataclass(frozen=True)
class Features:
    """What a server's chat template gives its replies: a tool-call format (None: tool
    calls are off, `why`) and `<think>` reasoning."""

    tool_format: ToolFormat | None
    why: str
    reasoning: bool

    def describe(self) -> str:
        """The startup line."""
        think = "; reasoning: <think> blocks as reasoning_content" if self.reasoning else ""
        if self.tool_format is None:
            return f"tool calls are off: {self.why}{think}"
        return f"tool calls: the {self.tool_format.name} format ({self.why}){think}"


def features(tokenizer: Any, template: str | None, tool_parser: str | None) -> Features:
    """The template's features: the tool-call format `tool_parser` names (a key of
    FORMATS), else the one whose signature the template contains."""
    text = template_text(tokenizer, template)
    reasoning = text is not None and (THINK_OPEN in text or THINK_CLOSE in text)
    if tool_parser is not None:
        return Features(FORMATS[tool_parser], "--tool-parser", reasoning)
    if text is None:
        return Features(None, "no chat template (the fallback transcript has no tools)", False)
    fmt = detect(text)
    if fmt is None:
        return Features(
            None,
            "the chat template matches no tool-call format (--tool-parser NAME, one of "
            f"{', '.join(sorted(FORMATS))})",
            reasoning,
        )
    return Features(fmt, "from the chat template", reasoning)
