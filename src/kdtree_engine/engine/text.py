"""Streaming text from token ids: incremental detokenization and stop strings.

Decoding each new piece of ids alone is wrong in two ways: a byte-level BPE token (or a byte-fallback
token) can end inside a multi-byte UTF-8 character, which then decodes to U+FFFD, and a piece decoded
alone can lose the space a Metaspace / WordPiece / id-joining decoder puts between tokens. Decoding the
whole output every time is right but quadratic. `IncrementalDetokenizer` decodes a bounded window: a
few already-printed tokens as context plus the tokens not printed yet, and prints the new suffix.
`TextStream` cuts the printed text at stop strings; `StopStringMatcher` finds the token that completes
one, so that generate() stops the request there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

REPLACEMENT = "\ufffd"  # U+FFFD: what a UTF-8 decoder gives for incomplete or invalid bytes


class IncrementalDetokenizer:
    """push(ids) -> the new text that is final, flush() -> the rest; the concatenation of everything
    returned equals tokenizer.decode(all ids, skip_special_tokens=...).

    tokenizer: anything with decode(ids, skip_special_tokens=...) (a transformers tokenizer, a
    tokenizers.Tokenizer, ...); its `all_special_ids` (if any) are dropped on entry when skipping.

    How: the window is `context` tokens that are already printed (their text is `_shown`) followed by
    the pending tokens. A push decodes the window; when that text does not end with U+FFFD, everything
    past `_shown` is printed and the window slides (the last few tokens, starting at a character
    boundary, become the context). When it does end with U+FFFD (a character cut by a token boundary),
    the last few token boundaries are tried for one that does not, and the text up to it is printed.
    When none does and more than `max_held` tokens are pending, all but the last character is printed:
    a UTF-8 decoder's output is final except for its last character, so for byte-level decoders (and any
    decoder where decode(a + b) == decode(a) + decode(b) at character boundaries) this is exact, and it
    keeps the window bounded for any input (e.g. a model that emits invalid UTF-8). Each push decodes
    O(1 + len(ids)) tokens a bounded number of times: the work is linear in the output length.

    Exactness: byte-level BPE (GPT-2 / DeepSeek-V3 style), word-level and id-joining decoders: always,
    for any ids, any split into pushes, any max_held. SentencePiece byte fallback (Llama 2 style,
    needs max_held >= 3): whenever the output is valid UTF-8; such a decoder turns a whole run of byte
    tokens into U+FFFD when it contains an invalid or incomplete character, and the stream may already
    have printed the complete characters of that run.
    """

    CONTEXT = 4  # printed tokens kept as context (also: bytes of an incomplete character, at most 3, + 1)
    SEARCH = 4  # token boundaries tried back from the end when the window's text ends with U+FFFD

    def __init__(self, tokenizer, skip_special_tokens: bool = True, *, max_held: int = 8) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        special = getattr(tokenizer, "all_special_ids", None) if skip_special_tokens else None
        self._special = frozenset(int(i) for i in special or ())
        self.max_held = max_held
        self._reset()

    def _reset(self) -> None:
        self._ids: list[int] = []  # the window
        self._read = 0  # window[:_read] is printed, window[_read:] is pending
        self._shown = ""  # the printed prefix of decode(window)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: Iterable[int]) -> str:
        """Adds token ids; returns the text that is now final (possibly "")."""
        new = [int(t) for t in ids]
        new = [t for t in new if t not in self._special]
        if not new:
            return ""
        window = self._ids
        window.extend(new)
        n = len(window)
        text = self._decode(window)
        if not text.endswith(REPLACEMENT):
            return self._emit(text, n)
        for cut in range(n - 1, max(self._read, n - 1 - self.SEARCH), -1):
            head = self._decode(window[:cut])
            if not head.endswith(REPLACEMENT):
                return self._emit(head, cut)
        if n - self._read <= self.max_held:
            return ""
        return self._emit_all_but_last(text)

    def flush(self) -> str:
        """The text still held back (an incomplete character shows as U+FFFD); resets the state."""
        piece = self._decode(self._ids)[len(self._shown) :] if self._ids else ""
        self._reset()
        return piece

    def _emit(self, text: str, cut: int) -> str:
        """Prints text = decode(window[:cut]) past _shown; slides the window to a context ending at cut."""
        piece = text[len(self._shown) :]
        window = self._ids
        for j in range(max(0, cut - self.CONTEXT), cut):
            context = self._decode(window[j:cut])
            if text.endswith(context) and not context.startswith(REPLACEMENT):
                break  # window[j] starts at a character boundary, and decodes the same way from there
        else:
            j, context = cut, ""
        self._ids, self._read, self._shown = window[j:], cut - j, context
        return piece

    def _emit_all_but_last(self, text: str) -> str:
        """No token boundary near the end is a character boundary: print all but the last character (it
        may be an incomplete one) and keep the last CONTEXT tokens, which hold its bytes, as the window:
        their text starts with U+FFFD for bytes of characters printed before, counted as printed."""
        window = self._ids
        j = max(0, len(window) - self.CONTEXT)
        tail = self._decode(window[j:])
        if not tail.endswith(REPLACEMENT):  # not a byte-level decoder: print everything, start afresh
            piece = text[len(self._shown) :]
            self._reset()
            return piece
        piece = text[len(self._shown) : -1]
        self._ids, self._read, self._shown = window[j:], len(window) - j, tail[:-1]
        return piece


class TextStream:
    """One request's streamed text: an IncrementalDetokenizer whose text is cut before the first
    occurrence of any stop string (the stop string is not part of the text). push(ids) / flush()
    return what may be printed now: an end of the text that begins a stop string (at most len(longest
    stop string) - 1 characters) is held back until the next piece shows whether the stop string
    follows. After a stop string, `stopped` is True and later ids are ignored. `text` is everything
    returned so far. Work per push: O(len(piece) + hold * number of stop strings)."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stops = tuple(s for s in stop_strings if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.stopped = False
        self._pending = ""  # decoded, not returned yet (at most `hold` characters between calls)
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def push(self, ids: Iterable[int]) -> str:
        return "" if self.stopped else self._add(self.detok.push(ids), final=False)

    def flush(self) -> str:
        return "" if self.stopped else self._add(self.detok.flush(), final=True)

    def _add(self, piece: str, final: bool) -> str:
        buf = self._pending + piece
        # A stop string not found before ends in `piece`, so it starts inside buf (pending >= hold chars).
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            buf, self.stopped, final = buf[: min(hits)], True, True
        keep = 0 if final else self._could_start_a_stop(buf)
        out, self._pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
        if out:
            self._parts.append(out)
        return out

    def _could_start_a_stop(self, buf: str) -> int:
        """The length of the longest end of buf that begins a stop string (at most `hold`): the text
        that must wait for the next piece. A stop string that ends later starts inside it."""
        for k in range(min(self.hold, len(buf)), 0, -1):
            if any(s.startswith(buf[-k:]) for s in self.stops):
                return k
        return 0


class StopStringMatcher:
    """Finds where one request's decoded output first contains a stop string, token by token, as the
    tokens are committed: feed(ids) -> how many of these ids to keep (up to and including the token
    whose text completes a stop string), or None when none is complete yet. After a hit, `stopped` is
    True. The text is decoded incrementally (IncrementalDetokenizer, one push per token: linear work)
    and only the last len(longest stop string) - 1 characters are kept between tokens."""

    def __init__(self, tokenizer, stop_strings: Sequence[str], skip_special_tokens: bool = True) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stops = tuple(s for s in stop_strings if s)
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.stopped = False
        self._tail = ""  # the end of the text decoded so far: where a stop string may have begun

    def feed(self, ids: Sequence[int]) -> int | None:
        if self.stopped or not self.stops:
            return None
        for i, token in enumerate(ids):
            piece = self.detok.push([token])
            if not piece:
                continue
            text = self._tail + piece
            if any(s in text for s in self.stops):
                self.stopped = True
                return i + 1
            self._tail = text[-self.keep :] if self.keep else ""
        return None


__all__ = ["REPLACEMENT", "IncrementalDetokenizer", "StopStringMatcher", "TextStream"]
