"""OpenAI Responses ``/v1/responses``: response object and the SSE sequence, every event an
``event: TYPE`` line and its ``data:`` line (OpenAI's wire format; ds4 sends the data lines only)
and carrying a ``sequence_number`` (Codex relies on it).  Every item of the final response was
announced by ``response.output_item.added``/``done`` first."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from ds4_mlx.frontends.server.events import Content, Done, Reasoning, Started, ToolArgs, ToolEnd, ToolStart
from ds4_mlx.frontends.server.parse import Parsed
from ds4_mlx.frontends.server.turn import Tick, Turn, TurnResult, new_id


def status_of(finish: str) -> str:
    return {"length": "incomplete", "error": "failed"}.get(finish, "completed")


def item_status(finish: str) -> str:
    return "incomplete" if finish in ("length", "error") else "completed"


def usage(r: TurnResult) -> dict:
    return {"input_tokens": r.prompt_tokens,
            "input_tokens_details": {"cached_tokens": r.cached_tokens,
                                     "cache_write_tokens": r.prompt_tokens - r.cached_tokens},
            "output_tokens": r.completion_tokens, "output_tokens_details": {"reasoning_tokens": r.reasoning_tokens},
            "total_tokens": r.prompt_tokens + r.completion_tokens}


class _Ids:
    def __init__(self) -> None:
        self.reasoning = new_id("rs_", 24)
        self.message = new_id("msg_", 24)
        self.fc: dict[str, str] = {}

    def fc_id(self, call_id: str) -> str:
        return self.fc.setdefault(call_id, new_id("fc_", 24))


def _reasoning_item(ids: _Ids, r: TurnResult, status: str) -> dict:
    summary = [{"type": "summary_text", "text": r.reasoning}] if r.reasoning else []
    return {"id": ids.reasoning, "type": "reasoning", "status": status, "summary": summary}


def _message_item(ids: _Ids, text: str, status: str) -> dict:
    return {"id": ids.message, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(ids: _Ids, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": ids.fc_id(call_id), "type": "function_call", "status": status, "name": name,
            "call_id": call_id, "arguments": arguments}


def _output(ids: _Ids, r: TurnResult, parsed: Parsed) -> list[dict]:
    out = []
    st = item_status(r.finish)
    if parsed.include_reasoning and r.reasoning:
        out.append(_reasoning_item(ids, r, "completed" if r.reasoning_closed else "incomplete"))
    if r.content or not r.calls:
        out.append(_message_item(ids, r.content, st))
    out += [_call_item(ids, c.id, c.name, c.arguments, st) for c in r.calls]
    return out


def _response(rid: str, created: int, parsed: Parsed, status: str, output: list, r: TurnResult | None) -> dict:
    body = {"id": rid, "object": "response", "created_at": created, "status": status,
            "model": parsed.request.model, "output": output}
    if status == "failed":
        body["error"] = {"code": "server_error", "message": (r.error if r else None) or "generation failed"}
    elif status == "incomplete":
        body["incomplete_details"] = {"reason": "max_tokens"}
    if r is not None:
        body["usage"] = usage(r)
    return body


def response_body(r: TurnResult, parsed: Parsed, rid: str, created: int) -> dict:
    return _response(rid, created, parsed, status_of(r.finish), _output(_Ids(), r, parsed), r)


async def response_stream(turn: Turn, parsed: Parsed, rid: str) -> AsyncIterator[str]:
    created = int(time.time())
    ids = _Ids()
    seq = 0
    next_index = 0
    open_item: str | None = None  # "reasoning" | "message" | call id
    indexes: dict[str, int] = {}
    r = turn.result

    def emit(kind: str, **fields) -> str:
        nonlocal seq
        data = {"type": kind, **fields, "sequence_number": seq}
        seq += 1
        return f"event: {kind}\ndata: " + json.dumps(data, ensure_ascii=False) + "\n\n"

    def open_(key: str) -> int:
        nonlocal next_index, open_item
        indexes[key] = next_index
        next_index += 1
        open_item = key
        return indexes[key]

    def open_message() -> str:
        i = open_("message")
        return (emit("response.output_item.added", output_index=i,
                     item={"id": ids.message, "type": "message", "status": "in_progress",
                           "role": "assistant", "content": []})
                + emit("response.content_part.added", item_id=ids.message, output_index=i,
                       content_index=0, part={"type": "output_text", "text": "", "annotations": []}))

    def close(final: bool) -> str:
        nonlocal open_item
        key, open_item = open_item, None
        if key is None:
            return ""
        i = indexes[key]
        st = item_status(r.finish) if final else "completed"
        if key == "reasoning":
            st = "completed" if r.reasoning_closed else "incomplete"
            part = {"type": "summary_text", "text": r.reasoning}
            return (emit("response.reasoning_summary_text.done", item_id=ids.reasoning, output_index=i,
                         summary_index=0, text=r.reasoning)
                    + emit("response.reasoning_summary_part.done", item_id=ids.reasoning, output_index=i,
                           summary_index=0, part=part)
                    + emit("response.output_item.done", output_index=i, item=_reasoning_item(ids, r, st)))
        if key == "message":
            part = {"type": "output_text", "text": r.content, "annotations": []}
            return (emit("response.output_text.done", item_id=ids.message, output_index=i, content_index=0,
                         text=r.content)
                    + emit("response.content_part.done", item_id=ids.message, output_index=i,
                           content_index=0, part=part)
                    + emit("response.output_item.done", output_index=i, item=_message_item(ids, r.content, st)))
        call = next(c for c in r.calls if c.id == key)
        return (emit("response.function_call_arguments.done", item_id=ids.fc_id(key), output_index=i,
                     name=call.name, arguments=call.arguments)
                + emit("response.output_item.done", output_index=i,
                       item=_call_item(ids, call.id, call.name, call.arguments, st)))

    async for ev in turn:
        if isinstance(ev, Tick):
            if ev.prefill:
                yield ": prefill\n\n"
        elif isinstance(ev, Started):
            yield emit("response.created",
                       response=_response(rid, created, parsed, "in_progress", [], None))
        elif isinstance(ev, Reasoning):
            if not parsed.include_reasoning:
                continue
            if open_item != "reasoning":
                yield close(False)
                i = open_("reasoning")
                yield emit("response.output_item.added", output_index=i,
                           item={"id": ids.reasoning, "type": "reasoning", "status": "in_progress",
                                 "summary": []})
                yield emit("response.reasoning_summary_part.added", item_id=ids.reasoning, output_index=i,
                           summary_index=0, part={"type": "summary_text", "text": ""})
            yield emit("response.reasoning_summary_text.delta", item_id=ids.reasoning,
                       output_index=indexes["reasoning"], summary_index=0, delta=ev.text)
        elif isinstance(ev, Content):
            if open_item != "message":
                yield close(False) + open_message()
            yield emit("response.output_text.delta", item_id=ids.message, output_index=indexes["message"],
                       content_index=0, delta=ev.text)
        elif isinstance(ev, ToolStart):
            yield close(False)
            i = open_(ev.id)
            yield emit("response.output_item.added", output_index=i,
                       item=_call_item(ids, ev.id, ev.name, "", "in_progress"))
        elif isinstance(ev, ToolArgs):
            if open_item and open_item in indexes:
                yield emit("response.function_call_arguments.delta", item_id=ids.fc_id(open_item),
                           output_index=indexes[open_item], delta=ev.fragment)
        elif isinstance(ev, ToolEnd):
            yield close(True)
        elif isinstance(ev, Done):
            yield close(True)
            if "message" not in indexes and not r.calls:
                # no text came but the response lists its (empty) message: announce it like any item
                yield open_message() + close(True)
            status = status_of(r.finish)
            kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                    "failed": "response.failed"}[status]
            yield emit(kind, response=_response(rid, created, parsed, status, _output(ids, r, parsed), r))
