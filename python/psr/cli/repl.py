"""`psr chat`: a conversation with an offloaded checkpoint in the terminal, as `ollama run`
or `llama-cli -cnv` hold one: the checkpoint's chat template (psr.serve.chat: a plain
transcript for a checkpoint without one), the whole history rendered each turn, answers
streamed as they decode (psr.serve.stops), and a few commands:

    /stats        the last answer's figures and the session's decode statistics
    /reset        forget the conversation (the --system message stays)
    /save FILE    write the conversation as JSON: {"model": ..., "messages": [...]}
    /exit         quit (also Ctrl-D)

Ctrl-C stops the answer being written within one token and keeps the session (the
partial answer stays in the history); at the prompt it only clears the line.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from psr.cli.args import QUIET_HELP, command, model_config, model_path, nonempty, positive_int
from psr.cli.args import progress as show_progress
from psr.cli.generate import (
    add_model_option,
    add_placement_options,
    add_policy_options,
    add_sampling_options,
    check_policy_options,
    load_model,
    sampling_options,
)

HELP = "/stats, /reset, /save FILE, /exit (Ctrl-C stops an answer, Ctrl-D quits)"
# The fallback transcript's next turns: an answer ends where the model starts one.
FALLBACK_STOPS = ("\nuser:", "\nsystem:", "\nassistant:")


def add_chat(sub: Any) -> None:
    c = command(
        sub,
        "chat",
        "talk with an offloaded checkpoint: its chat template, the conversation's history, "
        "streamed answers; /stats, /reset, /save FILE, /exit; Ctrl-C stops an answer",
    )
    add_model_option(c)
    c.add_argument(
        "--system", type=nonempty, default=None, help="a system message opening the conversation"
    )
    c.add_argument(
        "--max-new-tokens", type=positive_int, default=512, help="most tokens per answer"
    )
    add_policy_options(c)
    add_placement_options(c)
    add_sampling_options(c)
    c.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    c.set_defaults(fn=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    check_policy_options(args)
    path = model_path(args.model)
    model_config(path)
    from psr.models.sources import describe_missing_tokenizer, has_tokenizer

    if not has_tokenizer(path):
        raise ValueError(f"--model: {path} has {describe_missing_tokenizer(path)}; chat needs one")
    model = load_model(path, args, show_progress(args))
    chat = Chat(model, args.system, args.max_new_tokens, sampling_options(args))
    with model:
        chat.run(sys.stdin, sys.stdout)
    return 0


class _Stop(Exception):
    """Raised from the streamer: the answer ends here (Ctrl-C, or a stop string)."""


class _Printer:
    """transformers' streamer protocol: the prompt, then each new token's text printed
    (stop strings held back); raises _Stop when the chat is interrupted or a stop string
    is complete."""

    def __init__(self, chat: Chat, prompt: list[int], out: TextIO, stops: tuple[str, ...]):
        from psr.serve.stops import Detokenizer, StopBuffer

        tok = chat.model.tokenizer
        self.chat, self.out = chat, out
        self.detok = Detokenizer(lambda ids: tok.decode(ids, skip_special_tokens=True), prompt)
        self.stops = StopBuffer(stops)
        self.text: list[str] = []
        self.tokens = 0
        self._prompt_seen = False

    def _show(self, text: str) -> None:
        if text:
            self.text.append(text)
            self.out.write(text)
            self.out.flush()

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for t in value.reshape(-1).tolist():
            if self.chat.interrupted:
                raise _Stop
            self.tokens += 1
            self._show(self.stops.feed(self.detok.add(int(t))))
            if self.stops.stopped:
                raise _Stop

    def end(self) -> None:
        pass

    def finish(self) -> str:
        """Show what is held back; the answer's whole text."""
        tail = self.stops.feed(self.detok.flush())
        if not self.stops.stopped and not self.chat.interrupted:
            tail += self.stops.flush()
        self._show(tail)
        return "".join(self.text)


class Chat:
    """One conversation with `model` (an OffloadedModel with a tokenizer)."""

    def __init__(
        self,
        model: Any,
        system: str | None = None,
        max_new_tokens: int = 512,
        sampling: dict[str, Any] | None = None,
    ) -> None:
        self.model, self.max_new_tokens = model, max_new_tokens
        self.sampling = sampling or {}
        self.system = [] if system is None else [{"role": "system", "content": system}]
        self.messages: list[dict[str, str]] = list(self.system)
        self.interrupted = False
        self.last = ""  # the last answer's figures (/stats)
        tok = model.tokenizer
        eos = {getattr(tok, "eos_token_id", None), getattr(model.config, "eos_token_id", None)}
        flat: set[int] = set()
        for e in eos:
            flat |= set(e) if isinstance(e, (list, tuple)) else {e} if isinstance(e, int) else set()
        self.eos = sorted(flat) or None

    # -------------------------------------------------------------- the loop

    def run(self, inp: TextIO, out: TextIO) -> None:
        """Read lines from `inp` until /exit or end of input; answers go to `out`."""
        tty = inp.isatty()
        sys.stderr.write(f"psr chat: {self.model.path}; {HELP}\n")
        sys.stderr.flush()
        while True:
            try:
                if tty:
                    line = input("> ")
                else:
                    line = inp.readline()
                    if not line:
                        raise EOFError
            except EOFError:
                out.write("\n")
                return
            except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
                out.write("\n(/exit or Ctrl-D quits)\n")
                continue
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line, out):
                    return
                continue
            self.answer(line, out)

    def command(self, line: str, out: TextIO) -> bool:
        """Run a /command; False for /exit."""
        name, _, arg = line.partition(" ")
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name == "/reset":
            self.messages = list(self.system)
            out.write("(conversation cleared)\n")
        elif name == "/stats":
            out.write(f"{self.last or 'no answer yet'}\n{self.model.stats.table()}\n")
        elif name == "/save" and arg.strip():
            try:
                f = Path(arg.strip()).expanduser()
                f.write_text(
                    json.dumps({"model": self.model.path, "messages": self.messages}, indent=1)
                )
                out.write(f"(saved {len(self.messages)} messages to {f})\n")
            except OSError as e:
                out.write(f"psr: cannot save to {arg.strip()}: {e.strerror or e}\n")
        else:
            out.write(f"unknown command {line!r}: {HELP}\n")
        out.flush()
        return True

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.interrupted:  # a second Ctrl-C while the first is pending: stop now
            signal.default_int_handler(signum, frame)
        self.interrupted = True

    def answer(self, text: str, out: TextIO) -> None:
        """Stream the model's answer to `text`, and keep both in the history."""
        from psr.serve.chat import prompt_ids

        self.messages.append({"role": "user", "content": text})
        ids, source, _ = prompt_ids(self.model.tokenizer, self.messages)
        room = (self.model.context or len(ids) + self.max_new_tokens) - len(ids)
        if room < 1:
            self.messages.pop()
            out.write(
                f"psr: the conversation is {len(ids)} tokens, the context "
                f"{self.model.context}: /reset to start again\n"
            )
            return
        new = min(self.max_new_tokens, room)
        printer = _Printer(self, ids, out, FALLBACK_STOPS if source == "fallback" else ())
        self.interrupted = False
        before = signal.signal(signal.SIGINT, self._on_sigint)
        t = time.perf_counter()
        try:
            self.model.generate(ids, new, eos_token_id=self.eos, streamer=printer, **self.sampling)
        except _Stop:
            pass
        finally:
            signal.signal(signal.SIGINT, before)
        seconds = time.perf_counter() - t
        answer = printer.finish()
        ended = ""
        if self.interrupted:
            ended = " [stopped]"
        elif printer.tokens == new and new < self.max_new_tokens:
            ended = f" [context full ({self.model.context} tokens): /reset]"
        out.write(f"{ended}\n")
        out.flush()
        self.messages.append({"role": "assistant", "content": answer.strip()})
        self.last = (
            f"last answer: {printer.tokens} tokens in {seconds:.2f} s "
            f"({printer.tokens / max(seconds, 1e-9):.1f} tokens/s with the prompt's "
            f"{len(ids)} tokens' prefill), template {source}"
        )
        self.interrupted = False
