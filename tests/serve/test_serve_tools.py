"""Tool calls and reasoning through the server, as agents drive it: the embedded model
behind chat templates written for each family's call format (the model cannot choose
tools itself, so `tool_choice: required` makes the grammar write the call), driven by
the `openai` and `anthropic` clients, whole and streamed; a full agent loop (call ->
tool result -> answer) with both; bad input in each API's error shape; malformed markup
under `auto` (a canned model) comes back as content and is counted, never a 500."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anthropic
import httpx
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
        # The anthropic client: any tool (one), whole; the named tool, streamed.
        a = ant(s)
        akw = dict(model="test", max_tokens=max_tokens(family), extra_body={"temperature": 0})
        akw["tools"] = [
            {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
            for t in TOOLS
        ]
        m = a.messages.create(
            messages=ASK, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **akw
        )
        (use,) = m.content
        assert m.stop_reason == "tool_use" and use.type == "tool_use"
        assert (
            valid_weather(use.input)
            if use.name == "get_weather"
            else (use.input["zone"] in ("UTC", "CET"))
        )
        with a.messages.stream(
            messages=ASK, tool_choice={"type": "tool", "name": "get_weather"}, **akw
        ) as st:
            final = st.get_final_message()
        assert [(b.type, b.name, b.input) for b in final.content] == [
            ("tool_use", "get_weather", json.loads(call.function.arguments))
        ]
    finally:
        s.close()


# ------------------------------------------------------------------ agent loops


def test_openai_agent_loop(hermes) -> None:
    """Call -> the tool's result -> an answer, through the openai client."""
    c = oai(hermes)
    kw = dict(model="test", tools=TOOLS, max_tokens=MAX, temperature=0)
    r = c.chat.completions.create(
        messages=ASK, tool_choice="required", parallel_tool_calls=False, **kw
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    history = [*ASK, msg.model_dump(exclude_none=True)]
    for call in msg.tool_calls:
        history.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    answer = c.chat.completions.create(messages=history, **kw | {"max_tokens": 8})
    ch = answer.choices[0]
    assert ch.finish_reason in ("stop", "length") and ch.message.content
    assert not ch.message.tool_calls
    # The result reached the prompt: it is longer than the first by the call and result.
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens + 10
    assert answer.usage.prompt_tokens_details.cached_tokens == 0


def ant(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


def test_anthropic_agent_loop_whole_and_streamed(hermes) -> None:
    a = ant(hermes)
    # temperature is the server's (the client's typed arguments no longer carry it)
    kw = dict(model="test", max_tokens=MAX, extra_body={"temperature": 0})
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    m = a.messages.create(
        messages=ASK, tools=tools, tool_choice={"type": "tool", "name": "get_weather"}, **kw
    )
    assert m.stop_reason == "tool_use" and m.role == "assistant"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and valid_weather(use.input) and use.id.startswith("toolu_")
    assert m.usage.input_tokens > 0 and m.usage.cache_read_input_tokens == 0
    with a.messages.stream(
        messages=ASK, tools=tools, tool_choice={"type": "tool", "name": "get_weather"}, **kw
    ) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (use.name, use.input)
    ]
    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
        },
    ]
    answer = a.messages.create(messages=history, tools=tools, system="Be brief.", **kw)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.content and answer.content[0].type == "text"
    n = a.messages.count_tokens(model="test", messages=history, tools=tools, system="Be brief.")
    assert n.input_tokens == answer.usage.input_tokens


def test_anthropic_stop_sequences_and_text_stream(hermes) -> None:
    a = ant(hermes)
    whole = a.messages.create(
        model="test",
        max_tokens=12,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Hi"}],
    )
    text = whole.content[0].text
    stop = text.strip()[:3]
    m = a.messages.create(
        model="test",
        max_tokens=12,
        extra_body={"temperature": 0},
        stop_sequences=[stop],
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    with a.messages.stream(
        model="test",
        max_tokens=12,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Hi"}],
    ) as s:
        assert "".join(s.text_stream) == text


# ------------------------------------------------------------------ reasoning


def test_reasoning_content_apart(model) -> None:
    """A thinking template (its prompt opens <think>; the grammar makes the model close
    it, then call): the reasoning comes apart from the call, whole and streamed."""
    s = InProcessServer(lambda: model, options=Options(chat_template=template("hermes", "<think>")))
    try:
        c = oai(s)
        kw = dict(model="test", messages=ASK, tools=TOOLS, max_tokens=160, temperature=0)
        kw["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
        r = c.chat.completions.create(**kw)
        msg = r.choices[0].message
        reasoning = (msg.model_extra or {}).get("reasoning_content")
        assert reasoning is not None and "</think>" not in reasoning
        assert msg.tool_calls and valid_weather(json.loads(msg.tool_calls[0].function.arguments))
        pieces = []
        for chunk in c.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                pieces.append((ch.delta.model_extra or {}).get("reasoning_content") or "")
                assert "<think>" not in (ch.delta.content or "")
        assert "".join(pieces) == reasoning
    finally:
        s.close()


# ------------------------------------------------------------------ bad input


BAD_OPENAI = [
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "blob"}}}
            ]
        },
        "tools",
        "tools[0].function.parameters",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "nope",
    ),
    (
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "r"}]},
        "messages",
        "tool_call_id",
    ),
    ({"tools": TOOLS, "n": 0}, "n", "n"),
]


@pytest.mark.parametrize(("extra", "param", "named"), BAD_OPENAI)
def test_openai_bad_input_names_the_field(hermes, extra, param, named) -> None:
    body = {"model": "test", "messages": ASK, "max_tokens": 4} | extra
    r = httpx.post(f"{hermes.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and named in err["message"]


BAD_ANTHROPIC = [
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content.0"),
    (
        {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": []}}]},
        "tools.0.input_schema",
    ),
    (
        {
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "g"},
        },
        "'g'",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}],
                }
            ]
        },
        "tool_call_id",
    ),
    ({"max_tokens": None}, "max_tokens"),
]


@pytest.mark.parametrize(("extra", "named"), BAD_ANTHROPIC)
def test_anthropic_bad_input_in_its_error_shape(hermes, extra, named) -> None:
    body = {"model": "test", "messages": ASK, "max_tokens": 4} | extra
    r = httpx.post(
        f"{hermes.url}/v1/messages",
        json=body,
        headers={"anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    out = r.json()
    assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
    assert named in out["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        ant(hermes).messages.create(**body)


class Canned:
    """The model, writing `text` whatever it is asked (a model that writes malformed
    call markup under auto, which the grammar would have refused)."""

    def __init__(self, model, text: str) -> None:
        self.model = model
        self.ids = model.tokenizer(text)["input_ids"] + [model.tokenizer.eos_token_id]

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def generate(self, ids, streamer=None, **kw):
        import torch

        streamer.put(torch.tensor([ids]))
        for t in self.ids:
            streamer.put(torch.tensor([t]))
        return torch.tensor([list(ids) + self.ids])


def test_malformed_markup_under_auto_is_content_and_counted(model) -> None:
    bad = 'Checking. <tool_call>\n{"name": "get_weather", oops}\n</tool_call>'
    s = InProcessServer(
        lambda: Canned(model, bad), options=Options(chat_template=template("hermes"))
    )
    try:
        c = oai(s)
        kw = dict(model="test", messages=ASK, tools=TOOLS, max_tokens=MAX, temperature=0)
        before = s.metrics().get("psr_tool_parse_failures_total", 0)
        r = c.chat.completions.create(**kw)
        ch = r.choices[0]
        assert ch.finish_reason == "stop" and not ch.message.tool_calls
        assert ch.message.content.startswith("Checking. <tool_call>")
        streamed, finish, content = stream_calls(c.chat.completions.create(**kw, stream=True))
        assert streamed == [] and finish == "stop" and content == ch.message.content
        assert s.metrics()["psr_tool_parse_failures_total"] == before + 2
    finally:
        s.close()


def test_tools_on_a_template_without_a_format(model) -> None:
    s = serve(model, None)  # the fallback transcript
    try:
        body = {"model": "test", "messages": ASK, "max_tokens": 4, "tools": TOOLS}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "tool calls" in r.json()["error"]["message"]
    finally:
        s.close()


def test_the_readmes_agent_snippet(model, capsys) -> None:
    """The README's tool call, reasoning_content and /v1/messages, as written, against
    the embedded model behind a thinking hermes template."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    serving = readme.split("## Serving\n", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", serving, re.S)[1]
    s = InProcessServer(
        lambda: model,
        name="default_model",
        options=Options(chat_template=template("hermes", "<think>")),
    )
    try:
        code = code.replace("http://127.0.0.1:8000", s.url)
        ns: dict = {}
        exec(compile(code, "README.md", "exec"), ns)
    finally:
        s.close()
    assert capsys.readouterr().out.startswith("tool_calls get_weather ")
    assert json.loads(ns["call"].function.arguments)["city"] in ("Paris", "Rome")
    assert isinstance(ns["reply"].choices[0].message.reasoning_content, str)
    m = ns["message"]
    assert m.stop_reason == "tool_use" and [b.type for b in m.content][-1] == "tool_use"


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(model) -> None:
    tpl = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if reasoning_effort is defined %}effort: {{ reasoning_effort }}\n{% endif %}"
        "assistant:{% if enable_thinking %}<think>{% endif %}"
    )
    s = InProcessServer(lambda: model, options=Options(chat_template=tpl))
    try:
        c = oai(s)
        kw = dict(model="test", messages=ASK, max_tokens=1, temperature=0)
        plain = c.chat.completions.create(**kw).usage.prompt_tokens
        effort = c.chat.completions.create(**kw, reasoning_effort="high").usage.prompt_tokens
        think = c.chat.completions.create(
            **kw, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
        )
        assert effort > plain and think.usage.prompt_tokens > plain
        # The prompt opened <think>: the reply is reasoning, not content.
        msg = think.choices[0].message
        assert msg.model_extra.get("reasoning_content") and not msg.content
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
            c.chat.completions.create(
                **kw, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}
            )
    finally:
        s.close()
