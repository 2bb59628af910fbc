"""Streaming detokenization and stop-string handling.

Two independent pieces a request's output path chains together:

* `IncrementalDetokenizer` turns token ids, as they arrive, into text deltas
  that never contain a half-decoded multi-byte character.
* `StopStringChecker` takes those deltas, truncates the text at the earliest
  stop string and holds back any tail that could still grow into a stop
  string, so that nothing it has streamed ever has to be taken back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from tokenizers import Tokenizer

#: What byte-level decoding produces for an incomplete (or invalid) UTF-8
#: sequence. A decoded window ending in it may be a character whose remaining
#: bytes are in tokens that have not arrived yet.
REPLACEMENT_CHAR = "\ufffd"

#: How many trailing prompt tokens seed the decoding window. Some decoders
#: (e.g. SentencePiece's Metaspace) render a token differently at the start of
#: a text (dropping its leading space), so the first generated token is decoded
#: after a little real context and only the text past that context is emitted.
#: Same value as vLLM.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Decodes one request's generated tokens into streamed text deltas.

    Uses the prefix-offset / read-offset scheme of vLLM and HF's TextStreamer:
    the window ``ids[prefix_offset:]`` is decoded, and the text beyond
    ``decode(ids[prefix_offset:read_offset])`` (already emitted) is new. While
    the decoded window ends in U+FFFD its last character may be incomplete, so
    the trailing U+FFFD run is held back; once the window decodes cleanly the
    offsets move forward and the window shrinks again.

    Everything before that trailing run is emitted right away, even while the
    window is held open. This matters when every token ends inside a character
    (byte-level BPE on CJK text can merge the last bytes of one character with
    the first bytes of the next): a pure "hold while it ends in U+FFFD" rule
    would stall the whole run. UTF-8 decoding is self-synchronising, so text
    before the last incomplete sequence never changes when more bytes arrive.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        prompt_ids: the request's prompt ids; only the last
            `PROMPT_CONTEXT_TOKENS` are used, as decoding context, never emitted.
        skip_special_tokens: passed to ``tokenizer.decode``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = [int(t) for t in prompt_ids[-PROMPT_CONTEXT_TOKENS:]]
        # _ids holds the context tokens followed by the generated tokens.
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        # Characters already emitted past _prefix_text within the current window.
        self._window_emitted = 0
        self._text_parts: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """The generated token ids so far (prompt context excluded)."""
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        return "".join(self._text_parts)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self.skip_special_tokens
        )

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the newly completed text ("" if none)."""
        self._ids.append(token_id)
        window = self._decode(self._prefix_offset)
        complete = window.rstrip(REPLACEMENT_CHAR)
        already = len(self._prefix_text) + self._window_emitted
        delta = complete[already:]
        self._window_emitted += len(delta)

        if not window.endswith(REPLACEMENT_CHAR):
            # The window ends on a whole character: everything is emitted, so
            # start the next window after what was just read, keeping the last
            # read tokens as decoding context.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
            self._window_emitted = 0

        if delta:
            self._text_parts.append(delta)
        return delta

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append several tokens; return the concatenated delta."""
        return "".join(self.add_token(t) for t in token_ids)

    def finish(self) -> str:
        """Emit whatever is still held back (e.g. a genuinely broken trailing
        byte sequence, which then appears as U+FFFD). Call once, at the end."""
        window = self._decode(self._prefix_offset)
        delta = window[len(self._prefix_text) + self._window_emitted :]
        self._window_emitted += len(delta)
        if delta:
            self._text_parts.append(delta)
        return delta


# ---------------------------------------------------------------------------
# Stop strings
# ---------------------------------------------------------------------------


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string in ``text[start:]``.

    Returns:
        ``(index, stop)`` of the match that starts first (on a tie, the first
        in ``stops``), or None if no stop string occurs.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Cut ``text`` before its earliest stop string.

    Returns:
        ``(text_before_stop, stop)``, or ``(text, None)`` if there is no stop.
    """
    match = find_stop(text, stops)
    if match is None:
        return text, None
    return text[: match[0]], match[1]


def partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a
    stop string, i.e. how much of the tail may still become a stop string."""
    longest = 0
    for stop in stops:
        # Only suffixes longer than the current best can improve it.
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class StopCheck(NamedTuple):
    """Result of feeding one delta to a `StopStringChecker`."""

    #: Text that is now safe to stream (never part of a stop string).
    delta: str
    #: The stop string that ended the output, or None while it continues.
    stop: str | None


class StopStringChecker:
    """Streams text while watching for stop strings.

    Feed it the detokenizer's deltas. Each call returns the part of the text
    that can safely be shown: text before a stop string, minus any tail that
    is the beginning of a stop string (held until it either completes, and is
    dropped, or diverges, and is released). The concatenation of the returned
    deltas is therefore always a prefix of the final output.

    Args:
        stops: the request's stop strings (may be empty).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self._max_stop_len = max((len(s) for s in self.stops), default=0)
        self._text = ""  # everything fed so far
        self._emitted = 0  # length of the prefix of _text already returned
        self.stopped_by: str | None = None

    @property
    def text(self) -> str:
        """The output text so far: what has been returned as deltas."""
        return self._text[: self._emitted]

    def feed(self, delta: str) -> StopCheck:
        """Add new text; return what may be streamed and whether a stop hit."""
        if self.stopped_by is not None:
            raise RuntimeError("StopStringChecker fed after a stop string matched")
        old_len = len(self._text)
        self._text += delta
        # A new match must end inside the new delta, so it starts no earlier
        # than max_stop_len - 1 characters before it.
        search_from = max(0, old_len - self._max_stop_len + 1)
        match = find_stop(self._text, self.stops, search_from)
        if match is not None:
            index, self.stopped_by = match
            # Held-back text covered every partial stop, so index >= _emitted.
            return StopCheck(self._release(index), self.stopped_by)
        hold = partial_stop_length(self._text, self.stops)
        return StopCheck(self._release(len(self._text) - hold), None)

    def finish(self) -> str:
        """Release the held tail when generation ends without a stop string."""
        if self.stopped_by is not None:
            return ""
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        """Emit ``_text[_emitted:end]`` (never moving backwards)."""
        end = max(end, self._emitted)
        out = self._text[self._emitted : end]
        self._emitted = end
        return out
