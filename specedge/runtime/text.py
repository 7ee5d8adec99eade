"""Text: token ids to text that is safe to show, and stop strings.

`IncrementalDecoder` decodes a small window of tokens and emits only a stable prefix that does
not end in U+FFFD, so a multi-byte character split over tokens is emitted once complete.
`TextStreamer` is the request's text: it appends committed tokens, finds stop strings in the
decoded text, and releases for streaming only what no stop string could still claim (a suffix
that could grow into one is held back); the final text is cut before the stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalDecoder", "TextStreamer", "find_stop", "stop_holdback"]


class IncrementalDecoder:
    """Decode a growing list of token ids into text pieces that concatenate to the full text.

    Keeps two offsets into the ids: `prefix` (start of the decode window) and `read` (end of what
    has been emitted). Each push decodes ids[prefix:] and ids[prefix:read]; the difference is new
    text, emitted only when it does not end with U+FFFD (an incomplete UTF-8 sequence: its last
    bytes are still to come). Decoding a window rather than single tokens keeps the tokenizer's
    context-dependent rules (leading spaces, byte fallback) right.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token_ids) -> str:
        self.ids.extend(int(t) for t in token_ids)
        window = self.ids[self.prefix :]
        head = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(window)
        if len(text) > len(head) and not text.endswith("\ufffd"):
            piece = text[len(head) :]
            self.prefix = self.read
            self.read = len(self.ids)
            return piece
        return ""

    def flush(self) -> str:
        """Whatever is left (an incomplete character decodes to U+FFFD, as a full decode would)."""
        head = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(head) :] if len(text) > len(head) else ""


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """Index of the earliest stop string in text (searching from `start`), or None."""
    best = None
    for s in stops:
        i = text.find(s, max(0, start - len(s)))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


class TextStreamer:
    """The text of one request's generated tokens, with stop strings and streaming hold-back."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.decoder = IncrementalDecoder(decode)
        self.stops = list(stops)
        self.text = ""  # decoded text so far (cut before a stop string once one is found)
        self.shown = 0  # characters of `text` already released
        self.stopped = False

    def push(self, token: int) -> bool:
        """Append one committed token; True when its text completed a stop string (the text is
        then cut before it)."""
        before = len(self.text)
        self.text += self.decoder.push([token])
        if self.stops and len(self.text) > before:
            cut = find_stop(self.text, self.stops, before)
            if cut is not None:
                self.text, self.stopped = self.text[:cut], True
        return self.stopped

    def release(self) -> str:
        """New text that is safe to show: nothing a stop string could still claim."""
        hold = stop_holdback(self.text, self.stops) if self.stops else 0
        end = len(self.text) - hold
        if end <= self.shown:
            return ""
        piece = self.text[self.shown : end]
        self.shown = end
        return piece

    def finish(self) -> bool:
        """The request ended: decode what is left and look for a stop string in the whole text
        once more. True when one was found now; `rest()` then gives what is still unshown."""
        if self.stopped:
            return False
        self.text += self.decoder.flush()
        if self.stops:
            cut = find_stop(self.text, self.stops, 0)
            if cut is not None:
                self.text, self.stopped = self.text[:cut], True
                return True
        return False

    def rest(self) -> str:
        piece = self.text[self.shown :]
        self.shown = len(self.text)
        return piece
