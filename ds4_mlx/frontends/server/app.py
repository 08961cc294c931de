"""The Starlette application: routes, API key, CORS, request limits, error bodies, metrics.

Starlette (over uvicorn) because the server needs plain ASGI control - exact ds4 JSON and SSE
bytes, early SSE headers during prefill, disconnect detection - and no schema layer of its own:
every validation error must come out in the shape of the API the client speaks."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ds4_mlx.chat.request import MODEL_ALIASES, render_request
from ds4_mlx.chat.effort import PREVIEW_RULES, THINK_MAX_MIN_CONTEXT, EffortRules
from ds4_mlx.errors import ChatError
from ds4_mlx.frontends.server import anthropic_api, openai_api, parse, responses_api
from ds4_mlx.frontends.server.backend import Backend, QueueFull, ShuttingDown
from ds4_mlx.frontends.server.events import BackendError, Done, Started
from ds4_mlx.frontends.server.http_errors import (
    ApiError,
    error_response,
    protocol_of_path,
    stream_error_event,
)
from ds4_mlx.frontends.server.metrics import Metrics
from ds4_mlx.frontends.server.replay import ReplayMap
from ds4_mlx.frontends.server.request_log import Trace, log_request
from ds4_mlx.frontends.server.turn import Tick, Turn, new_id

log = logging.getLogger("ds4_mlx.server")

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
CREATED = 1767225600  # fixed "created" of the model object, as ds4


@dataclass
class ServerConfig:
    ctx: int = 32768
    model_id: str = "deepseek-v4-flash"
    api_key: str | None = None
    cors: tuple[str, ...] = ()  # --cors ORIGIN...: origins allowed to call from a browser ("*": any)
    # --allow-host: the Host header values served (a DNS-rebinding page sends its own name);
    # None: any (a server bound to a network address, whose names are not known here)
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS
    max_body_bytes: int = 16 * 1024 * 1024
    max_json_depth: int = 64
    max_messages: int = 4096
    max_tools: int = 1024
    keepalive_s: float = 5.0   # ": prefill" comment period during long prefills
    retry_after_s: int = 5
    replay_max_ids: int = 100_000
    trace: str | None = None   # --trace FILE
    header_timeout_s: float = 10.0  # a connection's request head must arrive within this
    body_timeout_s: float = 30.0    # the longest wait for the next piece of a request body
    max_connections: int = 256      # beyond: the connection idle longest is closed (http_protocol)
    max_output: int = 393216   # --max-tokens (ds4's -n default): default and cap of an answer's length
    # The loaded checkpoint's thinking levels (chat/effort.py): how reasoning_effort, thinking and
    # output_config.effort read, and the default level; decided once, from the model file.
    effort_rules: EffortRules = PREVIEW_RULES


def _json_problem(value, limit: int) -> str | None:
    """Why a decoded body cannot be used, or None: nesting deeper than ``limit``, or a string (key
    or value) holding a lone UTF-16 surrogate (JSON's ``\\ud800`` escapes decode to one; it cannot
    be encoded as UTF-8, so it would fail in the tokenizer or in the echoed reply). One walk; the
    path of the first offender is named."""
    stack = [(value, 1, None)]
    while stack:
        v, d, path = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                return f"nesting deeper than {limit}"
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str) and not _utf8_ok(k):
                    return f"a key in {_path_text(path)} is not valid Unicode (a lone surrogate)"
                if isinstance(x, (dict, list, str)):
                    stack.append((x, d + 1, (k, path)))
        elif not _utf8_ok(v):
            return f"{_path_text(path)} is not valid Unicode (a lone surrogate)"
    return None


def _utf8_ok(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path_text(path) -> str:
    """``messages[1].content`` for the linked path (("content", (1, ("messages", None))))."""
    keys = []
    while path is not None:
        k, path = path
        keys.append(k)
    text = ""
    for k in reversed(keys):
        if isinstance(k, int):
            text += f"[{k}]"
        else:
            text += ("." if text else "") + (k if _utf8_ok(k) else "?")
    return text or "the body"


class Server:
    def __init__(self, backend: Backend, config: ServerConfig) -> None:
        self.backend = backend
        self.config = config
        self.metrics = Metrics()
        # one map, shared with a backend that persists it (the disk cache's KTM sections)
        shared = getattr(backend, "replay", None)
        self.replay = shared if shared is not None else ReplayMap(config.replay_max_ids)
        self.trace = Trace(config.trace) if config.trace else None
        self.limits = parse.Limits(ctx=config.ctx, max_messages=config.max_messages, max_tools=config.max_tools,
                                   model_id=config.model_id, max_output=config.max_output,
                                   effort_rules=config.effort_rules)

    # -- plumbing ------------------------------------------------------------------------------

    async def read_json(self, request: Request):
        cap = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None:
            try:
                if int(length) > cap:
                    raise ApiError(413, f"request body is larger than {cap} bytes")
            except ValueError:
                raise ApiError(400, "bad Content-Length header") from None
        chunks, size = [], 0
        stream = request.stream().__aiter__()
        while True:
            try:  # a client that stops sending mid-body must not hold its connection for ever
                chunk = await asyncio.wait_for(stream.__anext__(), self.config.body_timeout_s)
            except StopAsyncIteration:
                break
            except ClientDisconnect:
                # a client gone mid-body (closed, or half-closed before its body was complete) is
                # no server fault: one log line, not the traceback of an unhandled error
                raise ApiError(400, f"the client closed the connection after {size} bytes of the "
                                    "request body") from None
            except (asyncio.TimeoutError, TimeoutError):
                raise ApiError(408, f"request body not received: nothing came for {self.config.body_timeout_s:g} s "
                                    f"after {size} bytes") from None
            size += len(chunk)
            if size > cap:
                raise ApiError(413, f"request body is larger than {cap} bytes")
            chunks.append(chunk)
        # decoding and checking 16 MiB takes seconds: off the event loop, which must keep
        # answering /health and streaming to the other clients meanwhile
        return await asyncio.to_thread(self._decode, b"".join(chunks))

    def _decode(self, raw: bytes):
        try:
            body = json.loads(raw)
        except RecursionError:
            raise ApiError(400, "invalid JSON request: nesting too deep") from None
        except ValueError:
            raise ApiError(400, "invalid JSON request") from None
        if not isinstance(body, dict):  # every POST endpoint takes an object; `null` used to reach parsing
            raise ApiError(400, f"invalid JSON request: the body must be a JSON object, not {type(body).__name__}"
                           .replace("NoneType", "null"))
        problem = _json_problem(body, self.config.max_json_depth)
        if problem is not None:
            raise ApiError(400, f"invalid JSON request: {problem}")
        return body

    async def parsed(self, request: Request, parse_fn) -> parse.Parsed:
        """The request's body parsed by ``parse_fn`` (validation and conversion run off the loop)."""
        body = await self.read_json(request)
        return await asyncio.to_thread(parse_fn, body, self.limits, request.headers)

    def model_object(self) -> dict:
        ctx = self.config.ctx
        return {"id": self.config.model_id, "object": "model", "created": CREATED, "owned_by": "ds4-mlx",
                "name": "DeepSeek V4 Flash", "context_length": ctx,
                "top_provider": {"context_length": ctx, "max_completion_tokens": min(self.config.max_output, ctx),
                                 "is_moderated": False},
                "supported_parameters": ["tools", "tool_choice", "max_tokens", "temperature", "top_p",
                                         "top_k", "min_p", "stop", "seed", "stream", "reasoning_effort"]}

    # -- GET endpoints ----------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_object()]})

    async def model(self, request: Request) -> Response:
        mid = request.path_params["model_id"]
        if mid != self.config.model_id and mid not in MODEL_ALIASES:
            raise ApiError(404, f"unknown model {mid!r}", code="model_not_found")
        return JSONResponse(dict(self.model_object(), id=mid))

    def _state(self) -> tuple[str, str | None]:
        """(status, reason): "ok"; "unavailable" (worker stopped or stopping); "error" once the
        model itself failed (non-finite output): a load balancer must take the instance out."""
        fault = getattr(self.backend, "fault", None)
        if fault is not None:
            return "error", fault
        return ("ok", None) if self.backend.alive else ("unavailable", None)

    async def health(self, request: Request) -> Response:
        status, reason = self._state()
        body = {"status": status, "model": self.config.model_id,
                "queue_depth": self.backend.queue_depth, "busy": self.backend.busy}
        if reason is not None:
            body["reason"] = reason
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def root(self, request: Request) -> Response:
        """``GET``/``HEAD /``: Claude Code probes the base URL before its first request."""
        status, reason = self._state()
        body = {"status": status, "model": self.config.model_id}
        if reason is not None:
            body["reason"] = reason
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic ``POST /v1/messages/count_tokens``: the prompt tokens of a messages body,
        rendered and tokenized as ``/v1/messages`` would (``max_tokens`` not required)."""
        parsed = await self.parsed(request, parse.parse_messages)
        req = parsed.request
        try:
            n = await asyncio.to_thread(self.backend.count_tokens, req)
        except ChatError as exc:
            raise ApiError(400, str(exc)) from None
        return JSONResponse({"input_tokens": n})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(queue_depth=self.backend.queue_depth, busy=self.backend.busy),
                        media_type="text/plain; version=0.0.4")

    # -- generation -------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        parsed = await self.parsed(request, parse.parse_chat)
        rid = new_id("chatcmpl-", 24)
        return await self.generate(request, parsed, rid, "call_",
                                   lambda t: openai_api.chat_stream(t, parsed, rid),
                                   lambda r: openai_api.chat_body(r, parsed, rid, int(time.time())))

    async def completions(self, request: Request) -> Response:
        parsed = await self.parsed(request, parse.parse_completion)
        rid = new_id("cmpl-", 24)
        return await self.generate(request, parsed, rid, "call_",
                                   lambda t: openai_api.completion_stream(t, parsed, rid),
                                   lambda r: openai_api.completion_body(r, parsed, rid, int(time.time())))

    async def messages(self, request: Request) -> Response:
        parsed = await self.parsed(request, parse.parse_messages)
        mid = new_id("msg_", 24)
        return await self.generate(request, parsed, mid, "toolu_",
                                   lambda t: anthropic_api.message_stream(t, parsed, mid),
                                   lambda r: anthropic_api.message_body(r, parsed, mid))

    async def responses(self, request: Request) -> Response:
        parsed = await self.parsed(request, parse.parse_responses)
        rid = new_id("resp_", 24)
        return await self.generate(request, parsed, rid, "call_",
                                   lambda t: responses_api.response_stream(t, parsed, rid),
                                   lambda r: responses_api.response_body(r, parsed, rid, int(time.time())))

    def _headers(self, parsed: parse.Parsed) -> dict:
        h = {}
        if parsed.request.think.downgraded:
            h["x-ds4-think"] = (f"{parsed.request.think.requested.value} refused: context {self.config.ctx} < "
                                f"{THINK_MAX_MIN_CONTEXT}; using {parsed.request.think.value}")
        return h

    async def generate(self, request: Request, parsed: parse.Parsed, rid: str, call_prefix: str,
                       stream_fn: Callable, body_fn: Callable) -> Response:
        req = parsed.request
        endpoint = request.url.path
        protocol = protocol_of_path(endpoint)
        try:  # render now so a malformed transcript is a 400 before anything is queued
            prompt_text = await asyncio.to_thread(render_request, req.messages, req.tools, req.tool_choice,
                                                  req.think, self.config.ctx)
        except ChatError as exc:
            raise ApiError(400, str(exc)) from None
        disk_dir = getattr(self.backend, "kv_disk_dir", None)
        if disk_dir:
            wanted = ReplayMap.call_ids(req.messages)
            if wanted:
                await asyncio.to_thread(self.replay.restore_from_dir, disk_dir, wanted)
        req.messages = self.replay.apply(req.messages)
        headers = self._headers(parsed)
        try:
            job = self.backend.submit(req)
        except QueueFull:
            raise ApiError(503, "server busy: the request queue is full",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except ShuttingDown:
            raise ApiError(503, "server shutting down") from None
        turn = Turn(self.backend, job, call_prefix=call_prefix, replay=self.replay, metrics=self.metrics,
                    tick_s=self.config.keepalive_s)
        watcher = asyncio.create_task(self._watch_disconnect(request, turn))
        try:
            first = await turn.__anext__()
        except BackendError:
            turn.done = True
            watcher.cancel()
            raise
        except BaseException:
            watcher.cancel()
            turn.close()
            raise
        if isinstance(first, Started):
            headers["x-ds4-cache"] = _cache_note(first.cache_source, first.cached_tokens)
        turn._queue.insert(0, first)

        async def finished(status: int) -> None:
            r = turn.result
            log_request(rid=rid, endpoint=endpoint, status=status, stream=req.stream, result=r,
                        reason=r.error if r.finish == "error" else None)
            if self.trace is not None:
                await asyncio.to_thread(self.trace.write, rid=rid, endpoint=endpoint,
                                        prompt_text=prompt_text, request=req, result=r, status=status)

        if req.stream:
            async def body():
                noted = "x-ds4-cache" in headers
                try:
                    async for chunk in stream_fn(turn):
                        if not noted and turn.result.started:
                            # the headers went out during a long prefill, before the cache decision:
                            # the decision comes as an SSE comment ahead of the first event after it
                            noted = True
                            yield f": x-ds4-cache {_cache_note(turn.result.cache_source, turn.result.cached_tokens)}\n\n"
                        yield chunk
                except BackendError as exc:
                    turn.done = True
                    turn.result.finish, turn.result.error = "error", exc.message
                    yield stream_error_event(exc.message, protocol)
                finally:
                    watcher.cancel()
                    turn.close()
                    await finished(200)

            headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

        try:
            async for ev in turn:
                if isinstance(ev, Tick) or not isinstance(ev, Done):
                    continue
        except BackendError:
            turn.done = True
            raise
        finally:
            watcher.cancel()
            turn.close()
        r = turn.result
        if r.finish == "error" and not (r.content or r.reasoning or r.calls) and r.error:
            raise ApiError(500 if r.error != "server shutting down" else 503, r.error)
        headers["x-ds4-cache"] = _cache_note(r.cache_source, r.cached_tokens)
        await finished(200)
        return JSONResponse(body_fn(r), headers=headers)

    async def _watch_disconnect(self, request: Request, turn: Turn) -> None:
        """Cancel the generation as soon as the client goes away (the body is already read, so
        the next ASGI message can only be the disconnect)."""
        try:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    turn.close()
                    return
        except asyncio.CancelledError:
            pass
        except Exception:  # a server without receive after the body: nothing to watch
            return


def _cache_note(source: str, reused: int) -> str:
    return f"source={source}; reused={reused}"


def _wrap(server: Server, fn):
    async def endpoint(request: Request) -> Response:
        protocol = protocol_of_path(request.url.path)
        try:
            response = await fn(request)
        except BackendError as err:  # ApiError included
            response = error_response(err, protocol)
            log_request(rid="-", endpoint=request.url.path, status=err.status, reason=err.message)
        except Exception:
            log.exception("unhandled error in %s", request.url.path)
            response = error_response(ApiError(500, "internal server error"), protocol)
            log_request(rid="-", endpoint=request.url.path, status=500, reason="internal server error")
        server.metrics.request(request.url.path if not request.url.path.startswith("/v1/models/")
                               else "/v1/models/{id}", response.status_code)
        return response
    return endpoint


class _Guard:
    """ASGI middleware: OPTIONS preflight, CORS headers, API key; all errors as JSON."""

    def __init__(self, app, config: ServerConfig) -> None:
        self.app = app
        self.config = config
        self.key = config.api_key.encode() if config.api_key else None

    def _authorized(self, headers: dict) -> bool:
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization")
        if given is None and auth is not None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        return given is not None and hmac.compare_digest(given, self.key)

    def _host_ok(self, headers: dict) -> str | None:
        """None when the Host header is one this server answers to, else the name it gave."""
        allowed = self.config.allowed_hosts
        if allowed is None:
            return None
        raw = headers.get(b"host", b"").decode("latin-1").strip().lower()
        name = raw[1:raw.index("]")] if raw.startswith("[") and "]" in raw else raw.rsplit(":", 1)[0]
        return None if name in allowed else (name or "(none)")

    def _cors_headers(self, headers: dict) -> list:
        origins = self.config.cors
        origin = headers.get(b"origin")
        if not origins or origin is None:
            return []
        if "*" in origins:
            allow = b"*"
        elif origin.decode("latin-1") in origins:
            allow = origin
        else:
            return []
        return [(b"access-control-allow-origin", allow), (b"vary", b"Origin"),
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", b"*")]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        cors = self._cors_headers(headers)
        protocol = protocol_of_path(scope["path"])

        async def send_with_cors(message):
            if message["type"] == "http.response.start" and cors:
                message = dict(message, headers=list(message.get("headers", [])) + cors)
            await send(message)

        async def refuse(err: ApiError, extra: dict | None = None):
            log_request(rid="-", endpoint=scope["path"], status=err.status, reason=err.message)
            return await error_response(err, protocol, extra)(scope, receive, send_with_cors)

        bad_host = self._host_ok(headers)
        if bad_host is not None:
            return await refuse(ApiError(421, f"Host {bad_host[:80]!r} is not served here (this server answers "
                                              f"to {', '.join(self.config.allowed_hosts)}; serve --allow-host NAME "
                                              "adds a name)"))
        if scope["method"] == "OPTIONS":
            return await Response(status_code=204)(scope, receive, send_with_cors)
        if self.key is not None and scope["path"] not in ("/health", "/"):  # probes carry no secrets
            if not self._authorized(headers):
                return await refuse(ApiError(401, "invalid or missing API key"), {"WWW-Authenticate": "Bearer"})
        if scope["method"] == "POST":
            # a page on another site can POST text/plain without a preflight; JSON needs one
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json" and not (kind.startswith(b"application/") and kind.endswith(b"+json")):
                return await refuse(ApiError(415, "request bodies must be JSON: send Content-Type: "
                                                  f"application/json (got {kind.decode('latin-1')[:60] or 'none'!r})"))
        if b"transfer-encoding" in headers and b"content-length" in headers:
            # RFC 9112 6.3: ambiguous framing (the smuggling shape); chunked then waited for a
            # chunk size in a plain body until the body deadline
            return await refuse(ApiError(400, "a request may not have both Content-Length and "
                                              "Transfer-Encoding"))
        return await self.app(scope, receive, send_with_cors)


def create_app(backend: Backend, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app.  The backend is started in the app's startup and closed at shutdown."""
    config = config or ServerConfig()
    server = Server(backend, config)

    @asynccontextmanager
    async def lifespan(app):
        await asyncio.to_thread(backend.start)
        try:
            yield
        finally:
            await asyncio.to_thread(backend.close)

    async def not_found(request: Request, exc: HTTPException) -> Response:
        protocol = protocol_of_path(request.url.path)
        if exc.status_code == 404:
            server.metrics.request("unknown", 404)
            log_request(rid="-", endpoint=request.url.path, status=404, reason="unknown endpoint")
            return error_response(ApiError(404, "unknown endpoint"), protocol)
        return error_response(ApiError(exc.status_code, str(exc.detail)), protocol)

    async def internal(request: Request, exc: Exception) -> Response:
        log.error("unhandled error in %s: %r", request.url.path, exc)
        return error_response(ApiError(500, "internal server error"), protocol_of_path(request.url.path))

    routes = [
        Route("/", _wrap(server, server.root), methods=["GET", "HEAD"]),
        Route("/v1/models", _wrap(server, server.models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", _wrap(server, server.model), methods=["GET"]),
        Route("/health", _wrap(server, server.health), methods=["GET"]),
        Route("/metrics", _wrap(server, server.metrics_text), methods=["GET"]),
        Route("/v1/chat/completions", _wrap(server, server.chat), methods=["POST"]),
        Route("/v1/completions", _wrap(server, server.completions), methods=["POST"]),
        Route("/v1/messages", _wrap(server, server.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", _wrap(server, server.count_tokens), methods=["POST"]),
        Route("/v1/responses", _wrap(server, server.responses), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: not_found, Exception: internal})
    app.state.server = server
    app.add_middleware(_Guard, config=config)
    return app
