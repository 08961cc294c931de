"""Streaming token -> text: emit only whole characters as tokens arrive.

A byte-level token can end in the middle of a UTF-8 sequence (an emoji or a CJK character is often
spread over two or three tokens), so text is released only up to the last complete character; the
rest waits for the next token. Invalid bytes become U+FFFD as soon as they are known to be invalid;
a sequence still incomplete at ``flush()`` (end of stream) becomes U+FFFD. The concatenation of all
outputs equals ``Tokenizer.decode`` of the same ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Protocol


class _TokenText(Protocol):
    def token_text(self, token_id: int) -> bytes: ...


class Utf8StreamDecoder:
    """Feed token ids one at a time; get back the newly completed text."""

    def __init__(self, tokenizer: _TokenText):
        self._tokenizer = tokenizer
        # The stdlib incremental decoder keeps an incomplete tail between calls and applies the same
        # "maximal subpart" replacement rule as a one-shot decode, so streaming == decode(all).
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self.feed_bytes(self._tokenizer.token_text(token_id))

    def feed_many(self, ids: Iterable[int]) -> str:
        return "".join(self.feed(i) for i in ids)

    def feed_bytes(self, data: bytes) -> str:
        return self._decoder.decode(data, final=False)

    @property
    def pending(self) -> bytes:
        """Bytes held back because they may start a character not yet complete."""
        return self._decoder.getstate()[0]

    def flush(self) -> str:
        """End of stream: release what is held back (an incomplete tail becomes U+FFFD); reset."""
        out = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return out

    def reset(self) -> None:
        """Drop anything held back without emitting it."""
        self._decoder.reset()
