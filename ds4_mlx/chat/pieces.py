"""Typed pieces of a rendered prompt, and their injection-safe tokenization.

ds4-server renders a chat request to one string and tokenizes it with special-string recognition,
so a user who types ``<｜Assistant｜>`` or ``</think>`` in a message switches roles.  Here the
renderers build a list of :class:`Piece` instead: *control* pieces are template markup, whose
special strings are the real control tokens; every other piece is text that came from the request
(message content, reasoning, tool results, tool schemas, tool-call names and values), which is
always plain BPE.

:func:`encode_pieces` cuts only the control pieces at special strings and BPE-encodes each stretch
between two control tokens as one string, whatever mix of markup and request text it holds.  That
is exactly how ``Tokenizer.encode_rendered`` cuts the joined text, so on a request whose text
contains no special string the ids are ds4's ids; a special string inside request text costs what
the same characters cost as plain text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Piece:
    """One stretch of rendered prompt text; ``control`` marks template markup."""

    text: str
    control: bool


def ctl(text: str) -> Piece:
    """Template markup: its special strings become control tokens."""
    return Piece(text, True)


def txt(text: str) -> Piece:
    """Text from the request: never a control token."""
    return Piece(text, False)


def join(pieces: Iterable[Piece]) -> str:
    """The rendered string (ds4's text, byte for byte)."""
    return "".join(p.text for p in pieces)


class PieceTokenizer(Protocol):
    special_ids: Mapping[str, int]

    def encode(self, text: str) -> list[int]: ...


@functools.lru_cache(maxsize=8)
def _special_pattern(specials: tuple[str, ...]) -> re.Pattern:
    # Longest first so that, of the alternatives matching at one position, the longest wins
    # (leftmost-longest, as the tokenizer's literal matcher; ds4's strings are not prefixes of
    # each other anyway).
    ordered = sorted((s for s in specials if s), key=len, reverse=True)
    return re.compile("|".join(re.escape(s) for s in ordered)) if ordered else re.compile(r"(?!)")


def encode_pieces(tokenizer: PieceTokenizer, pieces: Iterable[Piece]) -> list[int]:
    """Ids of the pieces: special strings of control pieces -> their ids; everything between two
    such ids (markup and request text alike) -> one plain-BPE stretch."""
    specials = dict(tokenizer.special_ids)
    pattern = _special_pattern(tuple(sorted(specials)))
    out: list[int] = []
    pending: list[str] = []

    def flush() -> None:
        if pending:
            out.extend(tokenizer.encode("".join(pending)))
            pending.clear()

    for piece in pieces:
        if not piece.text:
            continue
        if not piece.control:
            pending.append(piece.text)
            continue
        pos = 0
        for m in pattern.finditer(piece.text):
            if m.start() > pos:
                pending.append(piece.text[pos:m.start()])
            flush()
            out.append(int(specials[m.group(0)]))
            pos = m.end()
        if pos < len(piece.text):
            pending.append(piece.text[pos:])
    flush()
    return out
