"""The vocabulary: token strings by id and ids by string, in a few flat arrays.

DeepSeek V4 has 129,280 tokens. As a list of str plus a str -> id dict they cost ~17 MB of Python
objects; here they are one UTF-8 blob with an offset per token (~2.3 MB), and the reverse lookup is
one sorted int64 array (1 MB): each entry is a token's hash with its low bits replaced by the token's
id, so the search for a string's hash yields candidate ids directly, equal strings in id order.
Candidates are confirmed by comparing bytes, so lookups are exact whatever collides. Strings are
decoded on access. ``ids_of_utf8`` resolves many strings at once (the ~383k lookups of building
the BPE merge table).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

import numpy as np

from ds4_mlx.errors import TokenizerError
from ds4_mlx.formats.gguf import StringArray


class Vocab(Sequence[str]):
    """Token strings indexed by id; ``id_of`` is the inverse (the lowest id for a repeated string)."""

    __slots__ = ("_blob", "_off", "_id_bits", "_keys")

    def __init__(self, blob: bytes, offsets: array):
        """``blob[offsets[i]:offsets[i + 1]]`` is token i's UTF-8; ``offsets`` is an ``array('q')``
        of n + 1 entries (kept, not copied: indexing it gives Python ints without the numpy scalar
        round trip that would be most of the cost of reading one token)."""
        self._blob = blob
        self._off = offsets
        n = len(self)
        self._id_bits = max(1, (n - 1).bit_length())
        if self._id_bits > 32:
            raise TokenizerError(f"a vocabulary of {n} tokens is too large")
        keys = np.fromiter(map(hash, self.iter_bytes()), dtype=np.int64, count=n)
        keys &= ~self._id_mask
        keys |= np.arange(n, dtype=np.int64)
        keys.sort()  # by hash, then id: the lowest id of equal strings comes first
        self._keys = keys

    @classmethod
    def from_strings(cls, tokens: Sequence[str] | StringArray, source: str = "tokenizer") -> Vocab:
        """From a GGUF ``StringArray`` (copied out of the file) or any sequence of str."""
        if isinstance(tokens, StringArray):
            return cls(*tokens.packed_utf8())
        raws = []
        for i, t in enumerate(tokens):
            if not isinstance(t, str):
                raise TokenizerError(f"{source}: token {i} is a {type(t).__name__}, expected a string")
            try:
                raws.append(t.encode("utf-8"))
            except UnicodeEncodeError as exc:
                raise TokenizerError(f"{source}: token {i} {t!r} has no UTF-8 form ({exc.reason})") from None
        offsets = array("q", [0]) * (len(raws) + 1)
        np.cumsum([len(r) for r in raws], out=np.frombuffer(offsets, dtype=np.int64)[1:])
        return cls(b"".join(raws), offsets)

    @property
    def _id_mask(self) -> int:
        return (1 << self._id_bits) - 1

    def __len__(self) -> int:
        return len(self._off) - 1

    def raw(self, token_id: int) -> bytes:
        """Token ``token_id``'s UTF-8 (the caller checks the range)."""
        off = self._off
        return self._blob[off[token_id] : off[token_id + 1]]

    def __getitem__(self, token_id):  # type: ignore[override]
        if isinstance(token_id, slice):
            return [self[i] for i in range(*token_id.indices(len(self)))]
        n = len(self)
        if not -n <= token_id < n:
            raise IndexError(f"token id {token_id} out of range for {n} tokens")
        return self.raw(token_id % n).decode("utf-8")

    def iter_bytes(self) -> Iterator[bytes]:
        blob, off = self._blob, self._off
        for i in range(len(off) - 1):
            yield blob[off[i] : off[i + 1]]

    def __iter__(self) -> Iterator[str]:
        for raw in self.iter_bytes():
            yield raw.decode("utf-8")

    def __contains__(self, piece: object) -> bool:
        return isinstance(piece, str) and self.id_of(piece) is not None

    def id_of(self, piece: str) -> int | None:
        """The lowest id whose string is ``piece``, or None."""
        try:
            raw = piece.encode("utf-8")
        except UnicodeEncodeError:
            return None
        return self.id_of_utf8(raw)

    def id_of_utf8(self, raw: bytes) -> int | None:
        keys, mask = self._keys, self._id_mask
        h = hash(raw) & ~mask
        k = int(np.searchsorted(keys, h, side="left"))
        while k < len(keys):
            key = int(keys[k])
            if key & ~mask != h:
                return None
            if self.raw(key & mask) == raw:
                return key & mask
            k += 1
        return None

    def ids_of_utf8(self, raws: list[bytes]) -> list[int | None]:
        """``id_of_utf8`` of each, in bulk: one vectorised search, then one bytes comparison each."""
        keys, mask, n = self._keys, self._id_mask, len(self._keys)
        if n == 0 or not raws:
            return [None] * len(raws)
        wanted = np.fromiter(map(hash, raws), dtype=np.int64, count=len(raws))
        wanted &= ~mask
        order = np.argsort(wanted)  # sorted needles search several times faster (cache locality)
        at = np.empty(len(raws), dtype=np.intp)
        at[order] = np.searchsorted(keys, wanted[order], side="left")
        found = keys[np.minimum(at, n - 1)]
        ids = found & mask
        offsets = np.frombuffer(self._off, dtype=np.int64)
        blob = self._blob
        stored = [blob[a:b] for a, b in zip(offsets[ids].tolist(), offsets[ids + 1].tolist())]
        same = list(map(bytes.__eq__, stored, raws))
        out: list[int | None] = [t if ok else None for t, ok in zip(ids.tolist(), same)]
        if not all(same):
            # a miss, or a hash shared by several strings: look those up one at a time
            shared = ((found & ~mask) == wanted).tolist()
            for j, (ok, sh) in enumerate(zip(same, shared)):
                if sh and not ok:
                    out[j] = self.id_of_utf8(raws[j])
        return out

    @property
    def nbytes(self) -> int:
        """Memory held by the tables (not counting the object headers)."""
        return len(self._blob) + self._off.itemsize * len(self._off) + self._keys.nbytes
