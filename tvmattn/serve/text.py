"""Incremental detokenization with stop strings: the text of a request's tokens as it grows, in
pieces that are safe to send.

A piece never ends inside a UTF-8 sequence (a token that decodes to a replacement character
waits for the next), and text that could still become the start of a stop string is held back
until it no longer can. When a stop string appears, the text ends just before it.
"""

from __future__ import annotations

from typing import Callable


class TextStream:
    """decode(token ids) -> str (the tokenizer's); stop: the stop strings."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()):
        self.decode = decode
        self.stop = stop
        self.tokens: list[int] = []
        self.text = ""  # the decoded text of every token (complete characters)
        self.sent = 0  # characters of self.text already returned by push
        self.stopped = False  # a stop string appeared; self.final is the answer's text
        self.final: str | None = None

    def push(self, tokens: list[int]) -> str:
        """Add tokens; the new text that is safe to send ('' while waiting). After a stop string,
        `stopped` is True and the piece ends before it."""
        self.tokens.extend(tokens)
        text = self.decode(self.tokens)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for its next token
        self.text = text
        if self.stop:
            longest = max(len(s) for s in self.stop)
            start = max(self.sent - longest + 1, 0)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                self.stopped, self.final = True, text[:cut]
                piece = text[self.sent:cut] if cut > self.sent else ""
                self.sent = max(cut, self.sent)
                return piece
            hold = self._held_back(text)
        else:
            hold = 0
        end = len(text) - hold
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """At the end of the answer (no stop string seen): the text still held back."""
        if self.stopped:
            return ""
        text = self.decode(self.tokens)
        self.text = text
        piece = text[self.sent:]
        self.sent = len(text)
        return piece

    def answer(self) -> str:
        return self.final if self.stopped else self.text
