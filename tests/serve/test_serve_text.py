"""The server's pure parts: stop-string hold-back, incremental detokenizing, request checks.
No model, no server."""

from __future__ import annotations

import pytest

from psr.serve.protocol import (
    COMPLETION_MAX_TOKENS,
    APIError,
    parse_chat,
    parse_completion,
)
from psr.serve.stops import Detokenizer, StopBuffer

# ------------------------------------------------------------------ stop strings


def feed_all(stops: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    b = StopBuffer(stops)
    shown = [b.feed(d) for d in deltas]
    if not b.stopped:
        shown.append(b.flush())
    return shown, b.stopped


@pytest.mark.parametrize(
    ("stops", "deltas", "text", "stopped"),
    [
        (["END"], ["he", "llo E", "N", "D more"], "hello ", True),  # across three deltas
        (["END"], ["hello EN", "Dless"], "hello ", True),
        (["END"], ["hello E", "Nx"], "hello ENx", False),  # a false start is released
        (["b", "ab"], ["xa", "b"], "x", True),  # the earliest occurrence, whichever string
        (["\n\n"], ["a\n", "\nb"], "a", True),
        (["zz"], ["abc", "def"], "abcdef", False),
        ([], ["abc"], "abc", False),
        (["aa"], ["a", "a"], "", True),
    ],
)
def test_stop_strings(stops, deltas, text, stopped) -> None:
    shown, did_stop = feed_all(stops, deltas)
    assert "".join(shown) == text and did_stop is stopped


def test_no_part_of_a_stop_string_is_shown_before_it_is_ruled_out() -> None:
    b = StopBuffer(["</s>"])
    assert b.feed("ok <") == "ok "
    assert b.feed("/") == ""
    assert b.feed("x") == "</x"  # not a stop string after all
    assert b.feed("</s") == ""
    assert b.feed(">tail") == "" and b.stopped
    assert b.feed("more") == ""


def test_empty_stop_strings_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopBuffer(["a", ""])


# ------------------------------------------------------------------ detokenizing


class ByteTokenizer:
    """Each token is one UTF-8 byte: multi-byte characters span tokens."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_waits_for_whole_characters() -> None:
    tok = ByteTokenizer()
    text = "héllo → wörld"
    ids = list(text.encode())
    d = Detokenizer(tok.decode, list(b"prompt: "))
    deltas = [d.add(t) for t in ids] + [d.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)
    assert deltas[1] == "" and deltas[2] == "é"  # the first byte of é shows nothing


def test_detokenizer_flushes_an_unfinished_character() -> None:
    d = Detokenizer(ByteTokenizer().decode)
    assert d.add(ord("a")) == "a"
    assert d.add(0xE2) == ""
    assert d.flush() == "\ufffd"


# ------------------------------------------------------------------ request checks


def test_completion_defaults_are_openais() -> None:
    r = parse_completion({"prompt": "hi"})
    s = r.sampling
    assert s.max_tokens == COMPLETION_MAX_TOKENS and s.temperature == 1.0 and not s.greedy
    assert (s.top_p, s.top_k, s.seed, s.stop) == (1.0, 0, None, ())
    assert not r.stream and not r.include_usage and not r.echo and r.model is None


def test_completion_fields() -> None:
    r = parse_completion(
        {
            "model": "m",
            "prompt": [[1, 2, 3]],
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "seed": 2**64 - 1,
            "stop": "x",
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 1,
            "best_of": 1,
            "logit_bias": {},
            "presence_penalty": 0,
            "echo": True,
            "user": "u",
        }
    )
    assert r.prompt == [1, 2, 3] and r.sampling.greedy and r.sampling.top_k == 0
    assert r.sampling.stop == ("x",) and r.stream and r.include_usage and r.echo
    assert r.sampling.seed == 2**64 - 1


def test_chat_fields() -> None:
    r = parse_chat(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 3,
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "logprobs": False,
        }
    )
    assert r.messages[1] == {"role": "user", "content": "ab"}
    assert r.sampling.max_tokens == 3
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}).sampling.max_tokens is None


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"prompt": "x", "seed": -1}, "seed", r"seed must be an integer in \[0, "),
        ({"prompt": "x", "seed": 2**64}, "seed", "seed"),
        ({"prompt": "x", "temperature": True}, "temperature", "finite number"),
        ({"prompt": "x", "top_k": -2}, "top_k", ">= -1"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens", "integer"),
        ({"prompt": "x", "stop": 3}, "stop", "string or a list"),
        ({"prompt": "x", "suffix": "y"}, "suffix", "suffix"),
        ({"prompt": "x", "stream": True, "stream_options": {"x": 1}}, "stream_options", "x"),
        ({"prompt": [1, -2]}, "prompt", ">= 0"),
        ({}, "prompt", "required"),
        ({"prompt": "x", "model": 3}, "model", "string"),
    ],
)
def test_completion_refusals_name_the_parameter(body, param, match) -> None:
    with pytest.raises(APIError, match=match) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["param"] == param


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": 2, "max_completion_tokens": 2}, "max_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
        ({"messages": "hi"}, "messages"),
    ],
)
def test_chat_refusals_name_the_parameter(extra, param) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(APIError) as e:
        parse_chat(body)
    assert e.value.status == 400 and e.value.param == param


# ------------------------------------------------------------------ chat templates


def test_a_checkpoints_own_chat_template_is_used(tmp_path) -> None:
    from tiny_models import write_tokenizer
    from transformers import AutoTokenizer

    from psr.serve.chat import prompt_ids, render

    write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "Hi."}]
    assert render(tok, messages) == ("user: Hi.\nassistant:", "fallback")
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    text, source = render(tok, messages)
    assert (text, source) == ("[user]Hi.[assistant]", "checkpoint")
    ids, source, _ = prompt_ids(tok, messages)
    assert source == "checkpoint"
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
