"""Byte-level BPE model: one pre-token piece -> token ids.

Merging rule (HF ``tokenizers`` BPE, also ds4's): repeatedly merge the adjacent pair with the lowest
merge rank, the leftmost one on equal rank, until no adjacent pair has a rank.

Two equivalent implementations: a plain list scan for short pieces (quadratic, but on a handful of
symbols it beats any bookkeeping), and for long ones a doubly linked list of symbols with a heap of
candidate merges keyed by (rank, position), so a single 1 MB piece (a run of letters with no space,
which the pre-tokenizer keeps whole) costs O(n log n), not O(n^2). A heap entry goes stale when one
of its two symbols has changed since it was pushed; it is recognised on pop by looking the current
pair up again. Positions are those of the left symbol in the original sequence; symbols only grow
rightwards, so "leftmost" is "smallest position".
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

from ds4_mlx.errors import TokenizerError
from ds4_mlx.formats.gguf import StringArray
from ds4_mlx.tokenizer.byte_map import BYTE_TO_UNICODE, text_to_unicode
from ds4_mlx.tokenizer.merge_table import ID_BITS as _ID_BITS
from ds4_mlx.tokenizer.merge_table import ID_MASK as _ID_MASK
from ds4_mlx.tokenizer.merge_table import Merge, Resolver, build_merge_table
from ds4_mlx.tokenizer.vocab import Vocab

# Pieces up to this many byte-level symbols use the list scan.
_SHORT_PIECE = 48
# Pieces longer than this are not cached (HF does the same; keeps the cache from pinning huge strings).
_CACHE_MAX_PIECE = 256
_CACHE_MAX_ENTRIES = 1 << 18


class BPE:
    """Byte-level BPE over a vocabulary and an ordered merge list ("A B" strings or [A, B] pairs).

    ``BPE(vocab, merges)`` takes the vocabulary as str -> id; ``BPE.from_vocab`` a ``Vocab``, with the
    merges also as a GGUF ``StringArray`` (see merge_table.py). Neither keeps the vocabulary: only
    the 256 byte symbols' ids and the merge table stay.
    """

    def __init__(self, vocab: Mapping[str, int], merges: Iterable[Merge]):
        ids: dict[bytes, int] = {}
        for s, tid in vocab.items():
            try:
                ids[s.encode("utf-8")] = tid
            except UnicodeEncodeError as exc:
                raise TokenizerError(f"vocabulary string {s!r} has no UTF-8 form ({exc.reason})") from None
        self._build(lambda raws: list(map(ids.get, raws)), max(ids.values(), default=0), merges)

    @classmethod
    def from_vocab(cls, vocab: Vocab, merges: StringArray | Iterable[Merge]) -> BPE:
        bpe = cls.__new__(cls)
        bpe._build(vocab.ids_of_utf8, len(vocab) - 1, merges)
        return bpe

    def _build(self, resolve: Resolver, max_id: int, merges: StringArray | Iterable[Merge]) -> None:
        if max_id > _ID_MASK:
            raise TokenizerError(f"token ids above {_ID_MASK} are not supported")
        char_ids = resolve([ch.encode("utf-8") for ch in BYTE_TO_UNICODE])
        if None in char_ids:
            b = char_ids.index(None)
            raise TokenizerError(f"vocabulary lacks the byte-level symbol {BYTE_TO_UNICODE[b]!r} "
                                 f"(byte 0x{b:02X}); every byte must have a token")
        self._char_id = dict(zip(BYTE_TO_UNICODE, char_ids))
        self._merges = build_merge_table(resolve, merges)
        self.n_merges = len(self._merges)
        self._cache: dict[str, tuple[int, ...]] = {}

    # -- public ------------------------------------------------------------------------------------

    def encode_piece(self, piece: str) -> tuple[int, ...]:
        """Token ids of one pre-token piece given as ordinary text (UTF-8 encoded here)."""
        hit = self._cache.get(piece)
        if hit is not None:
            return hit
        symbols = text_to_unicode(piece)
        char_id = self._char_id
        ids = [char_id[c] for c in symbols]
        if len(ids) > 1:
            ids = self._merge_short(ids) if len(ids) <= _SHORT_PIECE else self._merge_long(ids)
        out = tuple(ids)
        if len(piece) <= _CACHE_MAX_PIECE:
            if len(self._cache) >= _CACHE_MAX_ENTRIES:
                self._cache.clear()
            self._cache[piece] = out
        return out

    def clear_cache(self) -> None:
        self._cache.clear()

    # -- merging -----------------------------------------------------------------------------------

    def _merge_short(self, ids: list[int]) -> list[int]:
        merges = self._merges
        while True:
            best = -1
            best_val = 0
            for i in range(len(ids) - 1):
                v = merges.get((ids[i] << _ID_BITS) | ids[i + 1])
                # strict < keeps the leftmost of equal ranks; comparing packed values compares ranks
                # first (the low bits, the new id, are fixed by the pair, equal ranks mean equal pairs)
                if v is not None and (best < 0 or v < best_val):
                    best, best_val = i, v
            if best < 0:
                return ids
            ids[best : best + 2] = [best_val & _ID_MASK]

    def _merge_long(self, ids: list[int]) -> list[int]:
        merges = self._merges
        n = len(ids)
        sym = ids  # sym[i] < 0: symbol i was absorbed by its left neighbour
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        # heap key = rank * n + position: ordered by rank, then leftmost
        heap = []
        for i in range(n - 1):
            v = merges.get((sym[i] << _ID_BITS) | sym[i + 1])
            if v is not None:
                heap.append((v >> _ID_BITS) * n + i)
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            rank, i = divmod(pop(heap), n)
            left = sym[i]
            if left < 0:
                continue
            j = nxt[i]
            if j < 0:
                continue
            v = merges.get((left << _ID_BITS) | sym[j])
            if v is None or (v >> _ID_BITS) != rank:
                continue  # stale: the pair at i changed since this entry was pushed
            new = v & _ID_MASK
            sym[i] = new
            sym[j] = -1
            k = nxt[j]
            nxt[i] = k
            if k >= 0:
                prv[k] = i
                w = merges.get((new << _ID_BITS) | sym[k])
                if w is not None:
                    push(heap, (w >> _ID_BITS) * n + i)
            p = prv[i]
            if p >= 0:
                w = merges.get((sym[p] << _ID_BITS) | new)
                if w is not None:
                    push(heap, (w >> _ID_BITS) * n + p)
        out = []
        i = 0
        while i >= 0:
            out.append(sym[i])
            i = nxt[i]
        return out
