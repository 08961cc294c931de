"""The inference side of the server: one worker thread, a bounded FIFO, cancellation.

MLX streams are per thread, so the model is loaded and used on the worker thread only.  HTTP
handlers (asyncio) submit a :class:`~.events.ChatRequest` and get a :class:`Job`: an async
iterator of :mod:`.events` plus a ``cancel()`` that sets a flag the generation loop checks after
every token.  What runs on the worker is a *generate function* ``fn(request, cancel) ->
Iterator[Event]``; :class:`EngineBackend` supplies the one that drives the library API, tests
supply scripted ones (``tests/server_backend.py``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from ds4_mlx.errors import Ds4Error
from ds4_mlx.frontends.server.events import (
    BackendError,
    ChatRequest,
    Content,
    Done,
    Event,
    Reasoning,
    Started,
    ToolArgs,
    ToolEnd,
    ToolStart,
)

log = logging.getLogger("ds4_mlx.server")

GenerateFn = Callable[[ChatRequest, threading.Event], Iterator[Event]]

_END = object()


class QueueFull(Exception):
    """More requests are waiting than ``--max-queue`` allows (HTTP 503 + Retry-After)."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new work (HTTP 503)."""


class Job:
    """One submitted request.  Iterate :meth:`events` on the event loop that submitted it."""

    def __init__(self, request: ChatRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.cancel_event = threading.Event()
        self.cancel_reason = "cancelled"
        self.submitted = time.monotonic()
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the generation to stop after its current token (safe from any thread)."""
        if not self.cancel_event.is_set():
            self.cancel_reason = reason
            self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def _put(self, item) -> None:
        """Called on the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()

    async def events(self) -> AsyncIterator[Event]:
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def next_event(self, timeout: float | None = None):
        """The next event, or None at the end; raises TimeoutError after ``timeout`` seconds
        (the item stays queued, so callers can poll with keepalives)."""
        item = await asyncio.wait_for(self._queue.get(), timeout)
        if item is _END:
            self._queue.put_nowait(_END)  # stay at the end for further calls
            return None
        if isinstance(item, BaseException):
            raise item
        return item


class Backend:
    """A worker thread running ``generate`` for one job at a time, FIFO, at most ``max_queue``
    jobs waiting.  ``setup``/``teardown`` run on the worker thread (load / save the model state)."""

    def __init__(self, generate: GenerateFn, *, max_queue: int = 64,
                 setup: Callable[[], None] | None = None,
                 teardown: Callable[[], None] | None = None,
                 model_id: str = "deepseek-v4-flash", ctx: int = 32768) -> None:
        if max_queue < 0:
            raise Ds4Error(f"--max-queue must be >= 0, got {max_queue}")
        self.generate = generate
        self.max_queue = max_queue
        self.model_id = model_id
        self.ctx = ctx
        self._setup = setup
        self._teardown = teardown
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker and wait until ``setup`` is done (re-raising its error)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="ds4-mlx-worker", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._setup_error is not None:
            raise self._setup_error

    def begin_shutdown(self) -> None:
        """Stop accepting work, drop waiting jobs, cancel the running one (reason "shutdown")."""
        with self._cond:
            self._closing = True
            waiting = list(self._waiting)
            self._waiting.clear()
            running = self._running
            self._cond.notify_all()
        for job in waiting:
            job.cancel("shutdown")
            job._put(BackendError(503, "server shutting down"))
            job._put(_END)
        if running is not None:
            running.cancel("shutdown")

    def close(self, timeout: float = 30.0) -> None:
        self.begin_shutdown()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- submission ------------------------------------------------------------------------

    def submit(self, request: ChatRequest) -> Job:
        job = Job(request, asyncio.get_running_loop())
        with self._cond:
            if self._closing:
                raise ShuttingDown()
            busy = self._running is not None
            if busy and len(self._waiting) >= self.max_queue:
                raise QueueFull()
            self._waiting.append(job)
            self._cond.notify()
        return job

    def withdraw(self, job: Job) -> None:
        """Cancel ``job``; if it is still waiting it leaves the queue at once."""
        job.cancel()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return
        job._put(Done("cancelled"))
        job._put(_END)

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._running is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closing

    # -- worker ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._setup is not None:
                self._setup()
        except BaseException as exc:  # reported to start(); the thread ends
            self._setup_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                with self._cond:
                    while not self._waiting and not self._closing:
                        self._cond.wait()
                    if not self._waiting:
                        break  # closing and drained
                    job = self._waiting.popleft()
                    self._running = job
                try:
                    self._serve(job)
                finally:
                    with self._cond:
                        self._running = None
        finally:
            if self._teardown is not None:
                try:
                    self._teardown()
                except Exception:
                    log.exception("backend teardown failed")

    def _serve(self, job: Job) -> None:
        if job.cancelled:
            job._put(Done(job.cancel_reason))
            job._put(_END)
            return
        try:
            for event in self.generate(job.request, job.cancel_event):
                job._put(event)
        except BackendError as exc:
            job._put(exc)
        except Ds4Error as exc:  # bad input found by the engine: the client's fault, one line
            job._put(BackendError(400, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
        except Exception:
            log.exception("generation failed")
            job._put(BackendError(500, "internal error during generation"))
        finally:
            job._put(_END)


# -------------------------------------------------------------------------------------------
# The real engine behind the library API


class EngineBackend(Backend):
    """The model behind ``ds4_mlx.stream_generate`` (the public generation API).

    The library call is imported lazily: the server package itself depends only on the chat
    layer.  Contract used (see the public-API issue): ``ds4_mlx.load(path, numerics=...)``,
    ``ds4_mlx.stream_generate(model, prompt_ids, *, max_tokens, temperature, top_p, min_p, top_k,
    seed, think, stop, tools, tool_choice, ctx, kv_cache, cancel, session_id)`` yielding events with
    ``.kind`` in reasoning|content|tool_call|done (+ prefill/cache), ``.text``, and on done
    ``.finish_reason`` and ``.stats`` (prompt_tokens, cached_tokens, completion_tokens, ...)."""

    def __init__(self, model_path: str, *, ctx: int = 32768, numerics: str = "default",
                 kv_disk_dir: str | None = None, kv_disk_space_mb: int | None = None,
                 sessions: int = 1, max_queue: int = 64, model_id: str = "deepseek-v4-flash") -> None:
        import ds4_mlx

        self._api = getattr(ds4_mlx, "stream_generate", None)
        if self._api is None or not hasattr(ds4_mlx, "load"):
            raise Ds4Error("engine API not available in this build: ds4_mlx.stream_generate is "
                           "missing (the server needs the public generation API)")
        self.model_path = model_path
        self.numerics = numerics
        self.kv_disk_dir = kv_disk_dir
        self.kv_disk_space_mb = kv_disk_space_mb
        self.sessions = sessions
        self.model = None
        super().__init__(self._generate, max_queue=max_queue, setup=self._load,
                         model_id=model_id, ctx=ctx)

    def _load(self) -> None:
        import ds4_mlx

        self.model = ds4_mlx.load(self.model_path, numerics=self.numerics)

    def _generate(self, req: ChatRequest, cancel: threading.Event) -> Iterator[Event]:
        from ds4_mlx.chat.request import encode_request

        prompt = encode_request(self.model.tokenizer, req.messages, req.tools, req.tool_choice,
                                req.think, self.ctx)
        if len(prompt) >= self.ctx:
            raise BackendError(400, f"prompt has {len(prompt)} tokens, context is {self.ctx}",
                               code="context_length_exceeded",
                               extra={"n_prompt_tokens": len(prompt), "n_ctx": self.ctx})
        max_tokens = max(1, min(req.max_tokens or self.ctx, self.ctx - len(prompt)))
        started = False
        t0 = time.monotonic()
        t_first = None
        n_out = 0
        for ev in self._api(self.model, prompt, max_tokens=max_tokens,
                            temperature=req.temperature, top_p=req.top_p, min_p=req.min_p,
                            top_k=req.top_k, seed=req.seed, think=req.think.value,
                            raw=req.raw_output, tools=req.tools, tool_choice=req.tool_choice,
                            ctx=self.ctx, cancel=cancel, session_id=req.session_id):
            kind = getattr(ev, "kind", None)
            if kind in ("prefill", "cache"):
                continue
            if not started and kind != "done":
                stats = getattr(ev, "stats", None)
                started = True
                t_first = time.monotonic()
                yield Started(len(prompt), int(getattr(stats, "cached_tokens", 0) or 0),
                              str(getattr(stats, "cache_source", "none") or "none"))
            if kind == "reasoning":
                n_out += 1
                yield Reasoning(ev.text)
            elif kind == "content":
                n_out += 1
                yield Content(ev.text)
            elif kind == "tool_call":
                call = ev.tool_call
                yield ToolStart(call.index, call.name)
                yield ToolArgs(call.index, call.arguments)
                yield ToolEnd(call.index, call.name, call.arguments)
            elif kind == "done":
                stats = getattr(ev, "stats", None)
                if not started:
                    yield Started(len(prompt), int(getattr(stats, "cached_tokens", 0) or 0))
                now = time.monotonic()
                yield Done(ev.finish_reason,
                           int(getattr(stats, "completion_tokens", n_out) or n_out),
                           raw_dsml=getattr(ev, "raw_dsml", None), error=getattr(ev, "error", None),
                           prefill_seconds=(t_first or now) - t0,
                           decode_seconds=now - (t_first or now))
                return
        yield Done("error", n_out, error="engine ended without a done event")
