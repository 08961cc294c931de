"""OpenAI ``/v1/chat/completions`` and ``/v1/completions``: response bodies and SSE chunks."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from ds4_mlx.frontends.server.events import Content, Done, Reasoning, Started, ToolArgs, ToolStart
from ds4_mlx.frontends.server.parse import Parsed
from ds4_mlx.frontends.server.turn import Tick, Turn, TurnResult


def finish_reason(finish: str) -> str:
    return "stop" if finish == "cancelled" else finish


def usage(r: TurnResult) -> dict:
    details = {"reasoning_tokens": r.reasoning_tokens}
    if r.drafted_tokens:  # speculative decoding, under OpenAI's names for predicted-output tokens
        details.update(accepted_prediction_tokens=r.accepted_tokens,
                       rejected_prediction_tokens=r.drafted_tokens - r.accepted_tokens)
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens,
                                      "cache_write_tokens": r.prompt_tokens - r.cached_tokens},
            "completion_tokens_details": details}


def sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def chat_body(r: TurnResult, parsed: Parsed, rid: str, created: int) -> dict:
    msg: dict = {"role": "assistant", "content": r.content}
    if r.reasoning:
        msg["reasoning_content"] = r.reasoning
    if r.calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in r.calls]
    return {"id": rid, "object": "chat.completion", "created": created, "model": parsed.request.model,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish_reason(r.finish)}],
            "usage": usage(r)}


def completion_body(r: TurnResult, parsed: Parsed, rid: str, created: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": parsed.request.model,
            "choices": [{"text": r.reasoning + r.content, "index": 0, "logprobs": None,
                         "finish_reason": finish_reason(r.finish)}],
            "usage": usage(r)}


async def chat_stream(turn: Turn, parsed: Parsed, rid: str) -> AsyncIterator[str]:
    created = int(time.time())
    model = parsed.request.model

    def chunk(delta: dict, finish=None) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    async for ev in turn:
        if isinstance(ev, Tick):
            if ev.prefill:
                yield ": prefill\n\n"
        elif isinstance(ev, Started):
            yield chunk({"role": "assistant", "content": ""})
        elif isinstance(ev, Reasoning):
            yield chunk({"reasoning_content": ev.text})
        elif isinstance(ev, Content):
            yield chunk({"content": ev.text})
        elif isinstance(ev, ToolStart):
            yield chunk({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                         "function": {"name": ev.name, "arguments": ""}}]})
        elif isinstance(ev, ToolArgs):
            yield chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]})
        elif isinstance(ev, Done):
            yield chunk({}, finish_reason(turn.result.finish))
            if parsed.include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": [], "usage": usage(turn.result)})
            yield "data: [DONE]\n\n"


async def completion_stream(turn: Turn, parsed: Parsed, rid: str) -> AsyncIterator[str]:
    created = int(time.time())
    model = parsed.request.model

    def chunk(text: str, finish=None) -> str:
        return sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]})

    async for ev in turn:
        if isinstance(ev, Tick):
            if ev.prefill:
                yield ": prefill\n\n"
        elif isinstance(ev, (Reasoning, Content)):
            yield chunk(ev.text)
        elif isinstance(ev, Done):
            yield chunk("", finish_reason(turn.result.finish))
            if parsed.include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": usage(turn.result)})
            yield "data: [DONE]\n\n"
