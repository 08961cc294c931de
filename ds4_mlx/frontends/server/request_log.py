"""What the server says about each request: one structured log line, and ds4's ``--trace FILE``.

The log line (logger ``ds4_mlx.server``, level INFO; a 4xx/5xx at WARNING) is ``key=value`` pairs
a person can read and a script can split: id, endpoint, status, the reason of an error, prompt /
cached / generated / reasoning tokens, where the cached tokens came from, finish, prefill and
decode seconds.  The trace file gets, per request, the rendered prompt, the cache decision, the
output (reasoning, text, tool calls) and the end of the generation, as ds4's ``--trace`` does."""

from __future__ import annotations

import logging
import threading
import time

from ds4_mlx.errors import Ds4Error
from ds4_mlx.frontends.server.turn import TurnResult

log = logging.getLogger("ds4_mlx.server")


def _quote(text: str) -> str:
    text = " ".join(str(text).split())
    return '"' + text[:300].replace('"', "'") + '"'


def request_line(*, rid: str, endpoint: str, status: int, stream: bool | None = None,
                 result: TurnResult | None = None, reason: str | None = None) -> str:
    parts = [f"id={rid}", f"endpoint={endpoint}", f"status={status}"]
    if stream is not None:
        parts.append(f"stream={int(stream)}")
    if reason:
        parts.append(f"reason={_quote(reason)}")
    if result is not None and result.started:
        r = result
        parts += [f"prompt={r.prompt_tokens}", f"cached={r.cached_tokens}", f"source={r.cache_source}",
                  f"generated={r.completion_tokens}", f"reasoning={r.reasoning_tokens}",
                  f"finish={r.finish}", f"prefill={r.prefill_s:.2f}s", f"decode={r.decode_s:.2f}s"]
        if r.drafted_tokens:
            parts += [f"drafted={r.drafted_tokens}", f"accepted={r.accepted_tokens}"]
        if r.error:
            parts.append(f"error={_quote(r.error)}")
    elif result is not None:
        parts.append(f"finish={result.finish}")
    return "request " + " ".join(parts)


def log_request(**fields) -> None:
    line = request_line(**fields)
    log.log(logging.WARNING if fields["status"] >= 400 else logging.INFO, line)


class Trace:
    """Appends one block per finished request to ``path`` (``serve --trace FILE``).  Writes go
    through a lock from worker threads (the caller uses ``asyncio.to_thread``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:  # fail at start-up (before the model loads), not at the first request
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise Ds4Error(f"--trace {path}: {exc.strerror or exc}") from None

    def write(self, *, rid: str, endpoint: str, prompt_text: str, request, result: TurnResult,
              status: int = 200) -> None:
        r = result
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        lines = [f"===== {rid} {stamp} POST {endpoint} =====",
                 f"status: {status}  stream: {int(request.stream)}  think: {request.think.value}  "
                 f"tools: {len(request.tools or ())}  tool_choice: {request.tool_choice}  "
                 f"max_tokens: {request.max_tokens}  temperature: {request.temperature:g}",
                 f"cache: source={r.cache_source} prompt={r.prompt_tokens} reused={r.cached_tokens} "
                 f"prefilled={r.prompt_tokens - r.cached_tokens}",
                 "--- prompt ---", prompt_text,
                 "--- reasoning ---", r.reasoning,
                 "--- content ---", r.content]
        if r.calls:
            lines.append("--- tool calls ---")
            lines += [f"{c.id} {c.name} {c.arguments}" for c in r.calls]
        lines.append(f"--- end: finish={r.finish} generated={r.completion_tokens} "
                     f"reasoning={r.reasoning_tokens} prefill={r.prefill_s:.3f}s decode={r.decode_s:.3f}s"
                     + (f" error={r.error}" if r.error else ""))
        with self._lock, open(self.path, "a", encoding="utf-8", errors="replace") as f:
            f.write("\n".join(lines) + "\n\n")
