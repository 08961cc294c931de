"""Typed results of parsing generated assistant text (tool calls, reasoning, content)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """One tool invocation.

    ``arguments`` is JSON object text.  Calls parsed from model output carry the compact form ds4
    sends to clients (``{"k":"v","n":1}``); calls from a request carry whatever the client sent,
    which the DSML renderer re-parses leniently."""

    name: str
    arguments: str
    id: str | None = None


@dataclass(frozen=True)
class ParsedMessage:
    """What ds4-server extracts from one generated assistant turn [parse_generated_message_ex].

    ``reasoning`` is None when no ``</think>`` closed a reasoning section (then, as in ds4, the
    whole text is content).  ``ok`` is False when a tool-call block started but was malformed or
    unterminated: ds4 then returns the complete raw text as content with no reasoning and no calls.
    ``raw_dsml`` is the exact sampled block (with its leading blank line when present), which ds4
    replays verbatim when the calls come back in a later request."""

    reasoning: str | None
    content: str
    tool_calls: tuple[ToolCall, ...] = field(default_factory=tuple)
    raw_dsml: str | None = None
    ok: bool = True
