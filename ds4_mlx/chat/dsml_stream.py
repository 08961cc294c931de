"""Incremental parsing of generated assistant text for streaming APIs.

Three small state machines, fed the same generated text:

* :class:`DsmlDecodeTracker` - ds4-server's sampling guard: where the next token falls inside a
  DSML block (markup, string payload, JSON payload) [dsml_decode_tracker_update].  The server
  samples at temperature 0 while in markup, so tool syntax stays well formed.
* :class:`ToolMarkerScanner` - ds4-server's decode-loop detection of a tool block start/end,
  ignoring markers inside reasoning; a closed block ends decoding with finish "tool_calls".
* :class:`DsmlStreamParser` - turns the text into client events (reasoning, content, tool-call
  start / argument fragments / end) without ever emitting a piece of a delimiter, and at the end
  reports the authoritative :func:`~ds4_mlx.chat.dsml.parse_message` result together with whether
  the events already sent agree with it.
"""

from __future__ import annotations

import codecs
import enum
from dataclasses import dataclass
from typing import Union

from ds4_mlx.chat import json_text
from ds4_mlx.chat.dsml import (
    SYNTAXES,
    THINK_CLOSE,
    THINK_OPEN,
    DsmlSyntax,
    attr,
    client_arguments,
    json_arg_member,
    param_value_member,
    parse_message,
    unescape,
)
from ds4_mlx.chat.messages import ParsedMessage, ToolCall
from ds4_mlx.errors import ChatError

_ENTITY_NAMES = ("&amp;", "&lt;", "&gt;", "&quot;", "&apos;")
_TOOL_STARTS = tuple(s.tool_calls_start for s in SYNTAXES)
_TOOL_ENDS = tuple(s.tool_calls_end for s in SYNTAXES)
_MAX_START_CHARS = max(len(s) for s in _TOOL_STARTS)
_MARKER_WINDOW_BYTES = 80  # ds4 re-scans this many trailing bytes for markers split across tokens


def _partial_suffix_len(raw: str, start: int, lits) -> int:
    """Length of the longest tail of raw[start:] that is a proper, non-empty prefix of a literal."""
    n = len(raw)
    best = 0
    for lit in lits:
        for length in range(min(len(lit) - 1, n - start), best, -1):
            if raw.endswith(lit[:length]):
                best = length
                break
    return best


def _is_proper_prefix(rest: str, *lits: str) -> bool:
    return any(len(rest) < len(lit) and lit.startswith(rest) for lit in lits)


def _earliest(raw: str, start: int, lits) -> tuple[int, int] | None:
    """(position, index of literal) of the first occurrence of any literal at or after start."""
    best = None
    for idx, lit in enumerate(lits):
        k = raw.find(lit, start)
        if k >= 0 and (best is None or k < best[0]):
            best = (k, idx)
    return best


# --------------------------------------------------------------------------------------------
# Sampling guard


class DecodeState(enum.Enum):
    OUTSIDE = "outside"
    STRUCTURAL = "structural"
    STRING_BODY = "string_body"
    JSON_STRUCTURAL = "json_structural"
    JSON_STRING = "json_string"


class DsmlDecodeTracker:
    """Where generation stands relative to the first DSML block [dsml_decode_tracker_update].

    Deliberately forgiving (not a validator).  Like ds4 it looks at the whole generated text,
    reasoning included, and stops tracking after the first block closes.  A closing-tag prefix of
    two or more characters at the very end counts as markup, so the tag is completed greedily."""

    def __init__(self) -> None:
        self._mode = "search"
        self.state = DecodeState.OUTSIDE
        self._syn: DsmlSyntax | None = None
        self._pos = 0
        self._json_in_string = False
        self._json_escaped = False

    def in_tool_call(self) -> bool:
        return self.state is not DecodeState.OUTSIDE

    def in_structural_syntax(self) -> bool:
        """True inside markup or JSON punctuation, false inside string payloads (and outside)."""
        return self.state in (DecodeState.STRUCTURAL, DecodeState.JSON_STRUCTURAL)

    def update(self, raw: str) -> DecodeState:
        """Advance over ``raw``, the complete generated text so far (it only ever grows)."""
        n = len(raw)
        while True:
            if self._mode == "done":
                self.state = DecodeState.OUTSIDE
                return self.state
            if self._mode == "search":
                hit = _earliest(raw, self._pos, _TOOL_STARTS)
                if hit is None:
                    self._pos = max(0, n - _MAX_START_CHARS)
                    self.state = DecodeState.OUTSIDE
                    return self.state
                self._syn = SYNTAXES[hit[1]]
                self._pos = hit[0] + len(self._syn.tool_calls_start)
                self._mode = "structural"
                self.state = DecodeState.STRUCTURAL
            syn = self._syn
            assert syn is not None
            if self._mode == "string":
                end = syn.param_end
                k = raw.find(end, self._pos)
                if k >= 0:
                    self._pos = k + len(end)
                    self._mode = "structural"
                    continue
                for p in range(max(self._pos, n - len(end) + 1), n - 1):
                    if end.startswith(raw[p:]):
                        self._pos = p
                        self.state = DecodeState.STRUCTURAL
                        return self.state
                self._pos = n
                self.state = DecodeState.STRING_BODY
                return self.state
            if self._mode == "json":
                end = syn.param_end
                closed = False
                while self._pos < n:
                    if not self._json_in_string:
                        if raw.startswith(end, self._pos):
                            self._pos += len(end)
                            self._mode = "structural"
                            closed = True
                            break
                        rest = raw[self._pos:]
                        if len(rest) >= 2 and _is_proper_prefix(rest, end):
                            self.state = DecodeState.STRUCTURAL
                            return self.state
                    c = raw[self._pos]
                    self._pos += 1
                    if self._json_in_string:
                        if self._json_escaped:
                            self._json_escaped = False
                        elif c == "\\":
                            self._json_escaped = True
                        elif c == '"':
                            self._json_in_string = False
                    elif c == '"':
                        self._json_in_string = True
                if not closed:
                    self.state = (DecodeState.JSON_STRING if self._json_in_string
                                  else DecodeState.JSON_STRUCTURAL)
                    return self.state
            # structural markup
            while self._mode == "structural":
                p = json_text.skip_ws(raw, self._pos)
                self._pos = p
                if p >= n:
                    self.state = DecodeState.STRUCTURAL
                    return self.state
                if raw.startswith(syn.tool_calls_end, p):
                    self._mode = "done"
                    self._pos = p + len(syn.tool_calls_end)
                    self.state = DecodeState.OUTSIDE
                    return self.state
                if raw.startswith(syn.invoke_end, p):
                    self._pos = p + len(syn.invoke_end)
                    continue
                if raw.startswith(syn.invoke_start, p):
                    gt = raw.find(">", p)
                    if gt < 0:
                        self.state = DecodeState.STRUCTURAL
                        return self.state
                    self._pos = gt + 1
                    continue
                if raw.startswith(syn.param_start, p):
                    gt = raw.find(">", p)
                    if gt < 0:
                        self.state = DecodeState.STRUCTURAL
                        return self.state
                    is_string = attr(raw[p : gt + 1], "string") == "true"
                    self._pos = gt + 1
                    if is_string:
                        self._mode = "string"
                    else:
                        self._mode = "json"
                        self._json_in_string = False
                        self._json_escaped = False
                    break
                # Partial tags and unknown text alike: stay in markup without advancing.
                self.state = DecodeState.STRUCTURAL
                return self.state


# --------------------------------------------------------------------------------------------
# Decode-loop tool marker detection


class ThinkingState:
    """Whether the text so far leaves the model inside a ``<think>`` section [thinking_state_feed]."""

    def __init__(self, inside: bool = False) -> None:
        self.inside = inside
        self._tail = ""

    def feed(self, text: str) -> None:
        for c in text:
            self._tail = (self._tail + c)[-len(THINK_CLOSE):]
            if self._tail.endswith(THINK_OPEN):
                self.inside = True
            elif self._tail.endswith(THINK_CLOSE):
                self.inside = False


def _tail_start_for_bytes(text: str, nbytes: int) -> int:
    """Smallest index whose suffix is at most ``nbytes`` UTF-8 bytes long."""
    start = max(0, len(text) - nbytes)  # nbytes chars are at least nbytes bytes
    tail = text[start:]
    excess = len(tail.encode("utf-8", "surrogatepass")) - nbytes
    i = 0
    while excess > 0:
        excess -= len(tail[i].encode("utf-8", "surrogatepass"))
        i += 1
    return start + i


class ToolMarkerScanner:
    """ds4-server's per-token check for a tool block start and end outside reasoning.

    In thinking mode markers are ignored while inside ``<think>``; when reasoning closes, scanning
    resumes after the last ``</think>``.  An end marker with no start before it is an orphan and
    does not count.  ``prompt_text`` (the rendered prompt) sets the initial thinking state; without
    it the state is "inside" exactly when ``thinking`` is on."""

    def __init__(self, thinking: bool, prompt_text: str | None = None) -> None:
        self._gates = thinking
        self.thinking = ThinkingState(inside=thinking if prompt_text is None else False)
        if prompt_text is not None:
            self.thinking.feed(prompt_text)
        self._waiting_for_close = thinking and self.thinking.inside
        self._scan_from = 0
        self.saw_start = False
        self.saw_end = False
        self.saw_orphan_end = False

    def update(self, text: str, piece: str) -> None:
        """``text`` is the full generated text, ending with the newly generated ``piece``."""
        self.thinking.feed(piece)
        if self._gates and self.thinking.inside:
            self._waiting_for_close = True
            self._scan_from = len(text)
            return
        if self._waiting_for_close:
            k = text.rfind(THINK_CLOSE)
            self._scan_from = k + len(THINK_CLOSE) if k >= 0 else len(text)
            self._waiting_for_close = False
        scan = text[min(self._scan_from, len(text)):]
        had_start = self.saw_start
        start = _earliest(scan, 0, _TOOL_STARTS)
        if start is not None:
            self.saw_start = True
        end_from = 0 if had_start else (start[0] if start is not None else None)
        if end_from is not None and _earliest(scan, end_from, _TOOL_ENDS) is not None:
            self.saw_end = True
        elif not had_start and start is None and _earliest(scan, 0, _TOOL_ENDS) is not None:
            self.saw_orphan_end = True
        self._scan_from = max(self._scan_from, _tail_start_for_bytes(text, _MARKER_WINDOW_BYTES))


# --------------------------------------------------------------------------------------------
# Client events


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    """A fragment of the call's JSON arguments text; fragments concatenate to the final text."""

    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    call: ToolCall


@dataclass(frozen=True)
class StreamEnd:
    """The authoritative result (``parse_message`` of all the text) and whether the events sent
    before it already spell exactly that result.  When ``live_matches`` is False (malformed or
    unterminated DSML, reasoning never closed, markup after a second ``</think>``...) the client has
    seen something else and the caller must reconcile, as ds4 does per API."""

    message: ParsedMessage
    live_matches: bool


StreamEvent = Union[ReasoningDelta, ContentDelta, ToolCallStart, ToolCallArgumentsDelta,
                    ToolCallEnd, StreamEnd]


class DsmlStreamParser:
    """Incremental counterpart of :func:`~ds4_mlx.chat.dsml.parse_message`.

    Feed each generated token's text (``str`` or raw ``bytes``; bytes may split UTF-8 characters)
    with :meth:`feed`, then call :meth:`finish` once.  Text that could still turn out to be part of
    ``<think>``, ``</think>`` or a tool block start is held back, as is whitespace right before a
    possible tool block (ds4 treats it as separator, not content); held text is released as soon as
    it proves to be ordinary text, or at :meth:`finish`.

    String parameters stream as JSON-escaped fragments; JSON parameters stream minified (this is
    where the parser departs from ds4's OpenAI stream, which forwards the raw JSON body: minifying
    makes the fragments add up to the final ``arguments`` text)."""

    def __init__(self, thinking: bool, *, prompt_text: str | None = None) -> None:
        self.thinking = thinking
        self._raw = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._phase = "think_prefix" if thinking else "content"
        self._pos = 0
        self._ended = False
        self._reasoning: list[str] = []
        self._reasoning_closed = False
        self._content: list[str] = []
        self._syn: DsmlSyntax | None = None
        self._tstate = "between_invokes"
        self._calls: list[ToolCall] = []
        self._args: list[list[str]] = []
        self._call_name = ""
        self._members: list[str] = []
        self._first_param = True
        self._pname = ""
        self._pkind: str | None = None
        self._value_start = 0
        self._json_in_string = False
        self._json_escaped = False
        self._json_emitted = False
        self.tracker = DsmlDecodeTracker()
        self.markers = ToolMarkerScanner(thinking, prompt_text)

    # -- public --------------------------------------------------------------------------------

    @property
    def text(self) -> str:
        return self._raw

    def in_structural_syntax(self) -> bool:
        """True while the next token is DSML markup (ds4 samples it at temperature 0)."""
        return self.tracker.in_structural_syntax()

    @property
    def saw_tool_start(self) -> bool:
        return self.markers.saw_start

    @property
    def saw_tool_end(self) -> bool:
        return self.markers.saw_end

    def feed(self, piece: str | bytes) -> list[StreamEvent]:
        if self._ended:
            raise ChatError("DSML stream: feed() after finish()")
        if isinstance(piece, (bytes, bytearray)):
            text = self._decoder.decode(bytes(piece))
        elif isinstance(piece, str):
            text = self._decoder.decode(b"", final=True) + piece
            self._decoder.reset()
        else:
            raise ChatError(f"DSML stream: piece must be str or bytes, got {type(piece).__name__}")
        return self._append(text, final=False)

    def finish(self) -> list[StreamEvent]:
        if self._ended:
            raise ChatError("DSML stream: finish() called twice")
        events = self._append(self._decoder.decode(b"", final=True), final=True)
        self._ended = True
        message = parse_message(self._raw, self.thinking)
        events.append(StreamEnd(message, self._live_matches(message)))
        return events

    # -- internals -----------------------------------------------------------------------------

    def _append(self, text: str, final: bool) -> list[StreamEvent]:
        if text:
            # Concatenate through a sole local reference so CPython can grow the string in place;
            # appending to the attribute directly would copy the whole text on every token.
            raw = self._raw
            self._raw = ""
            raw += text
            self._raw = raw
            self.tracker.update(self._raw)
            self.markers.update(self._raw, text)
        events: list[StreamEvent] = []
        self._advance(events, final)
        return events

    def _live_matches(self, message: ParsedMessage) -> bool:
        reasoning = "".join(self._reasoning) if self._reasoning_closed else None
        if not message.ok or self._phase not in ("content", "done"):
            return False
        if reasoning != message.reasoning or "".join(self._content) != message.content:
            return False
        if tuple(self._calls) != message.tool_calls:
            return False
        return all("".join(parts) == call.arguments for parts, call in zip(self._args, self._calls))

    def _emit_reasoning(self, events: list, text: str) -> None:
        if text:
            self._reasoning.append(text)
            events.append(ReasoningDelta(text))

    def _emit_content(self, events: list, text: str) -> None:
        if text:
            self._content.append(text)
            events.append(ContentDelta(text))

    def _emit_args(self, events: list, fragment: str) -> None:
        if fragment:
            self._args[-1].append(fragment)
            events.append(ToolCallArgumentsDelta(len(self._calls), fragment))

    def _advance(self, events: list, final: bool) -> None:
        raw = self._raw
        n = len(raw)
        while True:
            phase = self._phase
            if phase == "think_prefix":
                if not final and len(raw) < len(THINK_OPEN) and THINK_OPEN.startswith(raw):
                    return
                if raw.startswith(THINK_OPEN):
                    self._pos = len(THINK_OPEN)
                self._phase = "reasoning"
            elif phase == "reasoning":
                k = raw.find(THINK_CLOSE, self._pos)
                if k >= 0:
                    self._emit_reasoning(events, raw[self._pos:k])
                    self._pos = k + len(THINK_CLOSE)
                    self._reasoning_closed = True
                    self._phase = "content"
                    continue
                limit = n if final else n - _partial_suffix_len(raw, self._pos, (THINK_CLOSE,))
                self._emit_reasoning(events, raw[self._pos:limit])
                self._pos = limit
                if final:
                    self._phase = "unclosed_reasoning"
                return
            elif phase == "content":
                hit = _earliest(raw, self._pos, _TOOL_STARTS)
                if hit is not None:
                    start, idx = hit
                    self._emit_content(events, raw[self._pos:json_text.rstrip_ws(raw, self._pos, start)])
                    self._syn = SYNTAXES[idx]
                    self._pos = start + len(self._syn.tool_calls_start)
                    self._phase = "tool"
                    continue
                if final:
                    self._emit_content(events, raw[self._pos:])
                    self._pos = n
                    return
                limit = n - _partial_suffix_len(raw, self._pos, _TOOL_STARTS)
                limit = json_text.rstrip_ws(raw, self._pos, limit)
                self._emit_content(events, raw[self._pos:limit])
                self._pos = limit
                return
            elif phase == "tool":
                step = self._tool_step(events, final)
                if step == "wait":
                    if final:
                        self._phase = "failed"
                    return
                if step == "fail":
                    self._phase = "failed"
                    return
            else:  # done, failed, unclosed_reasoning: the rest of the text is not streamed
                return

    def _tool_step(self, events: list, final: bool) -> str:
        """One step of the tool-block grammar; returns "go", "wait" (need more text) or "fail"."""
        raw = self._raw
        syn = self._syn
        assert syn is not None
        st = self._tstate
        if st in ("between_invokes", "between_params"):
            p = json_text.skip_ws(raw, self._pos)
            rest = raw[p:]
            if st == "between_invokes":
                if rest.startswith(syn.tool_calls_end):
                    self._pos = p + len(syn.tool_calls_end)
                    self._phase = "done"
                    return "go"
                if rest.startswith(syn.invoke_start):
                    gt = raw.find(">", p)
                    if gt < 0:
                        return "wait"
                    name = attr(raw[p : gt + 1], "name")
                    if name is None:
                        return "fail"
                    events.append(ToolCallStart(len(self._calls), name))
                    self._args.append([])
                    self._call_name, self._members, self._first_param = name, [], True
                    self._emit_args(events, "{")
                    self._pos = gt + 1
                    self._tstate = "between_params"
                    return "go"
                return "wait" if _is_proper_prefix(rest, syn.tool_calls_end, syn.invoke_start) else "fail"
            if rest.startswith(syn.invoke_end):
                self._emit_args(events, "}")
                call = ToolCall(self._call_name, client_arguments(self._members))
                events.append(ToolCallEnd(len(self._calls), call))
                self._calls.append(call)
                self._pos = p + len(syn.invoke_end)
                self._tstate = "between_invokes"
                return "go"
            if rest.startswith(syn.param_start):
                gt = raw.find(">", p)
                if gt < 0:
                    return "wait"
                tag = raw[p : gt + 1]
                name = attr(tag, "name")
                if name is None:
                    return "fail"
                self._pname, self._pkind = name, attr(tag, "string")
                self._pos = self._value_start = gt + 1
                if self._pkind is None:
                    self._tstate = "untyped"
                else:
                    self._begin_value(events)
                return "go"
            return "wait" if _is_proper_prefix(rest, syn.invoke_end, syn.param_start) else "fail"
        if st == "untyped":
            p = json_text.skip_ws(raw, self._value_start)
            rest = raw[p:]
            if rest.startswith(syn.param_start):
                self._tstate = "nested"
                return "go"
            if not final and _is_proper_prefix(rest, syn.param_start):
                return "wait"
            self._begin_value(events)
            return "go"
        if st == "nested":
            return self._nested_step(events, final)
        return self._value_step(events, final)

    def _param_prefix(self, events: list, is_string: bool) -> None:
        sep = "" if self._first_param else ","
        self._first_param = False
        self._emit_args(events, sep + json_text.escape(self._pname) + ":" + ('"' if is_string else ""))

    def _begin_value(self, events: list) -> None:
        self._param_prefix(events, self._pkind in (None, "true"))
        self._json_in_string = self._json_escaped = self._json_emitted = False
        self._tstate = "value"

    def _value_step(self, events: list, final: bool) -> str:
        raw = self._raw
        syn = self._syn
        assert syn is not None
        is_string = self._pkind in (None, "true")
        k = raw.find(syn.param_end, self._pos)
        if k < 0:
            if final:
                return "wait"
            limit = len(raw) - _partial_suffix_len(raw, self._pos, (syn.param_end,))
            if is_string:
                limit = self._entity_safe_limit(limit)
            self._emit_value(events, raw[self._pos:limit], is_string)
            self._pos = limit
            return "wait"
        self._emit_value(events, raw[self._pos:k], is_string)
        if is_string:
            self._emit_args(events, '"')
        elif not self._json_emitted:
            self._emit_args(events, "null")
        self._members.append(param_value_member(self._pname, raw[self._value_start:k], self._pkind))
        self._pos = k + len(syn.param_end)
        self._tstate = "between_params"
        return "go"

    def _entity_safe_limit(self, limit: int) -> int:
        """Hold a trailing '&...' that may still become an entity [dsml_entity_stream_safe_len]."""
        raw = self._raw
        amp = raw.rfind("&", max(self._pos, limit - 6), limit)
        if amp >= 0:
            tail = raw[amp:limit]
            if any(len(tail) < len(e) and e.startswith(tail) for e in _ENTITY_NAMES):
                return amp
        return limit

    def _emit_value(self, events: list, chunk: str, is_string: bool) -> None:
        if not chunk:
            return
        if is_string:
            self._emit_args(events, json_text.escape_fragment(unescape(chunk)))
            return
        out = []
        for c in chunk:
            if self._json_in_string:
                out.append(c)
                if self._json_escaped:
                    self._json_escaped = False
                elif c == "\\":
                    self._json_escaped = True
                elif c == '"':
                    self._json_in_string = False
            elif c == '"':
                self._json_in_string = True
                out.append(c)
            elif c not in json_text.WS:
                out.append(c)
        if out:
            self._json_emitted = True
            self._emit_args(events, "".join(out))

    def _nested_step(self, events: list, final: bool) -> str:
        """Children of an untyped parameter, emitted as one JSON object once all are complete."""
        raw = self._raw
        syn = self._syn
        assert syn is not None
        p = self._value_start
        members: list[str] = []
        while True:
            p = json_text.skip_ws(raw, p)
            rest = raw[p:]
            if not rest.startswith(syn.param_start):
                if not final and _is_proper_prefix(rest, syn.param_start, syn.param_end):
                    return "wait"
                break
            gt = raw.find(">", p)
            if gt < 0:
                return "wait"
            tag = raw[p : gt + 1]
            name = attr(tag, "name")
            if name is None:
                return "fail"
            end = raw.find(syn.param_end, gt + 1)
            if end < 0:
                return "wait"
            members.append(param_value_member(name, raw[gt + 1 : end], attr(tag, "string")))
            p = end + len(syn.param_end)
        obj = "{" + ", ".join(members) + "}"
        self._members.append(json_arg_member(self._pname, obj, "false"))
        self._param_prefix(events, False)
        self._emit_args(events, json_text.minify(obj) or "null")
        if raw.startswith(syn.param_end, p):
            p += len(syn.param_end)
        self._pos = p
        self._tstate = "between_params"
        return "go"
