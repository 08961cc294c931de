"""Anthropic ``/v1/messages``: response body and the ``event:``/``data:`` SSE sequence
(message_start, content blocks for thinking / text / tool_use, message_delta, message_stop)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from ds4_mlx.frontends.server.events import Content, Done, Reasoning, Started, ToolArgs, ToolEnd, ToolStart
from ds4_mlx.frontends.server.parse import Parsed
from ds4_mlx.frontends.server.turn import Tick, Turn, TurnResult

STOP_REASONS = {"stop": "end_turn", "cancelled": "end_turn", "length": "max_tokens",
                "tool_calls": "tool_use", "error": "end_turn"}


def usage(r: TurnResult, output_tokens: int | None = None) -> dict:
    return {"input_tokens": 0, "output_tokens": r.completion_tokens if output_tokens is None else output_tokens,
            "cache_read_input_tokens": r.cached_tokens,
            "cache_creation_input_tokens": r.prompt_tokens - r.cached_tokens}


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_body(r: TurnResult, parsed: Parsed, mid: str) -> dict:
    content: list[dict] = []
    if r.reasoning:
        content.append({"type": "thinking", "thinking": r.reasoning, "signature": mid})
    if r.content or not r.calls:
        content.append({"type": "text", "text": r.content})
    for c in r.calls:
        content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)})
    return {"id": mid, "type": "message", "role": "assistant", "model": parsed.request.model,
            "content": content, "stop_reason": STOP_REASONS.get(r.finish, "end_turn"),
            "stop_sequence": None, "usage": usage(r)}


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: " + json.dumps(data, ensure_ascii=False) + "\n\n"


async def message_stream(turn: Turn, parsed: Parsed, mid: str) -> AsyncIterator[str]:
    index = -1
    open_kind: str | None = None

    def start(kind: str, block: dict) -> str:
        nonlocal index, open_kind
        index += 1
        open_kind = kind
        return event("content_block_start", {"type": "content_block_start", "index": index,
                                             "content_block": block})

    def stop() -> str:
        nonlocal open_kind
        out = ""
        if open_kind == "thinking":
            out += event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                 "delta": {"type": "signature_delta", "signature": mid}})
        out += event("content_block_stop", {"type": "content_block_stop", "index": index})
        open_kind = None
        return out

    async for ev in turn:
        if isinstance(ev, Tick):
            if ev.prefill:
                yield ": prefill\n\n"
        elif isinstance(ev, Started):
            yield event("message_start", {"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "model": parsed.request.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": usage(turn.result, 0)}})
        elif isinstance(ev, Reasoning):
            if open_kind != "thinking":
                if open_kind:
                    yield stop()
                yield start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            yield event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": "thinking_delta", "thinking": ev.text}})
        elif isinstance(ev, Content):
            if open_kind != "text":
                if open_kind:
                    yield stop()
                yield start("text", {"type": "text", "text": ""})
            yield event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": "text_delta", "text": ev.text}})
        elif isinstance(ev, ToolStart):
            if open_kind:
                yield stop()
            yield start("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
        elif isinstance(ev, ToolArgs):
            yield event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": "input_json_delta",
                                                          "partial_json": ev.fragment}})
        elif isinstance(ev, ToolEnd):
            if open_kind:
                yield stop()
        elif isinstance(ev, Done):
            r = turn.result
            if open_kind:
                yield stop()
            if r.reasoning and not r.content and not r.calls:
                # ds4 appends an empty text block when only thinking was produced
                yield start("text", {"type": "text", "text": ""})
                yield stop()
            yield event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": STOP_REASONS.get(r.finish, "end_turn"),
                                                    "stop_sequence": None},
                                          "usage": usage(r)})
            yield event("message_stop", {"type": "message_stop"})
