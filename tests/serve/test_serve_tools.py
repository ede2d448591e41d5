"""Tool calls and reasoning through the server, as agents drive it: the embedded model
behind chat templates written for each family's call format (the model cannot choose
tools itself, so `tool_choice: required` makes the grammar write the call), driven by
the `openai` and `anthropic` clients, whole and streamed; a full agent loop (call ->
tool result -> answer) with both; bad input in each API's error shape; malformed markup
under `auto` (a canned model) comes back as content and is counted, never a 500."""

from __future__ import annotations

import json

import openai
import pytest
from servers import InProcessServer

import psr
from psr.models import DEFAULT_MODEL
from psr.serve.app import Options
from psr.serve.tools import FORMATS

# A conversation in a plain transcript; the family's markup where the model writes calls
# (its signature in a comment is what `detect` reads).
_CALL = {
    "hermes": "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>",
    "qwen3_coder": "{# <tool_call> <function= #}<tool_call>\n<function={{ c.function.name }}>"
    "\n</function>\n</tool_call>",
    "glm45": "{# <tool_call> <arg_key> #}<tool_call>{{ c.function.name }}\n</tool_call>",
    "minimax_m2": '{# <minimax:tool_call> #}<minimax:tool_call>\n<invoke name="{{ '
    'c.function.name }}">\n</invoke>\n</minimax:tool_call>',
    "mistral": "[TOOL_CALLS]{{ [{'name': c.function.name, 'arguments': c.function.arguments}]"
    " | tojson }}",
    "llama4_json": "{# <|header_start|> #}{{ {'name': c.function.name, 'parameters': "
    "c.function.arguments} | tojson }}",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ "
    "c.function.name }}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
}


def template(family: str, think: str = "") -> str:
    return (
        "{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
        "{% for m in messages %}"
        "{% if m.role == 'assistant' and m.tool_calls %}assistant: "
        "{% for c in m.tool_calls %}" + _CALL[family] + "{% endfor %}\n"
        "{% elif m.role == 'tool' %}tool {{ m.tool_call_id }}: {{ m.content }}\n"
        "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant:" + think + "{% endif %}"
    )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX = 128


def max_tokens(family: str) -> int:
    # DeepSeek's markers are special tokens in its vocabulary, dozens of bytes here.
    return 200 if family == "deepseek_v3" else MAX


def valid_weather(args: dict) -> bool:
    return (
        set(args) == {"city", "days"}
        and args["city"] in ("Paris", "Rome")
        and (isinstance(args["days"], int) and 1 <= args["days"] <= 7)
    )


@pytest.fixture(scope="module")
def model():
    return psr.load(DEFAULT_MODEL, dtype="float32", progress=False)


def serve(model, family: str | None, **kw) -> InProcessServer:
    tpl = template(family) if family else None
    return InProcessServer(lambda: model, options=Options(chat_template=tpl, **kw))


@pytest.fixture(scope="module")
def hermes(model):
    s = serve(model, "hermes")
    yield s
    s.close()


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def stream_calls(stream) -> tuple[list[dict], str | None, str]:
    """Tool calls assembled from chunks as the openai client's users do; the finish
    reason; the content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call: id and name
                    assert tc.id and tc.function.name and tc.type == "function"
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


# ------------------------------------------------------------------ every family, openai


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_required_call_whole_and_streamed(model, family) -> None:
    s = serve(model, family)
    try:
        c = oai(s)
        kw = dict(model="test", messages=ASK, tools=TOOLS, max_tokens=max_tokens(family))
        kw["temperature"] = 0
        r = c.chat.completions.create(
            **kw, tool_choice={"type": "function", "function": {"name": "get_weather"}}
        )
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        assert valid_weather(json.loads(call.function.arguments))
        assert not ch.message.content
        streamed, finish, content = stream_calls(
            c.chat.completions.create(
                **kw,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                stream=True,
            )
        )
        assert finish == "tool_calls" and content == ""
        assert [(x["name"], x["arguments"]) for x in streamed] == [
            ("get_weather", call.function.arguments)
        ]
        # required: either tool, each call valid; parallel_tool_calls false: one call.
        r = c.chat.completions.create(**kw, tool_choice="required", parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert (
            valid_weather(args)
            if call.function.name == "get_weather"
            else (args["zone"] in ("UTC", "CET"))
        )
    finally:
        s.close()
