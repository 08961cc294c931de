"""DSML tool calls: canonical rendering for prompts and one-shot parsing of generated text.

Mirrors ds4-server [append_dsml_tool_calls_text, parse_generated_message_ex,
parse_generated_message_for_response].  Everything works on ``str``; ds4 works on UTF-8 bytes, which
is the same thing for valid UTF-8 because every delimiter is ASCII or a whole ``｜`` character.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ds4_mlx.chat import json_text
from ds4_mlx.chat.messages import ParsedMessage, ToolCall
from ds4_mlx.chat.pieces import Piece, ctl, join, txt
from ds4_mlx.errors import ChatError

DSML = "｜DSML｜"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class DsmlSyntax:
    """One spelling of the tool-call markup; a block uses one spelling throughout."""

    tool_calls_start: str
    tool_calls_end: str
    invoke_start: str  # no '>' : attributes follow
    invoke_end: str
    param_start: str
    param_end: str


def _syntax(prefix: str) -> DsmlSyntax:
    return DsmlSyntax(
        f"<{prefix}tool_calls>", f"</{prefix}tool_calls>",
        f"<{prefix}invoke", f"</{prefix}invoke>",
        f"<{prefix}parameter", f"</{prefix}parameter>",
    )


FULL = _syntax(DSML)
SHORT = _syntax("DSML｜")  # the model sometimes drops the first bar
PLAIN = _syntax("")
SYNTAXES = (FULL, SHORT, PLAIN)

_ENTITIES = {"&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&apos;": "'"}
_ENTITY_RE = re.compile("|".join(re.escape(e) for e in _ENTITIES))


# --------------------------------------------------------------------------------------------
# Escaping


def escape_attr(s: str) -> str:
    """Attribute values (tool and parameter names) [append_dsml_attr_escaped]."""
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def escape_string_body(s: str) -> str:
    """String parameter bodies stay raw except for the exact closing tag [append_dsml_parameter_text].

    Occurrences cannot overlap (the tag holds a single '<'), so a plain replace is exact."""
    return s.replace(FULL.param_end, "&lt;" + FULL.param_end[1:])


def escape_json_body(s: str) -> str:
    """Inside JSON bodies the closing tag can only occur in a string, where ``\\u003c`` is '<'
    [append_dsml_json_literal]."""
    return s.replace(FULL.param_end, "\\u003c" + FULL.param_end[1:])


def unescape(s: str) -> str:
    """Undo the five XML entities ds4 recognises; any other '&' is literal [dsml_unescape_text]."""
    return _ENTITY_RE.sub(lambda m: _ENTITIES[m.group(0)], s)


def attr(tag: str, name: str) -> str | None:
    """Value of ``name="..."`` anywhere in ``tag`` (first occurrence, no tokenising) [dsml_attr]."""
    pat = name + '="'
    k = tag.find(pat)
    if k < 0:
        return None
    start = k + len(pat)
    q = tag.find('"', start)
    if q < 0:
        return None
    return unescape(tag[start:q])


# --------------------------------------------------------------------------------------------
# Rendering


def _call_fields(call: ToolCall | Mapping) -> tuple[str, str] | None:
    """(name, arguments text) of a request tool call, or None when ds4 would drop it."""
    if isinstance(call, ToolCall):
        return call.name, call.arguments
    if not isinstance(call, Mapping):
        raise ChatError(f"tool call must be an object, got {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping):
        raise ChatError(f"tool call 'function' must be an object, got {type(fn).__name__}")
    if "name" not in fn or "arguments" not in fn:
        return None  # ds4 keeps only calls that carry both [parse_tool_calls_value]
    name = fn["name"]
    if not isinstance(name, str):
        raise ChatError(f"tool call function.name must be a string, got {type(name).__name__}")
    args = fn["arguments"]
    if not isinstance(args, str):
        # ds4 keeps a non-string value as its raw JSON text; the client's exact bytes are gone once
        # the request was decoded, so use the compact spelling.
        args = json_dumps_compact(args)
    return name, args


def json_dumps_compact(value) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def request_tool_calls(calls: Iterable | None) -> list[tuple[str, str]]:
    """(name, arguments) of the calls ds4 keeps from a request message's ``tool_calls``."""
    if calls is None:
        return []
    if isinstance(calls, (str, bytes, Mapping)):
        raise ChatError("message tool_calls must be a list")
    out = []
    for c in calls:
        f = _call_fields(c)
        if f is not None:
            out.append(f)
    return out


def _parameter_pieces(key: str, value: str, is_string: bool) -> list[Piece]:
    body = escape_string_body(value) if is_string else escape_json_body(value)
    flag = "true" if is_string else "false"
    return [ctl(f'{FULL.param_start} name="'), txt(escape_attr(key)), ctl(f'" string="{flag}">'),
            txt(body), ctl(FULL.param_end + "\n")]


def tool_call_pieces(calls: Iterable, raw_dsml: str | None = None) -> list[Piece]:
    """:func:`render_tool_calls` as typed pieces: the DSML tags are markup (their ``｜DSML｜`` is
    the control token), tool names, parameter names and values are request text (plain BPE).

    Why values need this: ds4 escapes only the closing parameter tag, and only to
    ``&lt;/｜DSML｜parameter>`` (``\\u003c…`` in JSON bodies), which still holds the ``｜DSML｜``
    string; any other marker in a value (``<｜DSML｜invoke …>``, ``</｜DSML｜tool_calls>``,
    ``</think>``) is not escaped at all.  Tokenizing the joined text would turn those into control
    tokens; here they stay text.  A ``raw_dsml`` replay is split by :func:`raw_dsml_pieces`."""
    fields = [_call_fields(c) for c in calls]
    fields = [f for f in fields if f is not None]
    if not fields:
        return []
    if raw_dsml:
        return raw_dsml_pieces(raw_dsml)
    out = [ctl("\n\n" + FULL.tool_calls_start + "\n")]
    for name, args in fields:
        out += [ctl(f'{FULL.invoke_start} name="'), txt(escape_attr(name)), ctl('">\n')]
        members = json_text.parse_members(args)
        if members is None:
            out += _parameter_pieces("arguments", args, True)
        else:
            for key, value, is_string in members:
                out += _parameter_pieces(key, value, is_string)
        out.append(ctl(FULL.invoke_end + "\n"))
    out.append(ctl(FULL.tool_calls_end))
    return out


def raw_dsml_pieces(raw: str) -> list[Piece]:
    """An exact sampled block (``ParsedMessage.raw_dsml``) as typed pieces.

    Rule: a marker is structural, hence a control token, only where the parser that extracted the
    calls from this very text (:func:`parse_block`) consumed it as a tag: the block's start and end,
    each invoke's open and close, each parameter's open and close (nested ones included).  Parameter
    bodies, attributes and the whitespace between tags are plain text: a string body ends at the
    first ``</｜DSML｜parameter>``, so it never holds that tag, and any other marker inside it
    (``<｜DSML｜invoke``, the escaped ``&lt;/｜DSML｜parameter>``) is data.  Text that is not exactly
    one full-spelling block (optionally after a blank line) is all plain text: the short and plain
    spellings hold no special string, and nothing unparsed can be trusted as structure."""
    lead = 2 if raw.startswith("\n\n") else 0
    if not raw.startswith(FULL.tool_calls_start, lead):
        return [txt(raw)]
    marks: list[tuple[int, int]] = []
    parsed = parse_block(raw, 0, FULL, marks)
    if parsed is None or parsed[1] != len(raw):
        return [txt(raw)]
    out: list[Piece] = []
    pos = 0
    for a, b in marks:
        if a > pos:
            out.append(txt(raw[pos:a]))
        out.append(ctl(raw[a:b]))
        pos = b
    if pos < len(raw):
        out.append(txt(raw[pos:]))
    return out


def render_tool_calls(calls: Iterable, raw_dsml: str | None = None) -> str:
    """Canonical DSML block for an assistant turn's tool calls [append_dsml_tool_calls_text].

    ``calls`` are :class:`ToolCall` or OpenAI-shaped dicts.  Arguments are emitted in the client's
    key order; string values raw, other values minified JSON; arguments that are not a JSON object
    become a single string parameter named ``arguments``.  When ``raw_dsml`` (the exact sampled
    block) is given and there is at least one call, it is returned unchanged, as ds4 does."""
    return join(tool_call_pieces(calls, raw_dsml))


# --------------------------------------------------------------------------------------------
# Parsing


def json_arg_member(name: str, value: str, kind: str) -> str:
    """One ``"name": value`` member of the internal arguments text [tool_call_json_args_add].

    ``kind`` is the parameter's ``string`` attribute (default "true"); anything but "true" means a
    JSON body, minified, with an empty body becoming ``null``."""
    if kind == "true":
        return json_text.escape(name) + ": " + json_text.escape(value)
    mini = json_text.minify(value)
    return json_text.escape(name) + ": " + (mini if mini else "null")


def param_value_member(name: str, raw_body: str, kind: str | None) -> str:
    kind = "true" if kind is None else kind
    value = unescape(raw_body) if kind == "true" else raw_body
    return json_arg_member(name, value, kind)


def client_arguments(members: list[str]) -> str:
    """Arguments as sent to clients: ds4 wraps the members, then re-serialises compactly."""
    return json_text.object_or_empty("{" + ", ".join(members) + "}")


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) split at the first ``</think>`` [split_reasoning_content].

    A leading ``<think>`` is dropped from the reasoning; without ``</think>`` there is no reasoning
    and the text (leading tag included) is all content."""
    body = text[len(THINK_OPEN):] if text.startswith(THINK_OPEN) else text
    k = body.find(THINK_CLOSE)
    if k < 0:
        return None, text
    return body[:k], body[k + len(THINK_CLOSE):]


def find_block_start(text: str, start: int = 0) -> tuple[int, DsmlSyntax] | None:
    """Where the tool-call block begins, in ds4's preference order: full DSML preceded by a blank
    line, full DSML, then the same for the short and plain spellings.  The returned index includes
    the blank line when one was matched."""
    for syn in SYNTAXES:
        for lead in ("\n\n", ""):
            k = text.find(lead + syn.tool_calls_start, start)
            if k >= 0:
                return k, syn
    return None


def _mark(marks: list[tuple[int, int]] | None, start: int, marker: str) -> None:
    if marks is not None:
        marks.append((start, start + len(marker)))


def parse_nested_object(text: str, p: int, syn: DsmlSyntax,
                        marks: list[tuple[int, int]] | None = None) -> tuple[str, int] | None:
    """A parameter without ``string=`` whose body is more parameters: the model drifted into nested
    XML; ds4 turns the children into a JSON object [dsml_parse_nested_params_object].

    Returns the object text and the index where the children stop (the caller skips an optional
    closing tag of the outer parameter)."""
    members: list[str] = []
    while True:
        p = json_text.skip_ws(text, p)
        if not text.startswith(syn.param_start, p):
            break
        gt = text.find(">", p)
        if gt < 0:
            return None
        tag = text[p : gt + 1]
        name = attr(tag, "name")
        if name is None:
            return None
        end = text.find(syn.param_end, gt + 1)
        if end < 0:
            return None
        members.append(param_value_member(name, text[gt + 1 : end], attr(tag, "string")))
        _mark(marks, p, syn.param_start)
        _mark(marks, end, syn.param_end)
        p = end + len(syn.param_end)
    if not members:
        return None
    return "{" + ", ".join(members) + "}", p


def parse_block(text: str, p: int, syn: DsmlSyntax,
                marks: list[tuple[int, int]] | None = None) -> tuple[list[ToolCall], int] | None:
    """Parse the block whose start marker begins at ``p``; (calls, index after the end marker).

    ``marks``, when given, receives the (start, end) of every tag marker consumed, in text order
    (what :func:`raw_dsml_pieces` treats as structure)."""
    p = text.find(syn.tool_calls_start, p)
    _mark(marks, p, syn.tool_calls_start)
    p += len(syn.tool_calls_start)
    calls: list[ToolCall] = []
    while True:
        p = json_text.skip_ws(text, p)
        if text.startswith(syn.tool_calls_end, p):
            _mark(marks, p, syn.tool_calls_end)
            return calls, p + len(syn.tool_calls_end)
        if not text.startswith(syn.invoke_start, p):
            return None
        gt = text.find(">", p)
        if gt < 0:
            return None
        name = attr(text[p : gt + 1], "name")
        if name is None:
            return None
        _mark(marks, p, syn.invoke_start)
        p = gt + 1
        members: list[str] = []
        while True:
            p = json_text.skip_ws(text, p)
            if text.startswith(syn.invoke_end, p):
                _mark(marks, p, syn.invoke_end)
                p += len(syn.invoke_end)
                break
            if not text.startswith(syn.param_start, p):
                return None
            gt = text.find(">", p)
            if gt < 0:
                return None
            tag = text[p : gt + 1]
            pname = attr(tag, "name")
            if pname is None:
                return None
            kind = attr(tag, "string")
            body = gt + 1
            _mark(marks, p, syn.param_start)
            if kind is None and text.startswith(syn.param_start, json_text.skip_ws(text, body)):
                nested = parse_nested_object(text, body, syn, marks)
                if nested is None:
                    return None
                members.append(json_arg_member(pname, nested[0], "false"))
                p = json_text.skip_ws(text, nested[1])
                if text.startswith(syn.param_end, p):
                    _mark(marks, p, syn.param_end)
                    p += len(syn.param_end)
                continue
            end = text.find(syn.param_end, body)
            if end < 0:
                return None
            members.append(param_value_member(pname, text[body:end], kind))
            _mark(marks, end, syn.param_end)
            p = end + len(syn.param_end)
        calls.append(ToolCall(name=name, arguments=client_arguments(members)))


def parse_message(text: str, thinking: bool) -> ParsedMessage:
    """Split one generated assistant turn into reasoning, content and tool calls, as ds4-server
    does before answering [parse_generated_message_for_response].

    In thinking mode a tool-call block counts only after the last ``</think>`` (DSML quoted in the
    reasoning is not an action).  Whitespace between the content and the block is separator, not
    content.  Text after the block is ignored.  A block that starts but does not parse yields
    ``ok=False`` and the whole text as content."""
    search_from = 0
    if thinking:
        k = text.rfind(THINK_CLOSE)
        if k < 0:
            reasoning, content = split_reasoning(text)
            return ParsedMessage(reasoning, content)
        search_from = k + len(THINK_CLOSE)
    found = find_block_start(text, search_from)
    if found is None:
        reasoning, content = split_reasoning(text)
        return ParsedMessage(reasoning, content)
    start, syn = found
    parsed = parse_block(text, start, syn)
    if parsed is None:
        return ParsedMessage(None, text, (), None, ok=False)
    calls, end = parsed
    reasoning, content = split_reasoning(text[: json_text.rstrip_ws(text, 0, start)])
    return ParsedMessage(reasoning, content, tuple(calls), text[start:end])


@dataclass(frozen=True)
class TurnOutcome:
    """Final message, finish reason and error text of a generated chat turn."""

    message: ParsedMessage
    finish: str
    error: str | None = None


def finish_turn(text: str, *, thinking: bool, has_tools: bool, finish: str,
                saw_tool_start: bool, saw_tool_end: bool) -> TurnOutcome:
    """ds4-server's end-of-generation rules for a chat turn.

    ``finish`` is the decode loop's reason ("stop", "length", "tool_calls", "error").  A tool block
    that was entered but never closed fails the turn ("unterminated tool call": a partly streamed
    call cannot be retracted).  A closed but malformed block is returned as plain assistant text
    with finish "stop" (or "length" if that was the cause) so the client can recover.  Parsed calls
    set finish "tool_calls"."""
    error = None
    if has_tools and saw_tool_start and not saw_tool_end and finish != "error":
        finish, error = "error", "unterminated tool call"
    msg = parse_message(text, thinking)
    if not msg.ok:
        if has_tools and saw_tool_start and finish != "error":
            finish = "length" if finish == "length" else "stop"
            error = "invalid tool call"
    elif msg.tool_calls:
        finish, error = "tool_calls", None
    return TurnOutcome(msg, finish, error)
