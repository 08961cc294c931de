"""The BPE merge table: (left id, right id) -> (rank, merged id), each side packed into one int.

Merges come as "A B" strings, [A, B] pairs (HF tokenizer.json) or a GGUF ``StringArray`` of "A B";
the vocabulary as a resolver from a list of UTF-8 strings to their ids (None where absent), such as
``Vocab.ids_of_utf8``. The ~128k merges are resolved a chunk at a time in columns (all left parts,
all right parts, all merged strings) with bulk operations (numpy for the packing), so building the
table creates few container objects and holds only one chunk's temporaries at a time: the table
itself (~13 MB for V4: 2 ints per merge and the dict) is all that stays. For a GGUF array the spaces
are found with numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice

import numpy as np

from ds4_mlx.errors import TokenizerError
from ds4_mlx.formats.gguf import StringArray

# Pair keys and merge values are packed into single ints (faster dict/heap operations than tuples).
ID_BITS = 24  # token ids < 16.7M
ID_MASK = (1 << ID_BITS) - 1

_CHUNK = 2048
_SPACE = 0x20

Merge = str | bytes | Sequence[str]
Resolver = Callable[[list[bytes]], list[int | None]]


def build_merge_table(resolve: Resolver, merges: StringArray | Iterable[Merge]) -> dict[int, int]:
    """``{left << ID_BITS | right: rank << ID_BITS | merged}``; a repeated pair keeps its last rank,
    as HF's merge map. Raises TokenizerError naming the first bad merge of a chunk."""
    table: dict[int, int] = {}
    columns = _gguf_columns(merges) if isinstance(merges, StringArray) else _generic_columns(merges)
    for rank0, lefts, rights in columns:
        _add(table, resolve, rank0, lefts, rights)
    return table


def _add(table: dict[int, int], resolve: Resolver, rank0: int, lefts: list[bytes], rights: list[bytes]) -> None:
    joined = [a + b for a, b in zip(lefts, rights)]
    left, right, merged = resolve(lefts), resolve(rights), resolve(joined)
    if None in left or None in right or None in merged:
        k = min(c.index(None) for c in (left, right, merged) if None in c)
        a, b = lefts[k], rights[k]
        token = a if left[k] is None else b if right[k] is None else a + b
        raise TokenizerError(f"merge #{rank0 + k} {_text(a + b' ' + b)!r}: token {_text(token)!r} "
                             f"is not in the vocabulary")
    keys = (np.array(left, dtype=np.int64) << ID_BITS) | np.array(right, dtype=np.int64)
    ranks = np.arange(rank0, rank0 + len(lefts), dtype=np.int64)
    values = (ranks << ID_BITS) | np.array(merged, dtype=np.int64)
    table.update(zip(keys.tolist(), values.tolist()))


def _gguf_columns(merges: StringArray) -> Iterator[tuple[int, list[bytes], list[bytes]]]:
    """Left and right parts of a GGUF merge array, cut at the one space of each element (found
    with numpy over each run of elements joined together)."""
    it = merges.iter_bytes()
    rank0 = 0
    while raws := list(islice(it, _CHUNK)):
        n = len(raws)
        blob = b"".join(raws)
        ends = np.cumsum(np.fromiter(map(len, raws), dtype=np.int64, count=n))
        starts = np.concatenate(([0], ends[:-1]))
        spaces = np.flatnonzero(np.frombuffer(blob, dtype=np.uint8) == _SPACE)
        owner = np.searchsorted(ends, spaces, side="right")  # the element each space is in
        count = np.bincount(owner, minlength=n)
        cut = np.full(n, -1, dtype=np.int64)
        cut[owner] = spaces  # the one space of a valid element; invalid ones are rejected below
        good = (count == 1) & (cut > starts) & (cut < ends - 1)
        if not good.all():
            k = int(np.argmin(good))
            raise TokenizerError(f"merge #{rank0 + k} {_text(raws[k])!r} is not two tokens separated by one space")
        at = (cut - starts).tolist()
        yield rank0, [m[:c] for m, c in zip(raws, at)], [m[c + 1 :] for m, c in zip(raws, at)]
        rank0 += n


def _generic_columns(merges: Iterable[Merge]) -> Iterator[tuple[int, list[bytes], list[bytes]]]:
    it = iter(merges)
    rank0 = 0
    while True:
        chunk = list(islice(it, _CHUNK))
        if not chunk:
            return
        lefts, rights = [], []
        for k, m in enumerate(chunk):
            a, b = _parts(rank0 + k, m)
            lefts.append(a)
            rights.append(b)
        yield rank0, lefts, rights
        rank0 += len(chunk)


def _parts(rank: int, m: object) -> tuple[bytes, bytes]:
    """One merge as its two parts' UTF-8."""
    if isinstance(m, bytes):
        parts: list = m.split(b" ")
    elif isinstance(m, str):
        parts = m.split(" ")
    elif isinstance(m, (list, tuple)):
        parts = list(m)
    else:
        raise TokenizerError(f"merge #{rank} is a {type(m).__name__}, expected 'A B' or [A, B]")
    if len(parts) != 2 or not parts[0] or not parts[1]:
        raise TokenizerError(f"merge #{rank} {_text(m)!r} is not two tokens separated by one space")
    out = []
    for p in parts:
        if isinstance(p, bytes):
            out.append(p)
            continue
        if not isinstance(p, str):
            raise TokenizerError(f"merge #{rank} {m!r}: {p!r} is a {type(p).__name__}, expected a string")
        try:
            out.append(p.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"merge #{rank} {m!r} has no UTF-8 form ({exc.reason})") from None
    return out[0], out[1]


def _text(s: object) -> object:
    """A merge or token for an error message: bytes shown as the text they encode."""
    return s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
