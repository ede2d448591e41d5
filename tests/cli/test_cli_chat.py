"""`psr chat` driven through a pseudo-terminal (issue 42): the template renders the whole
history each turn, answers stream and equal model.generate's on the same prompt, /stats,
/save, /reset, and Ctrl-C stops an answer while the session goes on."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import sys
import time
from pathlib import Path

import pytest
from tiny_models import tiny_model, write_checkpoint, write_tokenizer

import psr
from psr.serve.chat import prompt_ids


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = write_checkpoint(tiny_model("olmoe"), tmp_path_factory.mktemp("chat") / "olmoe")
    write_tokenizer(path)
    return path


class Term:
    """A child process on a pseudo-terminal: what it wrote, and keys typed to it."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            os.execve(sys.executable, [sys.executable, *argv], env)
        self.seen = ""

    def expect(self, pattern: str, timeout: float = 120) -> str:
        """Read until `pattern` (a regex) appears after what earlier calls consumed."""
        end = time.monotonic() + timeout
        while (m := re.search(pattern, self.seen)) is None:
            left = end - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.seen[-2000:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    self.seen += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    assert re.search(pattern, self.seen), self.seen[-2000:]
        before, self.seen = self.seen[: m.end()], self.seen[m.end() :]
        return before

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)


def _reference(ckpt: Path, messages: list[dict[str, str]], new: int) -> str:
    """model.generate's greedy answer to `messages` under the chat's template and stops."""
    with psr.load(ckpt, "exact", 0.5, progress=False) as model:
        tok = model.tokenizer
        ids, source, _ = prompt_ids(tok, messages)
        assert source == "fallback"  # the tiny tokenizer has no template
        out = model.generate(ids, new)[0, len(ids) :].tolist()
    text = tok.decode(out, skip_special_tokens=True)
    cut = min([i for s in ("\nuser:", "\nsystem:", "\nassistant:") if (i := text.find(s)) >= 0]
              or [len(text)])  # fmt: skip
    return text[:cut].strip()


def test_chat_through_a_pseudo_terminal(ckpt, tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PSR_COPY_DELAY_US="20000")
    argv = ["-m", "psr.cli", "chat", "--model", str(ckpt), "--policy", "exact"]
    argv += ["--residency", "0.5", "--max-new-tokens", "12", "--decode", "host", "--quiet"]
    argv += ["--system", "Be brief."]
    term = Term(argv, env)
    term.expect(r"psr chat: .*/stats, /reset, /save FILE")
    term.expect(r"> $")
    term.type("Hello there\n")
    first = term.expect(r"\n> $").split("Hello there", 1)[1]
    term.type("/stats\n")
    stats = term.expect(r"\n> $")
    assert "last answer: " in stats and "template fallback" in stats and "hit rate" in stats
    term.type("And then?\n")
    term.expect(r"\n> $")
    term.type(f"/save {tmp_path / 'a.json'}\n")
    term.expect(r"saved 5 messages .*\n> $")
    msgs = json.loads((tmp_path / "a.json").read_text())["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    # Each answer is model.generate's on the whole history so far, streamed as it came.
    assert msgs[2]["content"] == _reference(ckpt, msgs[:2], 12)
    assert msgs[2]["content"] in first
    assert msgs[4]["content"] == _reference(ckpt, msgs[:4], 12)

    term.type("/reset\n")
    term.expect(r"conversation cleared\)\s*\n> $")
    term.type("/exit\n")
    assert term.wait() == 0


def test_ctrl_c_stops_an_answer_and_keeps_the_session(ckpt, tmp_path) -> None:
    # Slow copies (0-100 ms each, exact at 25% residency) keep a long answer streaming.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PSR_COPY_DELAY_US="100000")
    argv = ["-m", "psr.cli", "chat", "--model", str(ckpt), "--policy", "exact"]
    argv += ["--residency", "0.25", "--max-new-tokens", "100", "--decode", "host", "--quiet"]
    term = Term(argv, env)
    term.expect(r"> $")
    term.type("Tell me everything\n")
    term.expect(r"Tell me everything\r\n\S")  # the answer has begun
    term.type("\x03")
    term.expect(r"\[stopped\]\s*\n> $")
    term.type("Still there?\n")  # the session goes on: a second answer, stopped too
    term.expect(r"Still there\?\r\n\S")
    term.type("\x03")
    term.expect(r"\[stopped\]\s*\n> $")
    term.type("/save " + str(tmp_path / "b.json") + "\n")
    term.expect(r"saved 4 messages.*\n> $")
    msgs = json.loads((tmp_path / "b.json").read_text())["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == "Still there?"
    assert all(0 < len(m["content"]) < 100 for m in msgs[1::2])  # partial answers kept
    term.type("/stats\n")
    assert re.search(r"last answer: (\d+) tokens", term.expect(r"\n> $"))
    term.type("\x04")  # Ctrl-D at the prompt quits
    assert term.wait() == 0
