"""One generation as the client sees it, whatever the API: events from the backend with stop
strings applied, tool-call ids assigned, keepalive ticks while waiting, and the totals each API
needs at the end (text, reasoning, calls, usage, finish).  Also records the exact sampled DSML of
the calls for replay."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field, replace

from ds4_mlx.frontends.server.backend import Backend, Job
from ds4_mlx.frontends.server.events import (
    Content,
    Done,
    Prefill,
    Reasoning,
    Started,
    ToolArgs,
    ToolEnd,
    ToolStart,
)
from ds4_mlx.frontends.server.metrics import Metrics
from ds4_mlx.frontends.server.replay import ReplayMap
from ds4_mlx.frontends.server.stops import StopFilter


@dataclass(frozen=True)
class Tick:
    """No event for a while.  ``prefill``: still before :class:`Started` (send ``: prefill``)."""

    prefill: bool


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""


@dataclass
class TurnResult:
    reasoning: str = ""
    reasoning_closed: bool = False
    content: str = ""
    calls: list[Call] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_source: str = "none"
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish: str = "stop"
    error: str | None = None
    started: bool = False


def new_id(prefix: str, nhex: int = 32) -> str:
    return prefix + secrets.token_hex(nhex // 2)


class Turn:
    """Async iterator over client-facing events for one job.  ``tick_s``: how long to wait for an
    event before yielding a :class:`Tick` (keepalives during prefill, disconnect checks)."""

    def __init__(self, backend: Backend, job: Job, *, call_prefix: str, replay: ReplayMap,
                 metrics: Metrics, tick_s: float = 5.0) -> None:
        self.backend = backend
        self.job = job
        self.call_prefix = call_prefix
        self.replay = replay
        self.metrics = metrics
        self.tick_s = tick_s
        self.result = TurnResult()
        self.done = False
        self._stops = StopFilter(job.request.stop)
        self._ids: dict[int, str] = {}
        self._queue: list = []

    def close(self) -> None:
        """Abandon the job (client gone): cancel it and leave the worker free."""
        if not self.done:
            self.backend.withdraw(self.job)
            self.metrics.disconnect()
            self.done = True

    def __aiter__(self):
        return self

    async def __anext__(self):
        while not self._queue:
            if self.done:
                raise StopAsyncIteration
            try:
                ev = await self.job.next_event(self.tick_s)
            except (asyncio.TimeoutError, TimeoutError):
                return Tick(prefill=not self.result.started)
            if ev is None:  # the worker ended the job without Done (should not happen)
                self._finish(Done("error", error="generation ended unexpectedly"))
            else:
                self._handle(ev)
        return self._queue.pop(0)

    def _emit_text(self, pieces) -> None:
        r = self.result
        for kind, text in pieces:
            if kind is Reasoning:
                r.reasoning += text
            else:
                r.content += text
            self._queue.append(kind(text))

    def _handle(self, ev) -> None:
        r = self.result
        if isinstance(ev, Prefill):
            return
        if isinstance(ev, Started):
            r.started = True
            r.prompt_tokens, r.cached_tokens, r.cache_source = (
                ev.prompt_tokens, min(ev.cached_tokens, ev.prompt_tokens), ev.cache_source)
            self._queue.append(ev)
            return
        if isinstance(ev, Done):
            self._finish(ev)
            return
        if self._stops.hit:
            return  # generation is being cancelled; nothing after the stop string is shown
        if isinstance(ev, (Reasoning, Content)):
            if isinstance(ev, Content) and r.reasoning and not r.content and not r.calls:
                r.reasoning_closed = True
            self._emit_text(self._stops.feed(type(ev), ev.text))
            if self._stops.hit:
                self.job.cancel("stop")
            return
        self._emit_text(self._stops.flush())
        r.reasoning_closed = r.reasoning_closed or bool(r.reasoning)
        if isinstance(ev, ToolStart):
            cid = self._ids.setdefault(ev.index, new_id(self.call_prefix))
            r.calls.append(Call(cid, ev.name))
            self._queue.append(replace(ev, id=cid))
        elif isinstance(ev, ToolArgs):
            if ev.index in self._ids:
                r.calls[-1].arguments += ev.fragment
                self._queue.append(ev)
        elif isinstance(ev, ToolEnd):
            cid = self._ids.get(ev.index)
            if cid is None:  # a backend that reports only whole calls
                cid = self._ids.setdefault(ev.index, new_id(self.call_prefix))
                r.calls.append(Call(cid, ev.name, ev.arguments))
                self._queue.append(ToolStart(ev.index, ev.name, cid))
                self._queue.append(ToolArgs(ev.index, ev.arguments))
            else:
                r.calls[-1].arguments = ev.arguments
            self._queue.append(replace(ev, id=cid))

    def _finish(self, ev: Done) -> None:
        r = self.result
        self._emit_text(self._stops.flush())
        finish, error = ev.finish, ev.error
        if self._stops.hit:
            finish, error = "stop", None
        elif finish == "cancelled" and self.job.cancel_reason == "shutdown":
            finish, error = "error", "server shutting down"
        elif finish == "tool_calls" and not r.calls:
            finish = "stop"
        r.finish, r.error = finish, error
        r.completion_tokens = ev.completion_tokens
        r.reasoning_tokens = min(ev.reasoning_tokens, ev.completion_tokens)
        r.prefill_s, r.decode_s = ev.prefill_seconds, ev.decode_seconds
        r.drafted_tokens, r.accepted_tokens = ev.drafted_tokens, ev.accepted_tokens
        if r.reasoning and (r.content or r.calls):
            r.reasoning_closed = True
        if r.calls and ev.raw_dsml:
            self.replay.record([c.id for c in r.calls], ev.raw_dsml)
        self.metrics.generation(finish=finish, prompt=r.prompt_tokens, cached=r.cached_tokens,
                                completion=r.completion_tokens, source=r.cache_source,
                                prefill_s=ev.prefill_seconds, decode_s=ev.decode_seconds,
                                expert_hits=ev.expert_hits, expert_misses=ev.expert_misses,
                                expert_bytes=(ev.expert_prefill_bytes_read, ev.expert_bytes_read),
                                drafted=ev.drafted_tokens, accepted=ev.accepted_tokens)
        self.done = True
        self._queue.append(replace(ev, finish=finish, error=error))
