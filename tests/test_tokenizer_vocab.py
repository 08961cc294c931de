"""The compact vocabulary (``Vocab``) and the BPE merge table built from GGUF string arrays.

References: plain Python dicts and lists (a str -> first id dict; the merge list walked in order)
and the list-based construction path, which the GGUF path must match exactly.
"""

from __future__ import annotations

import random
import struct

import pytest

import ds4_mlx.tokenizer.vocab as vocab_module
from ds4_mlx.errors import TokenizerError
from ds4_mlx.formats.gguf import GGUFFile, StringArray, ValueType
from ds4_mlx.tokenizer import SPECIAL_STRINGS, Tokenizer
from ds4_mlx.tokenizer.bpe import BPE
from ds4_mlx.tokenizer.byte_map import BYTE_TO_UNICODE
from ds4_mlx.tokenizer.merge_table import ID_BITS
from ds4_mlx.tokenizer.vocab import Vocab


def _s(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: ValueType, payload: bytes) -> bytes:
    return _s(key.encode()) + struct.pack("<I", vtype) + payload


def _str_array(key: str, items: list[str]) -> bytes:
    return _kv(key, ValueType.ARRAY, struct.pack("<IQ", ValueType.STRING, len(items))
               + b"".join(_s(x.encode()) for x in items))


def _write_gguf(path, tokens: list[str], merges: list[str], types: list[int] | None = None):
    types = types if types is not None else [3] * 7 + [1] * (len(tokens) - 7)
    kvs = [
        _kv("tokenizer.ggml.model", ValueType.STRING, _s(b"gpt2")),
        _kv("tokenizer.ggml.pre", ValueType.STRING, _s(b"joyai-llm")),
        _str_array("tokenizer.ggml.tokens", tokens),
        _str_array("tokenizer.ggml.merges", merges),
        _kv("tokenizer.ggml.token_type", ValueType.ARRAY,
            struct.pack("<IQ", ValueType.INT32, len(types)) + struct.pack(f"<{len(types)}i", *types)),
    ]
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
    return path


def _string_array(tmp_path, items: list[str], name: str = "a.gguf") -> StringArray:
    path = tmp_path / name
    kv = _str_array("a", items)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)
    return GGUFFile(path).metadata["a"]


def _synthetic(seed: int, n_merges: int = 300):
    """Byte symbols + random merged tokens (some repeated), merges in creation order."""
    rng = random.Random(seed)
    tokens = list(SPECIAL_STRINGS.values()) + list(BYTE_TO_UNICODE)
    merges = []
    seen = set(tokens)
    pool = list("abcdef") + ["Ġ", "Ã", "©"]  # byte symbols: "Ġ" is the space, "Ã©" is é
    while len(merges) < n_merges:
        a, b = rng.choice(pool), rng.choice(pool)
        if a + b in seen:
            continue
        seen.add(a + b)
        tokens.append(a + b)
        pool.append(a + b)
        merges.append(f"{a} {b}")
    tokens[300:300] = [tokens[310], tokens[8]]  # repeated strings: the first id must win
    return tokens, merges


def _first_ids(tokens: list[str]) -> dict[str, int]:
    first: dict[str, int] = {}
    for i, t in enumerate(tokens):
        first.setdefault(t, i)
    return first


@pytest.mark.parametrize("from_gguf", [False, True])
def test_vocab_lookups(tmp_path, from_gguf):
    tokens, _ = _synthetic(1)
    v = Vocab.from_strings(_string_array(tmp_path, tokens) if from_gguf else tokens)
    first = _first_ids(tokens)
    assert len(v) == len(tokens) and list(v) == tokens and v[-1] == tokens[-1] and v[3:6] == tokens[3:6]
    assert all(v.id_of(t) == first[t] for t in tokens)
    assert v.id_of("not there") is None and v.id_of("") is None and v.id_of("\ud800") is None
    assert tokens[310] in v and "not there" not in v and 3 not in v
    queries = [t.encode() for t in tokens] + [b"nope", b"", "中中中中".encode()]
    assert v.ids_of_utf8(queries) == [first.get(q.decode()) for q in queries]
    assert v.ids_of_utf8([]) == []
    with pytest.raises(IndexError):
        v[len(tokens)]


def test_vocab_is_exact_when_hashes_collide(monkeypatch):
    """Every token of one length shares one hash: candidates are told apart by their bytes."""
    monkeypatch.setattr(vocab_module, "hash", lambda raw: len(raw) * 0x9E3779B97F4A7C15 % 2**63, raising=False)
    tokens, _ = _synthetic(2)
    v = Vocab.from_strings(tokens)
    first = _first_ids(tokens)
    assert all(v.id_of(t) == first[t] for t in tokens)
    queries = [t.encode() for t in tokens] + [b"zz", b"zzz", "é".encode() * 3]
    assert v.ids_of_utf8(queries) == [first.get(q.decode()) for q in queries]


def test_vocab_rejects_non_strings_and_lone_surrogates():
    with pytest.raises(TokenizerError, match="token 1 is a int"):
        Vocab.from_strings(["a", 1])
    with pytest.raises(TokenizerError, match="token 0 .* has no UTF-8 form"):
        Vocab.from_strings(["\udc80"])


def test_merge_table_from_gguf_equals_list_path(tmp_path):
    for seed in range(4):
        tokens, merges = _synthetic(seed)
        merges = merges + merges[:5]  # repeated pairs keep their last rank
        v = Vocab.from_strings(tokens)
        from_list = BPE(_first_ids(tokens), merges)
        from_array = BPE.from_vocab(v, _string_array(tmp_path, merges, f"m{seed}.gguf"))
        from_pairs = BPE.from_vocab(v, [m.split(" ") for m in merges])
        assert from_array._merges == from_list._merges == from_pairs._merges
        assert from_array._char_id == from_list._char_id
        # the reference walk: last rank of each pair, packed as (rank, merged id)
        first = _first_ids(tokens)
        want = {}
        for rank, m in enumerate(merges):
            a, b = m.split(" ")
            want[(first[a] << ID_BITS) | first[b]] = (rank << ID_BITS) | first[a + b]
        assert from_array._merges == want


@pytest.mark.parametrize("bad, needle", [
    ("a  b", "is not two tokens separated by one space"),
    (" ab", "is not two tokens separated by one space"),
    ("ab ", "is not two tokens separated by one space"),
    ("ab", "is not two tokens separated by one space"),
    ("a b c", "is not two tokens separated by one space"),
    ("a zz", "token 'zz' is not in the vocabulary"),
    ("zz a", "token 'zz' is not in the vocabulary"),
    ("b a", "token 'ba' is not in the vocabulary"),
])
def test_bad_merge_reported_alike_from_gguf_and_lists(tmp_path, bad, needle):
    tokens = list(SPECIAL_STRINGS.values()) + list(BYTE_TO_UNICODE) + ["ab"]
    merges = ["a b"] * 5000 + [bad] + ["a b"]  # past the first run of merges
    v = Vocab.from_strings(tokens)
    with pytest.raises(TokenizerError) as from_list:
        BPE(_first_ids(tokens), merges)
    with pytest.raises(TokenizerError) as from_array:
        BPE.from_vocab(v, _string_array(tmp_path, merges))
    assert str(from_array.value) == str(from_list.value)
    assert f"merge #5000 {bad!r}" in str(from_array.value) and needle in str(from_array.value)


def test_tokenizer_from_gguf_equals_from_lists(tmp_path):
    tokens, merges = _synthetic(7, n_merges=500)
    path = _write_gguf(tmp_path / "tok.gguf", tokens, merges)
    with GGUFFile(path) as f:
        g = Tokenizer.from_gguf(f)
        assert isinstance(f.metadata["tokenizer.ggml.tokens"], StringArray)
    ref = Tokenizer(tokens, merges, pre_patterns=g._pre.patterns)
    assert g.vocab_size == len(tokens) and g._bpe._merges == ref._bpe._merges
    assert all(g.piece(i) == tokens[i] for i in range(len(tokens)))
    assert g.token_to_id(tokens[310]) == ref.token_to_id(tokens[310]) == _first_ids(tokens)[tokens[310]]
    rng = random.Random(3)
    for _ in range(200):
        text = "".join(rng.choice("abcdef éé中 Ġ\n<think>") for _ in range(rng.randrange(0, 40)))
        assert g.encode(text) == ref.encode(text), text
        assert g.encode_rendered(text) == ref.encode_rendered(text), text
    # the tokenizer keeps its own copy: it outlives the file
    g2 = Tokenizer.from_gguf(path)
    assert g2.encode("abcdef") == ref.encode("abcdef") and g2.piece(300) == tokens[300]
