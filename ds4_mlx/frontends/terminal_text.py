"""Text from files, made safe and short for a terminal: shared by ``inspect`` and ``kv``.

File content (GGUF keys and strings, a KV cache file's key text) is untrusted: printed raw, control
characters and bidi overrides would drive the terminal. ``escape_text`` writes every unprintable
character as an escape, so what is shown is what the file holds.
"""

from __future__ import annotations


def escape_text(text: str) -> str:
    """Printable characters as is; backslash, control characters, bidi overrides and every other
    unprintable character as escapes; a byte that was not valid UTF-8 (decoded with
    ``surrogateescape``) as ``\\xNN``."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1])
    return "".join(out)


def human_size(n: int) -> str:
    """Bytes in binary units, two decimals (``1.50 GiB``)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
