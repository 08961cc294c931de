"""Streaming UTF-8 decoding of token ids: whole characters only, U+FFFD for bad or cut-off bytes."""

from __future__ import annotations

import random

import pytest

from ds4_mlx.tokenizer import Tokenizer, Utf8StreamDecoder
from ds4_mlx.tokenizer.byte_map import BYTE_TO_UNICODE


@pytest.fixture(scope="module")
def tok(tokenizer_json_path) -> Tokenizer:
    return Tokenizer.from_tokenizer_json(tokenizer_json_path)


def is_whole(s: str) -> bool:
    """No lone surrogates, i.e. every emitted unit is a complete code point."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@pytest.mark.parametrize("text", ["👨‍👩‍👧‍👦🇮🇹👍🏿", "東京は日本の首都です", "한국어", "ciao👋🏽mondo", "a\u0301é€𝄞"])
def test_tokens_split_code_points_but_stream_does_not(tok, text):
    ids = tok.encode(text)
    parts = [tok.token_text(i) for i in ids]
    # the case is meaningful only if some token really ends inside a character
    split = any(_incomplete_tail(b"".join(parts[: k + 1])) for k in range(len(parts)))
    if text in ("👨‍👩‍👧‍👦🇮🇹👍🏿", "ciao👋🏽mondo"):
        assert split, "expected at least one token to end inside a code point"
    dec = Utf8StreamDecoder(tok)
    outs = []
    for i in ids:
        out = dec.feed(i)
        assert is_whole(out) and "\ufffd" not in out
        outs.append(out)
    outs.append(dec.flush())
    assert "".join(outs) == text
    # each output ends exactly where the bytes so far end on a character boundary
    so_far = b""
    emitted = ""
    for i, out in zip(ids, outs):
        so_far += tok.token_text(i)
        emitted += out
        complete = so_far[: len(so_far) - _incomplete_tail(so_far)]
        assert emitted == complete.decode("utf-8")


def _incomplete_tail(data: bytes) -> int:
    """How many trailing bytes form an unfinished (but so far valid) UTF-8 sequence."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 != 0x80:  # lead byte or ASCII
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 0
            return back if need > back else 0
    return 0


def test_bytes_level_behaviour():
    class Raw:  # token i is the single byte i
        def token_text(self, i: int) -> bytes:
            return bytes([i])

    dec = Utf8StreamDecoder(Raw())
    e = "€".encode()  # 3 bytes
    assert dec.feed(e[0]) == "" and dec.pending == e[:1]
    assert dec.feed(e[1]) == "" and dec.pending == e[:2]
    assert dec.feed(e[2]) == "€" and dec.pending == b""
    # invalid byte: replaced at once
    assert dec.feed(0xFF) == "\ufffd"
    # a lead byte followed by ASCII: the broken sequence becomes one U+FFFD, the ASCII survives
    assert dec.feed(0xE2) == ""
    assert dec.feed(ord("a")) == "\ufffda"
    # truncated at end of stream: U+FFFD on flush, then the decoder is reusable
    assert dec.feed(0xF0) == "" and dec.feed(0x9F) == ""
    assert dec.flush() == "\ufffd"
    assert dec.flush() == ""
    assert dec.feed(ord("z")) == "z"
    dec.feed(0xC3)
    dec.reset()
    assert dec.pending == b"" and dec.feed(ord("y")) == "y"


def test_stream_equals_decode_on_random_ids(tok):
    """Any id sequence (also nonsense byte mixes) streams to exactly ``decode`` of the whole."""
    rng = random.Random(17)
    byte_tokens = [tok.token_to_id(c) for c in BYTE_TO_UNICODE]  # the 256 single-byte tokens
    for _ in range(200):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.6 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 40))]
        dec = Utf8StreamDecoder(tok)
        out = "".join(dec.feed(i) for i in ids) + dec.flush()
        assert out == tok.decode(ids)
        assert is_whole(out)


def test_feed_many(tok):
    ids = tok.encode("Caffè ☕ e 🍰")
    dec = Utf8StreamDecoder(tok)
    assert dec.feed_many(ids) + dec.flush() == "Caffè ☕ e 🍰"
