"""Streamed text: token ids into text deltas, and stop strings that never leak.

`Detokenizer` turns one token at a time into the text it adds (nothing while a token ends
inside a multi-byte character). `StopBuffer` holds back the end of the text that could
still become a stop string, so a client never sees any part of one; at a stop string the
text ends just before it. A response's text is always the concatenation of its deltas,
streamed or not. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Prompt tokens decoded with the completion's first tokens, so that tokenizers that drop
# a leading space at the start of a decode (SentencePiece) place it correctly.
CONTEXT_TOKENS = 6
REPLACEMENT = "\ufffd"  # what decoding shows for an unfinished UTF-8 sequence


class Detokenizer:
    """Incremental decoding (as vLLM's): each new token's text is the decode of a short
    window of ids minus the decode of the window before it."""

    def __init__(self, decode: Callable[[list[int]], str], prompt: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids = list(prompt[-CONTEXT_TOKENS:])
        self._prefix = 0  # the window starts here ...
        self._read = len(self._ids)  # ... and its text up to here has been returned
        self._pieces: dict[int, str] = {}

    def piece(self, token: int) -> str:
        """One token's own text (logprobs name tokens by it), cached per request."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self._decode([token])
        return text

    def add(self, token: int) -> str:
        """The text `token` adds ("" while it ends inside a character)."""
        self._ids.append(token)
        return self._delta(final=False)

    def flush(self) -> str:
        """The text left when decoding ends (an unfinished character shows as U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(before) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]


class StopBuffer:
    """Text deltas in, the part that may be shown out. After a stop string `stopped` is
    True and the text ends before the stop string's first occurrence (as OpenAI's)."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.stopped = False
        self.matched: str | None = None  # the stop string found
        self._held = ""

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        # Held text was never shown, so every stop string that could occur starts in buf.
        found = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            at, self.matched = min(found)
            self.stopped, self._held = True, ""
            return buf[:at]
        keep = self._partial(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held text, shown when decoding ends without a stop string."""
        out, self._held = self._held, ""
        return out

    def _partial(self, buf: str) -> int:
        """The length of the longest end of `buf` that begins a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
