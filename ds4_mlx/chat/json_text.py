"""ds4's lenient JSON text scanner, reproduced so rendered prompts match ds4 byte for byte.

ds4-server never builds a JSON tree: it walks the request text and copies raw slices into the
prompt (tool schemas, non-string tool arguments), minifying some of them.  Python's ``json`` module
would normalise numbers (``1.50`` -> ``1.5``) and escapes, changing the prompt bytes and hence the
KV-cache keys, so the few operations the chat layer needs are re-implemented here on ``str``:

* whitespace is the C-locale ``isspace`` set (space, \\t, \\n, \\v, \\f, \\r) only;
* numbers are whatever C ``strtod`` accepts (so ``+1``, ``0x1p3``, ``inf``, ``nan`` pass);
* ``true``/``false``/``null`` are matched as prefixes;
* object member lists used for arguments accept a missing comma between members.

Every function returns ``None`` (never raises) on malformed input, mirroring ds4's boolean
returns; callers decide whether that is an error or a fallback.
"""

from __future__ import annotations

import re

WS = " \t\n\v\f\r"
MAX_NESTING = 256  # ds4 refuses deeper values rather than recursing without bound

_STRTOD = re.compile(
    r"[+-]?(?:"
    r"0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?"
    r"|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?"
    r"|[nN][aA][nN](?:\([0-9A-Za-z_]*\))?"
    r")"
)
_HEX = "0123456789abcdefABCDEF"
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in WS:
        i += 1
    return i


def rstrip_ws(s: str, start: int, limit: int) -> int:
    """Index just after the last non-whitespace char of s[start:limit] (start if none)."""
    while limit > start and s[limit - 1] in WS:
        limit -= 1
    return limit


def _u16(s: str, i: int) -> int | None:
    if s[i : i + 2] != "\\u" or len(s) < i + 6:
        return None
    digits = s[i + 2 : i + 6]
    if any(c not in _HEX for c in digits):
        return None
    return int(digits, 16)


def scan_string(s: str, i: int) -> tuple[str, int] | None:
    """Decode the JSON string at s[i:] (leading whitespace allowed): (value, index after it)."""
    i = skip_ws(s, i)
    n = len(s)
    if i >= n or s[i] != '"':
        return None
    i += 1
    out: list[str] = []
    while i < n and s[i] != '"':
        c = s[i]
        i += 1
        if c != "\\":
            out.append(c)
            continue
        if i >= n:
            return None
        c = s[i]
        i += 1
        if c in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[c])
        elif c == "u":
            i -= 2
            cp = _u16(s, i)
            if cp is None:
                return None
            i += 6
            if 0xD800 <= cp <= 0xDBFF:
                lo = _u16(s, i)
                if lo is not None:
                    # ds4 consumes the second escape even when it is not a low surrogate, and then
                    # drops it; the high surrogate is emitted alone.
                    i += 6
                    if 0xDC00 <= lo <= 0xDFFF:
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)
            out.append(chr(cp))
        else:
            return None
    if i >= n:
        return None
    return "".join(out), i + 1


def _scan_number(s: str, i: int) -> int | None:
    m = _STRTOD.match(s, i)
    return m.end() if m else None


def skip_value(s: str, i: int, depth: int = 0) -> int | None:
    """Index just after the JSON value at s[i:] (leading whitespace allowed), or None."""
    i = skip_ws(s, i)
    if i < len(s):
        c = s[i]
        if c == '"':
            r = scan_string(s, i)
            return None if r is None else r[1]
        if c == "{":
            return _skip_object(s, i, depth)
        if c == "[":
            return _skip_array(s, i, depth)
    for lit in ("true", "false", "null"):
        if s.startswith(lit, i):
            return i + len(lit)
    return _scan_number(s, i)


def _skip_array(s: str, i: int, depth: int) -> int | None:
    if depth >= MAX_NESTING:
        return None
    i = skip_ws(s, i) + 1
    i = skip_ws(s, i)
    if i < len(s) and s[i] == "]":
        return i + 1
    while True:
        j = skip_value(s, i, depth + 1)
        if j is None:
            return None
        j = skip_ws(s, j)
        if j < len(s) and s[j] == "]":
            return j + 1
        if j >= len(s) or s[j] != ",":
            return None
        i = j + 1


def _skip_object(s: str, i: int, depth: int) -> int | None:
    if depth >= MAX_NESTING:
        return None
    i = skip_ws(s, i) + 1
    i = skip_ws(s, i)
    if i < len(s) and s[i] == "}":
        return i + 1
    while True:
        r = scan_string(s, i)
        if r is None:
            return None
        j = skip_ws(s, r[1])
        if j >= len(s) or s[j] != ":":
            return None
        j = skip_value(s, j + 1, depth + 1)
        if j is None:
            return None
        j = skip_ws(s, j)
        if j < len(s) and s[j] == "}":
            return j + 1
        if j >= len(s) or s[j] != ",":
            return None
        i = j + 1


def raw_value(s: str, i: int) -> tuple[str, int] | None:
    """The exact text of the JSON value at s[i:] (without leading whitespace) and its end."""
    i = skip_ws(s, i)
    j = skip_value(s, i)
    if j is None:
        return None
    return s[i:j], j


def minify(text: str) -> str:
    """ds4's ``json_minify_raw_value``: first JSON value of ``text`` without whitespace outside
    strings (string bodies, escapes included, are copied unchanged).  Text that does not start with
    a JSON value is returned unchanged; anything after the first value is dropped."""
    i = skip_ws(text, 0)
    j = skip_value(text, i)
    if j is None:
        return text
    out: list[str] = []
    in_string = False
    escaped = False
    for c in text[i:j]:
        if in_string:
            out.append(c)
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
            out.append(c)
        elif c not in WS:
            out.append(c)
    return "".join(out)


def escape_fragment(s: str) -> str:
    """JSON string escaping as ds4 does it: only ``"``, ``\\`` and control chars; non-ASCII raw."""
    out: list[str] = []
    for c in s:
        if c == '"' or c == "\\":
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\r":
            out.append("\\r")
        elif c == "\t":
            out.append("\\t")
        elif ord(c) < 0x20:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return "".join(out)


def escape(s: str) -> str:
    return '"' + escape_fragment(s) + '"'


def parse_members(text: str) -> list[tuple[str, str, bool]] | None:
    """ds4's ``json_args_parse``: the members of a JSON object as (key, value, is_string).

    String values are decoded; other values are minified raw text.  Duplicate keys are kept in
    order; commas between members are optional; text after the closing brace is ignored."""
    i = skip_ws(text, 0)
    n = len(text)
    if i >= n or text[i] != "{":
        return None
    i = skip_ws(text, i + 1)
    members: list[tuple[str, str, bool]] = []
    while i < n and text[i] != "}":
        r = scan_string(text, i)
        if r is None:
            return None
        key, i = r
        i = skip_ws(text, i)
        if i >= n or text[i] != ":":
            return None
        i = skip_ws(text, i + 1)
        if i < n and text[i] == '"':
            r = scan_string(text, i)
            if r is None:
                return None
            members.append((key, r[0], True))
            i = r[1]
        else:
            rv = raw_value(text, i)
            if rv is None:
                return None
            members.append((key, minify(rv[0]), False))
            i = rv[1]
        i = skip_ws(text, i)
        if i < n and text[i] == ",":
            i += 1
        i = skip_ws(text, i)
    if i >= n:
        return None
    return members


def object_or_empty(text: str) -> str:
    """ds4's ``append_json_object_or_empty``: compact re-serialisation of an arguments object, or
    ``{}`` when it does not parse (what clients receive as ``function.arguments``)."""
    members = parse_members(text)
    if members is None:
        return "{}"
    parts = [escape(k) + ":" + (escape(v) if is_str else v) for k, v, is_str in members]
    return "{" + ",".join(parts) + "}"


def object_members_raw(text: str) -> tuple[list[tuple[str, str]], bool]:
    """Members of the object ``text`` as (key, raw value text), in order, and whether a member
    failed to scan.  On failure the members read before it are still returned, so callers can
    reproduce ds4 functions that act on an early member and only later hit bad input.  Reaching the
    end of the text without a closing brace is not a failure (ds4's loops stop there too)."""
    members: list[tuple[str, str]] = []
    i = skip_ws(text, 0)
    n = len(text)
    if i >= n or text[i] != "{":
        return members, True
    i = skip_ws(text, i + 1)
    while i < n and text[i] != "}":
        r = scan_string(text, i)
        if r is None:
            return members, True
        key, i = r
        i = skip_ws(text, i)
        if i >= n or text[i] != ":":
            return members, True
        rv = raw_value(text, i + 1)
        if rv is None:
            return members, True
        members.append((key, rv[0]))
        i = skip_ws(text, rv[1])
        if i < n and text[i] == ",":
            i += 1
        i = skip_ws(text, i)
    return members, False


def array_items_raw(text: str) -> tuple[list[str], bool]:
    """Raw text of each element of the JSON array ``text`` (commas optional, as in ds4), and
    whether the whole array scanned up to its closing bracket.  On failure the elements read before
    it are still returned."""
    i = skip_ws(text, 0)
    n = len(text)
    if i >= n or text[i] != "[":
        return [], False
    i = skip_ws(text, i + 1)
    items: list[str] = []
    while i < n and text[i] != "]":
        rv = raw_value(text, i)
        if rv is None:
            return items, False
        items.append(rv[0])
        i = skip_ws(text, rv[1])
        if i < n and text[i] == ",":
            i += 1
        i = skip_ws(text, i)
    return items, i < n
