"""Test double for the server's inference backend and a live-server harness.

:class:`ScriptedBackend` is the real :class:`~ds4_mlx.frontends.server.backend.Backend` (worker
thread, FIFO, cancellation) running a scripted generate function instead of the model: the last
user message selects a script by name (``"script:NAME"``), anything else gets the default
reasoning + content answer.  Prompt tokens are the rendered prompt's characters (the real chat
renderer is used), and the "cache" is the common prefix with the previous request, so a warm
repeat reports cached tokens like the engine will."""

from __future__ import annotations

import json
import socket
import threading
import time

import uvicorn

from ds4_mlx.chat.request import render_request
from ds4_mlx.frontends.server import Backend, ServerConfig, create_app
from ds4_mlx.frontends.server.events import (
    BackendError,
    Content,
    Done,
    Reasoning,
    Started,
    ToolArgs,
    ToolEnd,
    ToolStart,
)
from ds4_mlx.frontends.server.http_protocol import uvicorn_config

RAW_DSML = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')

SCRIPTS = {
    "default": [Reasoning("Let me think."), Content("Hello"), Content(", world!"), Done("stop", 4)],
    "plain": [Content("Hello, world!"), Done("stop", 3)],
    "tool": [Reasoning("Need weather."), ToolStart(0, "get_weather"), ToolArgs(0, '{"city":"'),
             ToolArgs(0, 'Paris"}'), ToolEnd(0, "get_weather", '{"city":"Paris"}'),
             Done("tool_calls", 12, raw_dsml=RAW_DSML)],
    "two_tools": [ToolStart(0, "a"), ToolArgs(0, "{}"), ToolEnd(0, "a", "{}"),
                  ToolStart(1, "b"), ToolArgs(1, '{"x":1}'), ToolEnd(1, "b", '{"x":1}'),
                  Done("tool_calls", 9, raw_dsml="\n\n<｜DSML｜tool_calls>...two...</｜DSML｜tool_calls>")],
    "unterminated": [ToolStart(0, "get_weather"), ToolArgs(0, '{"city":"Par'),
                     Done("error", 7, error="unterminated tool call")],
    "length": [Reasoning("thinking and thinking"), Done("length", 5)],
    "stop": [Content("alpha STO"), Content("P beta"), Content(" gamma"), Done("stop", 3)],
    "error_mid": [Content("partial"), BackendError(500, "engine exploded")],
    "reject": [BackendError(400, "prompt has 99999 tokens, context is 32768",
                            code="context_length_exceeded", extra={"n_prompt_tokens": 99999, "n_ctx": 32768})],
    "long": [Content("tick ")] * 400 + [Done("length", 400)],
    # a capped answer that never left its reasoning (what a random model gives an agent)
    "reasoning_only": [Reasoning("still "), Reasoning("thinking"), Done("length", 6, reasoning_tokens=6)],
    "mixed": [Reasoning("why"), Content("Hi"), Done("stop", 5, reasoning_tokens=3)],
}


def last_user_text(messages) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            c = m.get("content")
            return c if isinstance(c, str) else ""
    return ""


class ScriptedBackend(Backend):
    """``delay``: seconds between events; ``prefill_s``: seconds before :class:`Started`."""

    def __init__(self, *, max_queue: int = 64, delay: float = 0.0, prefill_s: float = 0.0, ctx: int = 32768):
        super().__init__(self._generate, max_queue=max_queue, ctx=ctx)
        self.delay = delay
        self.prefill_s = prefill_s
        self.requests = []
        self.cancelled = []
        self._last_prompt = ""

    def count_tokens(self, req) -> int:
        return len(render_request(req.messages, req.tools, req.tool_choice, req.think, self.ctx))

    def _sleep(self, seconds: float, cancel: threading.Event) -> bool:
        return cancel.wait(seconds) if seconds > 0 else cancel.is_set()

    def _generate(self, req, cancel):
        self.requests.append(req)
        prompt = render_request(req.messages, req.tools, req.tool_choice, req.think, self.ctx)
        text = last_user_text(req.messages)
        name = text[len("script:"):] if text.startswith("script:") else "default"
        script = SCRIPTS.get(name, SCRIPTS["default"])
        if script and isinstance(script[0], BackendError):
            raise script[0]
        if self._sleep(self.prefill_s, cancel):
            self.cancelled.append(req)
            yield Done("cancelled")
            return
        cached = 0
        for a, b in zip(prompt, self._last_prompt):
            if a != b:
                break
            cached += 1
        self._last_prompt = prompt
        yield Started(len(prompt), cached, "live" if cached else "none")
        n = 0
        for ev in script:
            if self._sleep(self.delay, cancel):
                self.cancelled.append(req)
                yield Done("cancelled", n)
                return
            if isinstance(ev, BackendError):
                raise ev
            if isinstance(ev, Done) and req.raw_output:
                ev = Done("stop" if ev.finish == "tool_calls" else ev.finish, ev.completion_tokens)
            n += 1
            yield ev


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn on a free 127.0.0.1 port in a background thread."""

    def __init__(self, backend: Backend, config: ServerConfig | None = None) -> None:
        self.backend = backend
        self.config = config or ServerConfig(keepalive_s=0.2)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(backend, self.config)
        # the connection limits serve runs with (header deadline, connection cap)
        self._server = uvicorn.Server(uvicorn_config(self.app, "127.0.0.1", self.port, "warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.backend.begin_shutdown()
        self._server.should_exit = True
        self._thread.join(20)


def http(url: str, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None,
         timeout: float = 20.0):
    """(status, headers, body bytes) of one raw request (no client-side validation)."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        if isinstance(body, str):
            body = body.encode()
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        conn.request(method, path, body=body, headers=h)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def sse_frames(raw: bytes) -> list[str]:
    return [f for f in raw.decode().split("\n\n") if f]


class TokenizingBackend(Backend):
    """The server's real prompt path without the model: each request is rendered and tokenized
    with the model's tokenizer exactly as ``EngineBackend`` does (``encode_request``), the prompt
    size is reported, and a one-token answer follows.  Replays of long recorded client requests
    then check the ids without paying their prefill."""

    def __init__(self, tokenizer, *, ctx: int = 65536):
        super().__init__(self._generate, ctx=ctx)
        self.tokenizer = tokenizer
        self.prompts: list[list[int]] = []

    def count_tokens(self, req) -> int:
        from ds4_mlx.chat.request import encode_request

        return len(encode_request(self.tokenizer, req.messages, req.tools, req.tool_choice, req.think, self.ctx))

    def _generate(self, req, cancel):
        from ds4_mlx.chat.request import encode_request

        ids = encode_request(self.tokenizer, req.messages, req.tools, req.tool_choice, req.think, self.ctx)
        self.prompts.append(ids)
        yield Started(len(ids), 0, "none")
        yield Content("ok")
        yield Done("stop", 1)


def check_stream(api: str, raw: bytes, complete: bool = True) -> dict | None:
    """The frames parse and the stream ends the way its API ends one (``complete``: with a
    finished answer, not one cut at max tokens); returns the prompt size its usage reports."""
    events = []
    for f in sse_frames(raw):
        if f.startswith(":"):
            continue
        lines = f.split("\n")
        data = [ln[6:] for ln in lines if ln.startswith("data: ")]
        assert len(data) == 1, f
        if data[0] == "[DONE]":
            events.append("[DONE]")
            continue
        obj = json.loads(data[0])
        kind = [ln[7:] for ln in lines if ln.startswith("event: ")]
        if kind:
            assert kind == [obj["type"]], f
        events.append(obj)
    if api == "messages":
        assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
        start, delta = events[0]["message"]["usage"], [e for e in events if e["type"] == "message_delta"][-1]
        assert delta["delta"]["stop_reason"] in (("end_turn",) if complete else ("end_turn", "max_tokens"))
        return {"prompt": start["input_tokens"] + start["cache_read_input_tokens"] + start["cache_creation_input_tokens"]}
    if api == "responses":
        assert events[-1]["type"] in (("response.completed",) if complete else
                                      ("response.completed", "response.incomplete"))
        return {"prompt": events[-1]["response"]["usage"]["input_tokens"]}
    assert events[-1] == "[DONE]"
    usage = [e for e in events[:-1] if e.get("usage")]
    finishes = [c["finish_reason"] for e in events[:-1] for c in e.get("choices") or () if c.get("finish_reason")]
    assert len(finishes) == 1, finishes
    return {"prompt": usage[-1]["usage"]["prompt_tokens"]} if usage else None
