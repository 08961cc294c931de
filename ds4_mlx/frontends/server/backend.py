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

from ds4_mlx.errors import Ds4Error, NonFiniteError
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
        # Why the model is no longer trusted (``/health`` then answers 503 with it), or None.
        # Sticky: weights that produced NaN/Inf once are suspect for every later request, even
        # one that routes around the bad tensor, and a probe that flapped back to "ok" would
        # send clients to an instance that fails at random; a restart with a good file clears it.
        self.fault: str | None = None

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

    def count_tokens(self, request: ChatRequest) -> int:
        """The prompt tokens ``request`` would prefill (Anthropic ``count_tokens``); runs on the
        calling thread, so it must not touch the model's tensors."""
        raise BackendError(501, "token counting is not available on this backend")

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
        except NonFiniteError as exc:
            # Before the generic Ds4Error: NaN/Inf out of the forward pass comes from the model
            # (its weights), not from anything the client sent, so it is a 500 and the instance
            # reports itself unhealthy instead of blaming every client with a 400.
            reason = _one_line(exc)
            if self.fault is None:
                log.error("model fault: %s", reason)
            self.fault = reason
            job._put(BackendError(500, reason))
        except Ds4Error as exc:  # bad input found by the engine: the client's fault, one line
            job._put(BackendError(400, _one_line(exc)))
        except Exception:
            log.exception("generation failed")
            job._put(BackendError(500, "internal error during generation"))
        finally:
            job._put(_END)


def _one_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# -------------------------------------------------------------------------------------------
# The real engine behind the library API


def _log_cache(line: str, report) -> None:
    """A disk-cache event in the server log; a failed save (a full disk, a directory another
    process keeps locked, ...) at WARNING: the request went on without it."""
    failed = getattr(report, "status", None) == "failed"
    log.log(logging.WARNING if failed else logging.INFO, line)


class _Abandoned(Exception):
    """Raised from the prefill hook when the client went away; the computed chunks stay live."""


class EngineBackend(Backend):
    """The model behind the library API: ``ds4_mlx.load``, ``stream_generate`` and a
    :class:`~ds4_mlx.engine.session_pool.SessionPool` of live sessions (with the ``DiskCache``
    of ``--kv-disk-dir``) that decides which KV each request reuses.  Everything that touches the
    model runs on the worker thread (MLX streams are per thread); this class only translates
    between the request/event vocabulary of the server and the library's.

    ``logits_hook(request, prompt_ids) -> list | None``: extra logits processors for one request
    (tests drive tool-call output from a random model with it; the server passes none)."""

    def __init__(self, model_path: str, *, ctx: int = 32768, numerics: str = "default", experts: str = "auto",
                 kv_disk_dir: str | None = None, kv_disk_space_mb: float | None = None,
                 sessions: int = 1, sessions_mb: float = 0, max_queue: int = 64,
                 model_id: str = "deepseek-v4-flash", replay=None,
                 logits_hook: Callable | None = None, distributed: str | None = None,
                 checkpoint: str | None = None, simulate_memory: float | None = None,
                 experts_cache=None, experts_cache_policy: str | None = None,
                 draft=None, draft_k: int | None = None) -> None:
        self.model_path = model_path
        self.simulate_memory = simulate_memory
        self.experts_cache, self.experts_cache_policy = experts_cache, experts_cache_policy
        # speculative decoding (``--draft`` / ``--draft-k``): the drafter lives with the model on the
        # worker thread; each request's generation resets and restarts it on its own session, and the
        # worker runs one request at a time, so no other session's state is ever in flight meanwhile
        self.draft, self.draft_k = draft, draft_k
        self.checkpoint = checkpoint
        self.distributed = distributed
        self.numerics = numerics
        self.experts = experts
        self.kv_disk_dir = kv_disk_dir
        self.kv_disk_space_mb = kv_disk_space_mb
        self.sessions = sessions
        self.sessions_mb = sessions_mb
        if replay is None:
            from ds4_mlx.frontends.server.replay import ReplayMap

            replay = ReplayMap()
        self.replay = replay
        self.logits_hook = logits_hook
        self.model = None
        self.disk = None
        self.pool = None
        self.shutdown_saves: list = []
        super().__init__(self._generate, max_queue=max_queue, setup=self._load,
                         teardown=self._save_on_exit, model_id=model_id, ctx=ctx)

    # -- worker-thread lifecycle -----------------------------------------------------------

    def _load(self) -> None:
        import ds4_mlx
        from ds4_mlx.engine.session_pool import SessionPool

        # ctx: the memory plan sizes the KV at it (capped at the model's: a larger --ctx is named below)
        model = ds4_mlx.load(self.model_path, numerics=self.numerics, experts=self.experts,
                             distributed=self.distributed, checkpoint=self.checkpoint, ctx=self.ctx,
                             simulate_memory=self.simulate_memory, experts_cache=self.experts_cache,
                             experts_cache_policy=self.experts_cache_policy, draft=self.draft,
                             draft_k=self.draft_k)
        if self.ctx > model.context_length:
            raise Ds4Error(f"--ctx {self.ctx} is larger than the model's context length {model.context_length}")
        disk = None
        if self.kv_disk_dir:
            from ds4_mlx.engine.disk_cache import DiskCache

            kwargs = {} if self.kv_disk_space_mb is None else {"budget_mb": self.kv_disk_space_mb}
            disk = DiskCache(model, self.kv_disk_dir, ctx=self.ctx, **kwargs)
            if self.replay is not None:
                disk.tool_memory = self.replay.entries_in
        tok = model.tokenizer
        controls = frozenset(tok.special_ids.values()) | {a.id for a in tok.added_tokens}
        self.model, self.disk = model, disk
        self.pool = SessionPool(lambda: model.new_session(self.ctx), max_sessions=self.sessions,
                                budget_bytes=int(self.sessions_mb * 2**20), disk=disk, tokenizer=tok,
                                control_ids=controls, eos_id=model.eos_id,
                                min_evict_tokens=disk.options.min_tokens if disk is not None else 512)

    def _save_on_exit(self) -> None:
        """ds4's shutdown save: every live session to the disk cache, reason "shutdown"; then the
        model is released here, on the worker thread that made it."""
        try:
            if self.pool is not None:
                self.shutdown_saves = self.pool.save_all("shutdown")
                for res in self.shutdown_saves:
                    log.info("kv cache %s: %s tokens (shutdown) %s", res.status, res.tokens,
                             res.path or res.detail)
        finally:
            self._release_mlx()

    def _release_mlx(self) -> None:
        from ds4_mlx.engine.engine import end_model_thread

        close = getattr(getattr(self.model, "network", None), "close", None)
        if close is not None:
            close()  # a pipeline's rank 0: stop the other ranks from this thread, which drove them
        self.pool = self.disk = self.model = None
        end_model_thread()  # on the worker, the thread that made them (see its docstring)

    # -- one request -------------------------------------------------------------------------

    def _processors(self, req: ChatRequest, prompt: list[int]) -> list:
        from ds4_mlx.engine.constraints import tool_choice_processor

        out = []
        if self.logits_hook is not None:
            out += list(self.logits_hook(req, prompt) or ())
        if req.tools and not req.raw_output:
            thinking = prompt[-1] == self.model.tokenizer.token_to_id("<think>")
            fn = tool_choice_processor(self.model.tokenizer, req.tool_choice, thinking=thinking)
            if fn is not None:
                out.append(fn)
        return out

    def count_tokens(self, request: ChatRequest) -> int:
        # the tokenizer is plain Python over read-only tables: safe off the worker thread
        from ds4_mlx.chat.request import encode_request

        if self.model is None:
            raise BackendError(503, "the model is not loaded")
        return len(encode_request(self.model.tokenizer, request.messages, request.tools,
                                  request.tool_choice, request.think, self.ctx))

    def _visible_ids(self, req: ChatRequest, result) -> list[int] | None:
        """The ids a client resends for this transcript plus the answer just given (ds4's
        thinking-visible key), or None when they cannot be told."""
        from ds4_mlx.chat.request import encode_request

        tok = self.model.tokenizer
        answer = {"role": "assistant", "content": result.content or ""}
        if result.reasoning:
            answer["reasoning_content"] = result.reasoning
        try:
            ids = encode_request(tok, list(req.messages) + [answer, {"role": "user", "content": ""}],
                                 req.tools, req.tool_choice, req.think, self.ctx)
        except Ds4Error:
            return None
        tail = [tok.token_to_id(t) for t in ("<｜User｜>", "<｜Assistant｜>")]
        if ids[-3:-1] != tail or ids[-4] != self.model.eos_id:
            return None
        return ids[:-3]

    def _generate(self, req: ChatRequest, cancel: threading.Event) -> Iterator[Event]:
        import ds4_mlx
        from ds4_mlx.chat.dsml_stream import ToolCallEnd, ToolCallStart
        from ds4_mlx.chat.request import encode_request
        from ds4_mlx.engine.generate import expert_counters, sync_report_lines

        prompt = encode_request(self.model.tokenizer, req.messages, req.tools, req.tool_choice,
                                req.think, self.ctx)
        if len(prompt) >= self.ctx:
            raise BackendError(400, f"prompt has {len(prompt)} tokens, context is {self.ctx}",
                               code="context_length_exceeded",
                               extra={"n_prompt_tokens": len(prompt), "n_ctx": self.ctx})
        t0 = time.monotonic()

        def on_prefill(done: int, total: int) -> None:
            if cancel.is_set():
                raise _Abandoned

        # The pool's sync is the request's one prefill (generation continues from the session it
        # leaves at the prompt): its time and expert-cache reads are measured here.
        experts0 = expert_counters(self.model)
        try:
            prep = self.pool.prepare(prompt, session_id=req.session_id, on_prefill=on_prefill)
        except _Abandoned:
            yield Done("cancelled", error="cancelled during prefill")
            return
        t1 = time.monotonic()
        experts1 = expert_counters(self.model)
        prefill_read = 0 if experts0 is None else experts1[2] - experts0[2]
        for report in prep.reports:
            for line, obj in sync_report_lines(report):
                _log_cache(line, obj)
        yield Started(len(prompt), prep.cached, prep.source)
        room = self.ctx - len(prep.prompt)
        max_tokens = max(0, min(req.max_tokens or room, room))
        tools = None if req.raw_output else req.tools
        n_out = 0
        for ev in ds4_mlx.stream_generate(
                self.model, prep.prompt, max_tokens=max_tokens, temperature=req.temperature,
                top_p=req.top_p, min_p=req.min_p, top_k=req.top_k, seed=req.seed or None,
                think=req.think, tools=tools, tool_choice=req.tool_choice if tools else None,
                session=prep.slot.session, kv_cache=self.disk, cancel=cancel,
                logits_processors=self._processors(req, prep.prompt) or None):
            kind = ev.kind
            if kind == "cache":
                _log_cache(ev.text, ev.report)
                continue
            if kind == "notice":
                continue
            if req.raw_output:
                if kind != "done" and ev.text:
                    yield Content(ev.text)
            else:
                for d in ev.deltas:
                    if isinstance(d, ToolCallStart):
                        yield ToolStart(d.index, d.name)
                    elif isinstance(d, ToolCallEnd):
                        yield ToolEnd(d.index, d.call.name, d.call.arguments)
                    elif isinstance(d, ToolArgs) and d.fragment:
                        yield d
                    elif isinstance(d, (Reasoning, Content)) and d.text:
                        yield d  # (StreamEnd is not forwarded: the done event carries the result)
            if kind == "done":
                res = ev.result
                n_out = res.stats.generation_tokens
                visible = None
                if (res.finish_reason == "stop" and not res.tool_calls and not req.raw_output
                        and prep.slot.session.tokens == prep.prompt + list(res.tokens)):
                    visible = self._visible_ids(req, res)
                self.pool.remember_answer(prep.slot, visible)
                now = time.monotonic()
                st = res.stats
                yield Done(res.finish_reason, n_out, raw_dsml=res.raw_dsml, error=res.error,
                           prefill_seconds=t1 - t0, decode_seconds=now - t1,
                           reasoning_tokens=0 if req.raw_output else st.reasoning_tokens,
                           expert_hits=st.expert_hits or 0, expert_misses=st.expert_misses or 0,
                           expert_bytes_read=st.expert_bytes_read or 0,
                           expert_prefill_bytes_read=prefill_read,
                           drafted_tokens=st.drafted_tokens, accepted_tokens=st.accepted_tokens)
                return
        yield Done("error", n_out, error="engine ended without a done event")
