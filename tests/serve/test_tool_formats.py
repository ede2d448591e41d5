"""The tool-call formats' table, without a server: each family's parser over recorded
model outputs (nested JSON, several calls, text before a call, a call cut off at
max_tokens, markup split across stream chunks at every byte), malformed markup as
content, and each family's grammar: compiled over the embedded model's tokenizer and
walked at random, it only admits calls that parse and fit the tool's schema."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from psr.models import DEFAULT_MODEL
from psr.serve.decoding import Grammars
from psr.serve.output import Output, merged
from psr.serve.protocol import Structured
from psr.serve.tools import FORMATS, detect, grammar
from psr.serve.tools.base import Tool

WEATHER = Tool(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "opts": {
                "type": "object",
                "properties": {"units": {"type": "string", "enum": ["c", "f"]}},
                "required": ["units"],
            },
        },
        "required": ["city", "days"],
    },
)
TIME = Tool("get_time", {"type": "object", "properties": {"tz": {"type": "string"}}})
TOOLS = (WEATHER, TIME)

NESTED = {"city": "Paris", "days": 3, "opts": {"units": "c"}}
SECOND = {"tz": "UTC"}


def _xml_qwen(name: str, args: dict) -> str:
    ps = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{ps}</function>\n</tool_call>"


def _xml_glm(name: str, args: dict) -> str:
    ps = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}"
        "</arg_value>\n"
        for k, v in args.items()
    )
    return f"<tool_call>{name}\n{ps}</tool_call>"


def _minimax_invoke(name: str, args: dict) -> str:
    ps = "".join(
        f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v)}</parameter>\n'
        for k, v in args.items()
    )
    return f'<invoke name="{name}">\n{ps}</invoke>'


def _ds_call(name: str, args: dict) -> str:
    return (
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(args)}\n```"
        "<｜tool▁call▁end｜>"
    )


def _hermes(calls: list[tuple[str, dict]]) -> str:
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    )


def _minimax(calls: list[tuple[str, dict]]) -> str:
    inv = "\n".join(_minimax_invoke(n, a) for n, a in calls)
    return f"<minimax:tool_call>\n{inv}\n</minimax:tool_call>"


def _deepseek(calls: list[tuple[str, dict]]) -> str:
    body = "".join(_ds_call(n, a) for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


# The calls as each family's models write them.
WRITERS = {
    "hermes": _hermes,
    "qwen3_coder": lambda calls: "\n".join(_xml_qwen(n, a) for n, a in calls),
    "glm45": lambda calls: "\n".join(_xml_glm(n, a) for n, a in calls),
    "minimax_m2": _minimax,
    "mistral": lambda calls: (
        "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    ),
    "llama4_json": lambda calls: "; ".join(
        json.dumps({"name": n, "parameters": a}) for n, a in calls
    ),
    "deepseek_v3": _deepseek,
}


def recorded(fam: str, calls: list[tuple[str, dict]]) -> str:
    return WRITERS[fam](calls)


FAMILIES = sorted(FORMATS)


def run(fam: str, chunks: list[str]) -> tuple[str, str, list[tuple[str, dict]], str | None]:
    out = Output(FORMATS[fam], TOOLS)
    parts = [p for c in chunks for p in out.feed(c)] + out.finish()
    reasoning, content, calls = merged(parts)
    return reasoning, content, [(n, json.loads(a)) for _, n, a in calls], out.failed


def test_the_table_has_every_family() -> None:
    assert set(FORMATS) == set(WRITERS)


@pytest.mark.parametrize("fam", FAMILIES)
def test_nested_json_and_several_calls(fam) -> None:
    calls = [("get_weather", NESTED), ("get_time", SECOND)]
    _, content, got, failed = run(fam, [recorded(fam, calls)])
    assert got == calls and content == "" and failed is None


@pytest.mark.parametrize("fam", FAMILIES)
def test_text_before_a_call(fam) -> None:
    text = "Let me look that up. "
    _, content, got, _ = run(fam, [text + recorded(fam, [("get_time", SECOND)])])
    assert content.strip() == text.strip() and got == [("get_time", SECOND)]


@pytest.mark.parametrize("fam", FAMILIES)
def test_every_byte_split_streams_the_same(fam) -> None:
    """Markup split at every position: the same calls, and no chunk ever shows markup."""
    text = "Sure. " + recorded(fam, [("get_weather", NESTED), ("get_time", SECOND)])
    want = run(fam, [text])
    for cut in range(1, len(text)):
        out = Output(FORMATS[fam], TOOLS)
        parts = out.feed(text[:cut]) + out.feed(text[cut:]) + out.finish()
        r, content, calls = merged(parts)
        assert (r, content, [(n, json.loads(a)) for _, n, a in calls], out.failed) == want
    # One character at a time: arguments arrive in pieces, each call's name first.
    out = Output(FORMATS[fam], TOOLS)
    parts = [p for ch in text for p in out.feed(ch)] + out.finish()
    shown = "".join(p.text for p in parts if hasattr(p, "kind"))
    assert shown == "Sure. " and FORMATS[fam].marker not in shown
    kinds = [type(p).__name__ for p in parts if not hasattr(p, "kind")]
    assert kinds[0] == "CallStart" and kinds.count("CallStart") == 2
    assert kinds.count("CallArgs") > 2


@pytest.mark.parametrize("fam", FAMILIES)
def test_a_call_cut_off_at_max_tokens(fam) -> None:
    text = recorded(fam, [("get_weather", NESTED)])
    cut = text[: len(text) * 2 // 3]
    out = Output(FORMATS[fam], TOOLS)
    parts = out.feed(cut) + out.finish()
    _, content, calls = merged(parts)
    # Either the call shows (its name known) with a prefix of its arguments, or the
    # markup comes back as content; never both, never an exception.
    if calls:
        assert calls[0][1] == "get_weather" and content == ""
    else:
        assert content == cut and out.failed


@pytest.mark.parametrize("fam", FAMILIES)
def test_malformed_markup_is_content(fam) -> None:
    good = recorded(fam, [("get_time", SECOND)])
    broken = good.replace('"tz"', '"tz" oops').replace("tz", "t<z", 1)
    if fam in ("qwen3_coder",):
        broken = "<tool_call>\n<function=get_time>\n<oops/></function>\n</tool_call>"
    if fam == "glm45":
        broken = "<tool_call>get_time\n<arg_value>x</arg_value>\n</tool_call>"
    if fam == "minimax_m2":
        broken = (
            '<minimax:tool_call>\n<invoke name="get_time">\n<oops/></invoke>\n</minimax:tool_call>'
        )
    _, content, calls, failed = run(fam, [broken])
    assert calls == [] and failed and content == broken


def test_detect_by_template_text() -> None:
    assert detect("{{ '<tool_call>' }}{{ tool_call.name }}") is FORMATS["hermes"]
    assert detect("<tool_call>\n<function={{ name }}>") is FORMATS["qwen3_coder"]
    assert detect("<tool_call>{{ n }}<arg_key>") is FORMATS["glm45"]
    assert detect("<minimax:tool_call><tool_call>") is FORMATS["minimax_m2"]
    assert detect("[TOOL_CALLS]") is FORMATS["mistral"]
    assert detect("<|header_start|>") is FORMATS["llama4_json"]
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect(None) is None


def test_reasoning_is_split_at_every_byte() -> None:
    text = "<think>\nweigh it</think>\n\nThe answer."
    for cut in range(len(text)):
        out = Output(reasoning=True)
        r, c, _ = merged(out.feed(text[:cut]) + out.feed(text[cut:]) + out.finish())
        assert (r, c) == ("\nweigh it", "The answer.")
    out = Output(reasoning=True, inside=True)
    assert merged(out.feed("hmm</think>ok") + out.finish())[:2] == ("hmm", "ok")
    out = Output(reasoning=True)
    assert merged(out.feed("no thinking") + out.finish())[:2] == ("", "no thinking")


# ------------------------------------------------------------------ grammars


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    return Grammars(tok, 2048, (tok.eos_token_id,))


def _walk(grammars: Grammars, text: str, seed: int) -> str:
    """A random path through the grammar's tokens (closing characters preferred, so the
    path ends), as text."""
    g = grammars.grammar(Structured("lark", text))
    matcher = grammars.ll.LLMatcher(grammars.tokenizer, g)
    tok = grammars.tokenizer
    rng = random.Random(seed)
    ids: list[int] = []
    for _ in range(600):
        if matcher.is_stopped():
            break
        bits = matcher.compute_bitmask()
        allowed = [j for j in range(2048) if bits[j // 8] >> (j % 8) & 1]
        assert allowed
        pick = rng.choice(allowed)
        for chars in ("<", "\n", '"}]'):  # markup's and JSON's closing characters first
            closing = [j for j in allowed if any(c in tok.decode_str([j]) for c in chars)]
            if closing and rng.random() < 0.5:
                pick = rng.choice(closing)
                break
        if pick in grammars_eos(grammars):
            break
        assert matcher.consume_token(pick)
        ids.append(pick)
    return tok.decode_str(ids)


def grammars_eos(grammars: Grammars) -> set[int]:
    return {grammars.tokenizer.eos_token}


def _fits(args: dict, tool: Tool) -> bool:
    schema = tool.parameters
    if not set(schema.get("required", [])) <= set(args):
        return False
    types = {"string": str, "integer": int, "object": dict}
    props = schema["properties"]  # others are allowed (no additionalProperties: false)
    return all(isinstance(v, types[props[k]["type"]]) for k, v in args.items() if k in props)


@pytest.mark.parametrize("fam", FAMILIES)
def test_forced_grammar_admits_only_valid_calls(fam, grammars) -> None:
    for seed, (tools, parallel) in enumerate([((WEATHER,), False), (TOOLS, True)]):
        text = _walk(grammars, grammar(FORMATS[fam], tools, True, parallel), seed)
        _, content, calls, failed = run(fam, [text])
        assert failed is None and content.strip() == "" and calls, text
        by_name = {t.name: t for t in tools}
        assert all(_fits(a, by_name[n]) for n, a in calls), text
        if not parallel:
            assert len(calls) == 1


@pytest.mark.parametrize("fam", ["hermes", "qwen3_coder"])
def test_auto_grammar_is_lazy_until_the_marker(fam, grammars) -> None:
    g = grammars.grammar(Structured("lark", grammar(FORMATS[fam], TOOLS, False, True)))
    matcher = grammars.ll.LLMatcher(grammars.tokenizer, g)
    tok = grammars.tokenizer
    prose = tok.tokenize_str("Any text {at all} <b> goes. ")
    assert matcher.consume_tokens(prose)  # free text
    bad = tok.tokenize_str(FORMATS[fam].marker + "\n{oops")
    assert matcher.validate_tokens(bad) < len(bad)  # after the marker: a call or nothing


def test_the_startup_line_says_why_tool_calls_are_off() -> None:
    from psr.serve.chat import features

    class Tok:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    off = features(Tok(), None, None)
    assert off.tool_format is None and not off.reasoning
    assert off.describe().startswith("tool calls are off: the chat template matches no ")
    assert "--tool-parser NAME" in off.describe()
    named = features(Tok(), None, "mistral")
    assert named.tool_format is FORMATS["mistral"] and "--tool-parser" in named.describe()
    Tok.chat_template = "<tool_call>{{ x }}</tool_call><think>"
    found = features(Tok(), None, None)
    assert found.tool_format is FORMATS["hermes"] and found.reasoning
    assert features(object(), None, None).why.startswith("no chat template")


def test_special_token_markers_stay_in_the_text() -> None:
    """A checkpoint whose marker is a special token (Mistral's [TOOL_CALLS]): the reply's
    text keeps it (EOS aside), so the call parses; without, it would vanish."""
    from types import SimpleNamespace

    from psr.serve.app import _marker_is_special
    from psr.serve.chat import Features
    from psr.serve.protocol import parse_chat
    from psr.serve.worker import Engine

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    engine = Engine(lambda: None)
    engine.model = SimpleNamespace(tokenizer=tok)
    engine.request_tokenizer, engine.eos_token_ids = tok, (tok.eos_token_id,)
    call = '[{"name": "get_time", "arguments": {"tz": "UTC"}}]'
    ids = tok("Sure.")["input_ids"] + [marker] + tok(call)["input_ids"] + [tok.eos_token_id]
    assert "[TOOL_CALLS]" not in engine.decode_text(ids)
    text = engine.decode_special(ids)
    assert text == "Sure.[TOOL_CALLS]" + call
    _, content, calls, failed = run("mistral", [text])
    assert calls == [("get_time", SECOND)] and content == "Sure." and failed is None
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER.openai()]}
    req = parse_chat(body)
    assert _marker_is_special(engine, req, Features(FORMATS["mistral"], "", False))
    assert not _marker_is_special(engine, req, Features(FORMATS["hermes"], "", False))
