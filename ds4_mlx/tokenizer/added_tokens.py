"""Finding literal token strings (special / added tokens) in text, leftmost-longest.

HF ``tokenizers`` cuts added tokens out of the text before pre-tokenization, with an Aho-Corasick
automaton in leftmost-longest mode: the match that starts first wins, and of those starting at the
same place the longest. It does this in two passes: first the tokens flagged ``normalized: false``
over the raw text, then the ``normalized: true`` ones over the stretches left between matches.
ds4 does the same with its 7 special strings (none is a prefix of another, so "longest" never
decides there).

Implemented with a character trie, entered only at positions where some token's first character
occurs (found by one C-level regex search), so text without candidates costs one scan.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import regex

_END = ""  # trie key marking "a token ends here" (real keys are single characters)


class LiteralMatcher:
    """Leftmost-longest matching of a fixed set of non-empty strings."""

    def __init__(self, strings: Mapping[str, int]):
        trie: dict = {}
        for s, tid in strings.items():
            if not s:
                continue
            node = trie
            for ch in s:
                node = node.setdefault(ch, {})
            node[_END] = tid
        self._trie = trie
        self.strings = dict(strings)
        firsts = sorted(trie)
        self._first = regex.compile("[" + "".join(regex.escape(c) for c in firsts) + "]") if firsts else None

    def finditer(self, text: str, pos: int = 0, endpos: int | None = None) -> Iterator[tuple[int, int, int]]:
        """(start, end, id) of each match in ``text[pos:endpos]``, left to right, non-overlapping."""
        if self._first is None:
            return
        end_limit = len(text) if endpos is None else endpos
        trie = self._trie
        while pos < end_limit:
            m = self._first.search(text, pos, end_limit)
            if m is None:
                return
            start = m.start()
            node = trie
            best_end, best_id = -1, -1
            k = start
            while k < end_limit:
                node = node.get(text[k])
                if node is None:
                    break
                k += 1
                tid = node.get(_END)
                if tid is not None:
                    best_end, best_id = k, tid
            if best_end < 0:
                pos = start + 1
                continue
            yield start, best_end, best_id
            pos = best_end


Segment = str | int  # a stretch of plain text, or the id of a matched token


def split_literals(text: str, passes: Sequence[LiteralMatcher]) -> list[Segment]:
    """Cut ``text`` into plain stretches and token ids; later passes only see earlier passes' gaps."""
    spans: list[tuple[int, int] | int] = [(0, len(text))] if text else []
    for matcher in passes:
        out: list[tuple[int, int] | int] = []
        for item in spans:
            if isinstance(item, int):
                out.append(item)
                continue
            lo, hi = item
            pos = lo
            for start, end, tid in matcher.finditer(text, lo, hi):
                if start > pos:
                    out.append((pos, start))
                out.append(tid)
                pos = end
            if pos < hi:
                out.append((pos, hi))
        spans = out
    return [item if isinstance(item, int) else text[item[0] : item[1]] for item in spans]
