"""Request bodies of the four APIs -> :class:`~.events.ChatRequest`.

Parsers are selective like ds4's: unknown fields are ignored, any ``model`` string is accepted
and echoed.  Every malformed field raises :class:`~.http_errors.ApiError` (400) naming it.
Anthropic and Responses transcripts are converted to OpenAI-shaped messages here, so the one
chat renderer (:func:`ds4_mlx.chat.request.render_request`) sees a single message shape."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from ds4_mlx.chat.effort import PREVIEW_RULES, Effort, EffortRules
from ds4_mlx.chat.request import requested_think_mode
from ds4_mlx.chat.template import (
    DEFAULT_SYSTEM,
    ThinkMode,
    content_text,
    render_tool_schemas,
)
from ds4_mlx.errors import ChatError
from ds4_mlx.frontends.server.events import ChatRequest
from ds4_mlx.frontends.server.http_errors import ApiError

MAX_STOPS = 16
MAX_STOP_CHARS = 1024


@dataclass
class Limits:
    ctx: int = 32768
    max_messages: int = 4096
    max_tools: int = 1024
    model_id: str = "deepseek-v4-flash"
    max_output: int = 393216  # --max-tokens: the answer length when a request names none, and its cap
    effort_rules: EffortRules = PREVIEW_RULES  # the loaded checkpoint's thinking levels


@dataclass
class Parsed:
    request: ChatRequest
    think_requested: ThinkMode
    include_reasoning: bool = True  # Responses: only with reasoning.summary
    include_usage: bool = False     # OpenAI stream_options.include_usage


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _object(body) -> Mapping:
    if not isinstance(body, Mapping):
        raise bad("request body must be a JSON object")
    return body


def _number(body: Mapping, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f"{key} must be a number", key)
    # an integer past float's range (JSON allows 1e400 written out) compares fine but overflows
    # in math.isfinite / float(): the range check names it instead of a 500
    if not (isinstance(v, int) or math.isfinite(v)) or not lo <= v <= hi:
        shown = v if not isinstance(v, int) or abs(v) < 10 ** 15 else f"an integer of {len(str(abs(v)))} digits"
        raise bad(f"{key} must be between {lo:g} and {hi:g}, got {shown}", key)
    return float(v)


def _int(body: Mapping, key: str, default: int | None, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{key} must be an integer", key)
    if v < lo:
        raise bad(f"{key} must be >= {lo}, got {v}", key)
    return v


def _stops(value, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad(f"{key} must be a string or an array of strings", key)
    if len(value) > MAX_STOPS:
        raise bad(f"{key}: at most {MAX_STOPS} stop strings", key)
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise bad(f"{key}: a stop string is longer than {MAX_STOP_CHARS} characters", key)
    return [s for s in value if s]


def _think(body: Mapping, limits: Limits) -> tuple[ThinkMode, Effort]:
    try:
        requested = requested_think_mode(body, limits.effort_rules)
    except ChatError as exc:
        raise bad(str(exc)) from None
    return requested, limits.effort_rules.effort(requested, limits.ctx)


def _common(body: Mapping, limits: Limits, max_keys: tuple[str, ...], stop_key: str,
            headers: Mapping) -> dict:
    model = body.get("model", limits.model_id)
    if not isinstance(model, str):
        raise bad("model must be a string", "model")
    max_tokens = None
    for k in max_keys:
        max_tokens = _int(body, k, max_tokens, 1) if body.get(k) is not None else max_tokens
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    session = headers.get("x-session-id")
    if session is not None and (len(session) > 256 or not session.isprintable()):
        raise bad("X-Session-Id must be printable and at most 256 characters")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("seed must be an integer", "seed")
    return dict(
        model=model,
        # a request without a limit (Codex sends none) gets --max-tokens; none gets more, and the
        # backend clamps again to the room left after the prompt
        max_tokens=min(max_tokens or limits.max_output, limits.max_output, limits.ctx),
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        min_p=_number(body, "min_p", 0.05, 0.0, 1.0),
        top_k=_int(body, "top_k", 0, 0),
        seed=seed,
        stop=_stops(body.get(stop_key), stop_key),
        stream=stream,
        session_id=session,
    )


def _transcript(items, limits: Limits, key: str) -> list:
    """The request's ``key`` array: present, non-empty, within ``--max-messages``."""
    if not isinstance(items, list) or not items:
        raise bad(f"missing {key}", key)
    if len(items) > limits.max_messages:
        raise ApiError(413, f"{key}: {len(items)} items, the limit is {limits.max_messages}",
                       param=key)
    return items


def _tool_name(tool: Mapping):
    fn = tool.get("function")
    return fn.get("name") if isinstance(fn, Mapping) else tool.get("name")


def _tool_fields(body: Mapping, choice, limits: Limits, also_named=()) -> dict:
    """``tools`` and ``tool_choice`` of a ChatRequest; "none" drops the tools (no tools prompt,
    as ds4).  A choice that forces a call needs a tool to call: "required" with no tools, or a
    name no tool has (``also_named``: tools sent but kept out of the prompt), is a 400 rather
    than a constraint the model cannot meet."""
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > limits.max_tools:
        raise ApiError(413, f"tools: {len(tools)} entries, the limit is {limits.max_tools}", param="tools")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, Mapping) for t in tools)):
        raise bad("tools must be an array of objects", "tools")
    if choice == "required" and not tools:
        raise bad("tool_choice requires a tool call but tools is empty", "tool_choice")
    if isinstance(choice, Mapping):
        names = {_tool_name(t) for t in tools or ()} | set(also_named)
        if choice["name"] not in names:
            shown = choice["name"] if len(choice["name"]) <= 80 else choice["name"][:80] + "..."
            raise bad(f"tool_choice names {shown!r}, which is not in tools", "tool_choice")
    return {"tools": None if choice == "none" else (list(tools or ()) or None), "tool_choice": choice}


def _text(value, where: str) -> str:
    try:
        return content_text(value)
    except ChatError as exc:
        raise bad(f"{where}: {exc}") from None


# -------------------------------------------------------------------------------------------
# OpenAI chat completions and completions


def _openai_tool_choice(value):
    if value is None or value in ("auto", "none", "required"):
        return value or "auto"
    if isinstance(value, Mapping):
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else value.get("name")
        if isinstance(name, str) and name:
            return {"name": name}
    raise bad('tool_choice must be "none", "auto", "required" or {"type":"function",'
              '"function":{"name":...}}', "tool_choice")


def _openai_messages(messages) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"messages[{i}].role must be a string", "messages")
        msg = {k: v for k, v in m.items() if k != "raw_dsml"}  # only the server sets raw_dsml
        _text(m.get("content"), f"messages[{i}].content")
        calls = m.get("tool_calls")
        if calls is not None and (not isinstance(calls, list)
                                  or not all(isinstance(c, Mapping) for c in calls)):
            raise bad(f"messages[{i}].tool_calls must be an array of objects", "messages")
        out.append(msg)
    return out


def parse_chat(body, limits: Limits, headers: Mapping = {}) -> Parsed:
    body = _object(body)
    messages = _transcript(body.get("messages"), limits, "messages")
    requested, think = _think(body, limits)
    tool_fields = _tool_fields(body, _openai_tool_choice(body.get("tool_choice")), limits)
    so = body.get("stream_options")
    include_usage = isinstance(so, Mapping) and so.get("include_usage") is True
    req = ChatRequest(messages=_openai_messages(messages), think=think, **tool_fields,
                      **_common(body, limits, ("max_tokens", "max_completion_tokens"), "stop", headers))
    return Parsed(req, requested, include_usage=include_usage)


def parse_completion(body, limits: Limits, headers: Mapping = {}) -> Parsed:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = next((p for p in prompt if isinstance(p, str)), None)
    if not isinstance(prompt, str):
        raise bad("missing prompt", "prompt")
    requested, think = _think(body, limits)
    so = body.get("stream_options")
    messages = [{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": prompt}]
    req = ChatRequest(messages=messages, think=think, raw_output=True,
                      **_common(body, limits, ("max_tokens",), "stop", headers))
    return Parsed(req, requested,
                  include_usage=isinstance(so, Mapping) and so.get("include_usage") is True)


# -------------------------------------------------------------------------------------------
# Anthropic messages


def _anthropic_system(value) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad("system must be a string or an array of text blocks", "system")
    parts = []
    for block in value:
        if not isinstance(block, Mapping) or not isinstance(block.get("text", ""), str):
            raise bad("system blocks must be objects with a text string", "system")
        text = block.get("text", "")
        if not text.startswith("x-anthropic-"):  # client billing headers, not instructions
            parts.append(text)
    return "\n\n".join(p for p in parts if p)


def _anthropic_tool_choice(value):
    if value is None:
        return "auto"
    if not isinstance(value, Mapping):
        raise bad("tool_choice must be an object", "tool_choice")
    kind = value.get("type")
    if kind == "none":
        return "none"
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(value.get("name"), str) and value["name"]:
        return {"name": value["name"]}
    raise bad('tool_choice.type must be "auto", "any", "tool" (with name) or "none"', "tool_choice")


# Anthropic text blocks of one message are separate paragraphs to the client (Claude Code sends a
# <system-reminder> block, then the prompt); joined with nothing they would run into each other
# ("...</system-reminder>Say hello."), which ds4 does.  A blank line is how every other part of the
# template separates texts (the system texts are joined the same way).
BLOCK_SEPARATOR = "\n\n"
ANTHROPIC_ROLES = ("user", "assistant", "system", "developer")


def _tool_reference_text(block: Mapping, deferred: Mapping[str, Mapping], where: str) -> str:
    """A ``tool_reference`` block (Anthropic tool search: "this tool is now loaded") becomes the
    tool's schema line where it stands, so the tool enters the prompt at that point and the
    prefix before it (tools prompt included) stays what the client sent before."""
    name = block.get("tool_name")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}: tool_reference needs a tool_name string", "messages")
    tool = deferred.get(name)
    if tool is None:
        return ""  # a tool already in the tools prompt (or one the client never sent): nothing to add
    return render_tool_schemas([tool]).rstrip("\n")


def _result_text(value, where: str, deferred: Mapping[str, Mapping]) -> str:
    if not isinstance(value, list):
        return _text(value, where)
    parts = []
    for j, b in enumerate(value):
        if not isinstance(b, Mapping):
            continue
        kind = b.get("type", "text")
        if kind == "text":
            parts.append(_text(b.get("text", ""), f"{where}[{j}].text"))
        elif kind == "tool_reference":
            parts.append(_tool_reference_text(b, deferred, f"{where}[{j}]"))
    return BLOCK_SEPARATOR.join(p for p in parts if p)


def _anthropic_messages(messages, deferred: Mapping[str, Mapping] = {}) -> list[dict]:
    """Anthropic ``messages`` -> OpenAI-shaped messages.  ``system``/``developer`` items may stand
    anywhere (Claude Code puts its environment block after the first user message): they become
    system messages, which the renderer gathers into the system text as ds4 does."""
    out: list[dict] = []
    seen_ids: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise bad(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ANTHROPIC_ROLES:
            shown = repr(role) if isinstance(role, str) and len(role) <= 40 else "this role"
            raise bad(f"{where}.role {shown} is not supported: use user, assistant or system", "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": "system" if role == "developer" else role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content must be a string or an array of blocks", "messages")
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict] = []
        for j, b in enumerate(content):
            if not isinstance(b, Mapping):
                raise bad(f"{where}.content[{j}] must be an object", "messages")
            kind = b.get("type")
            if kind == "text":
                texts.append(_text(b.get("text", ""), f"{where}.content[{j}].text"))
            elif role in ("system", "developer"):
                if kind in ("tool_use", "tool_result"):
                    raise bad(f"{where}.content[{j}]: {kind} in a {role} message is not supported",
                              "messages")
            elif kind == "thinking" and role == "assistant":
                reasoning.append(_text(b.get("thinking", ""), f"{where}.content[{j}].thinking"))
            elif kind == "tool_use" and role == "assistant":
                tid, name, inp = b.get("id"), b.get("name"), b.get("input", {})
                if not isinstance(tid, str) or not isinstance(name, str) or not isinstance(inp, Mapping):
                    raise bad(f"{where}.content[{j}]: tool_use needs id, name and an input object",
                              "messages")
                seen_ids.add(tid)
                calls.append({"id": tid, "type": "function", "function": {
                    "name": name, "arguments": json.dumps(inp, ensure_ascii=False, separators=(",", ":"))}})
            elif kind == "tool_result" and role == "user":
                tid = b.get("tool_use_id")
                if not isinstance(tid, str) or tid not in seen_ids:
                    raise bad(f"{where}.content[{j}]: tool_result {tid!r} has no matching tool_use "
                              "earlier in this request; replay the full history", "messages")
                out.append({"role": "tool", "tool_call_id": tid,
                            "content": _result_text(b.get("content", ""), f"{where}.content[{j}].content",
                                                    deferred)})
            # images, documents, redacted thinking...: skipped, as ds4 does
        text = BLOCK_SEPARATOR.join(t for t in texts if t)
        if role == "assistant":
            msg: dict = {"role": "assistant", "content": text}
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif role in ("system", "developer"):
            out.append({"role": "system", "content": text})
        elif texts:
            out.append({"role": "user", "content": text})
    return out


def _anthropic_tools(body: Mapping) -> tuple[list | None, dict[str, Mapping]]:
    """The tools for the prompt and the deferred ones by name: a tool sent with ``defer_loading``
    (Anthropic tool search) stays out of the tools prompt until a ``tool_reference`` block names
    it (see :func:`_tool_reference_text`)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return tools, {}
    deferred = {t["name"]: t for t in tools if isinstance(t, Mapping) and t.get("defer_loading") is True
                and isinstance(t.get("name"), str)}
    if not deferred:
        return tools, {}
    kept = [t for t in tools if not (isinstance(t, Mapping) and t.get("defer_loading") is True)]
    return kept, {n: {k: v for k, v in t.items() if k != "defer_loading"} for n, t in deferred.items()}


def parse_messages(body, limits: Limits, headers: Mapping = {}) -> Parsed:
    body = _object(body)
    messages = _transcript(body.get("messages"), limits, "messages")
    requested, think = _think(body, limits)
    tools, deferred = _anthropic_tools(body)
    tool_fields = _tool_fields({"tools": tools}, _anthropic_tool_choice(body.get("tool_choice")), limits,
                               also_named=deferred)
    system = _anthropic_system(body.get("system"))
    msgs = ([{"role": "system", "content": system}] if system else []) + _anthropic_messages(messages, deferred)
    req = ChatRequest(messages=msgs, think=think, **tool_fields,
                      **_common(body, limits, ("max_tokens",), "stop_sequences", headers))
    return Parsed(req, requested)


# -------------------------------------------------------------------------------------------
# OpenAI Responses


def _responses_tool_choice(value):
    if value is None or value in ("auto", "none", "required"):
        return value or "auto"
    if isinstance(value, Mapping) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"name": value["name"]}
    raise bad('tool_choice must be "auto", "none", "required" or {"type":"function","name":...}',
              "tool_choice")


def _item_text(value, where: str) -> str:
    if isinstance(value, list):
        value = [p for p in value if isinstance(p, Mapping)
                 and p.get("type", "input_text") in ("input_text", "output_text", "text")]
    return _text(value, where)


def _responses_input(items) -> list[dict]:
    out: list[dict] = []
    pending_reasoning: list[str] = []

    def assistant() -> dict:
        if out and out[-1]["role"] == "assistant" and not out[-1].get("_closed"):
            msg = out[-1]
        else:
            msg = {"role": "assistant", "content": ""}
            out.append(msg)
        if pending_reasoning:
            msg["reasoning_content"] = msg.get("reasoning_content", "") + "".join(pending_reasoning)
            pending_reasoning.clear()
        return msg

    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, Mapping):
            raise bad(f"{where} must be an object", "input")
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{where}.role must be user, assistant, system or developer", "input")
            text = _item_text(it.get("content"), f"{where}.content")
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
            else:
                if pending_reasoning:  # reasoning with no answer after it is still that turn's output
                    assistant()
                if out and out[-1]["role"] == "assistant":
                    out[-1]["_closed"] = True
                out.append({"role": role, "content": text})
        elif kind == "reasoning":
            summary = it.get("summary") or []
            if isinstance(summary, list):
                text = "".join(s.get("text", "") for s in summary
                               if isinstance(s, Mapping) and isinstance(s.get("text"), str))
                if text:  # an empty summary (reasoning not shown to the client) adds no turn
                    pending_reasoning.append(text)
        elif kind in ("function_call", "custom_tool_call"):
            cid, name = it.get("call_id"), it.get("name")
            if not isinstance(cid, str) or not isinstance(name, str):
                raise bad(f"{where}: {kind} needs call_id and name strings", "input")
            if kind == "function_call":
                args = it.get("arguments", "{}")
                if not isinstance(args, str):
                    raise bad(f"{where}.arguments must be a string", "input")
            else:
                inp = it.get("input", "")
                if not isinstance(inp, str):
                    raise bad(f"{where}.input must be a string", "input")
                args = json.dumps({"input": inp}, ensure_ascii=False, separators=(",", ":"))
            assistant().setdefault("tool_calls", []).append(
                {"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if pending_reasoning:
                assistant()
            if out and out[-1]["role"] == "assistant":
                out[-1]["_closed"] = True
            output = it.get("output", "")
            text = output if isinstance(output, str) else _item_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": it.get("call_id"), "content": text})
        # other items (web_search_call, compaction, ...) are bookkeeping: skipped as in ds4
    if pending_reasoning:  # a turn that ended in its reasoning (cut at max tokens): replay it too
        assistant()
    for m in out:
        m.pop("_closed", None)
    return out


def parse_responses(body, limits: Limits, headers: Mapping = {}) -> Parsed:
    body = _object(body)
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise bad(f"{key} is not supported: replay the full input instead", key)
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    items = _transcript(items, limits, "input")
    requested, think = _think(body, limits)
    tool_fields = _tool_fields(body, _responses_tool_choice(body.get("tool_choice")), limits)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions must be a string", "instructions")
    msgs = ([{"role": "system", "content": instructions}] if instructions else []) + _responses_input(items)
    if not msgs:
        raise bad("missing input", "input")
    reasoning = body.get("reasoning")
    include_reasoning = isinstance(reasoning, Mapping) and reasoning.get("summary") is not None
    req = ChatRequest(messages=msgs, think=think, **tool_fields,
                      **_common(body, limits, ("max_output_tokens", "max_tokens"), "stop", headers))
    return Parsed(req, requested, include_reasoning=include_reasoning)


# The four APIs by name (``tokenize --api``), and by the path they are served at.
PARSERS = {"chat": parse_chat, "completions": parse_completion, "messages": parse_messages,
           "responses": parse_responses}
API_OF_PATH = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages",
               "/v1/responses": "responses"}
