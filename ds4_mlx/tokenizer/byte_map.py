"""GPT-2 byte-level alphabet: every byte 0..255 gets a printable code point so BPE works on text.

Bytes that are already visible Latin-1 characters (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for
themselves; the remaining 68 bytes (controls, space, DEL, NBSP, soft hyphen, ...) are assigned
U+0100, U+0101, ... in increasing byte order. Vocabulary strings are written in this alphabet.
"""

from __future__ import annotations


def _visible(b: int) -> bool:
    return 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF


def _build() -> list[str]:
    table = [""] * 256
    extra = 0
    for b in range(256):
        if _visible(b):
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE: tuple[str, ...] = tuple(_build())
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_UNICODE)}

# str.translate tables. Encoding goes through Latin-1 (byte b <-> code point b), so one C-level
# translate maps a whole piece. Decoding maps the alphabet back to Latin-1 code points; the code
# points below 256 that are *not* in the alphabet (space, controls, ...) must be dropped, not passed
# through as if they were bytes, hence the explicit None entries.
_ENCODE_TABLE = {b: BYTE_TO_UNICODE[b] for b in range(256)}
_DECODE_TABLE: dict[int, int | None] = {cp: None for cp in range(256)}
_DECODE_TABLE.update({ord(c): b for c, b in UNICODE_TO_BYTE.items()})


def bytes_to_unicode(data: bytes) -> str:
    """Byte string -> its byte-level alphabet string (one code point per byte)."""
    return data.decode("latin-1").translate(_ENCODE_TABLE)


def text_to_unicode(text: str) -> str:
    """UTF-8 bytes of ``text`` in the byte-level alphabet (what BPE merges operate on)."""
    return text.encode("utf-8").decode("latin-1").translate(_ENCODE_TABLE)


def unicode_to_bytes(s: str) -> bytes:
    """Inverse map; code points outside the alphabet are dropped (as ds4_token_text does)."""
    mapped = s.translate(_DECODE_TABLE)
    try:
        return mapped.encode("latin-1")
    except UnicodeEncodeError:  # a code point >= 256 outside the alphabet: rare, take the slow path
        return bytes(UNICODE_TO_BYTE[c] for c in s if c in UNICODE_TO_BYTE)
