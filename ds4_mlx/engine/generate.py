"""The generation loop: ``stream_generate`` yields events, ``generate`` returns the finished result.

This is the only decode loop in the package; the CLI, the demo, the chat REPL and the server are
built on it. Defaults are ds4's CLI defaults (system "You are a helpful assistant", thinking on,
temperature 1, top-p 1, min-p 0.05, time-based seed) except ``max_tokens=256``, so that
``generate(load(M), "Hello", max_tokens=8, temperature=0).text`` is exactly what
``ds4-mlx generate -m M -p Hello -n 8 --temp 0`` prints.

The loop follows ds4's CLI step for step: sample from the logits after the prompt; stop on EOS;
feed the token back only when another one will be sampled (the last generated token is never fed,
which saves a step and makes no difference to the text). At most ``ctx - prompt - 1`` tokens are
generated, as ds4 does.

Events. ``kind`` is "reasoning", "content" or "tool_call" for generated text (one event per
generated token, ``text`` possibly empty when UTF-8 or a stop string holds a piece back; all these
pieces join to ``result.text``, the raw generated text the CLI prints), "notice" (a one-line
message, e.g. the Think Max fallback), "cache" (a disk KV cache report: hit, save, refusal; one
event per report) and finally "done" (``finish_reason``, ``stats``, ``result``). The kind of a
text piece is a streaming guess from ds4's own markers (inside ``<think>``, inside a tool block);
``result.reasoning`` / ``content`` / ``tool_calls`` are the authoritative parse of the whole text.

For API servers, each text event also carries ``deltas``: what ``chat.dsml_stream.DsmlStreamParser``
made of the text so far (clean ``ReasoningDelta`` / ``ContentDelta`` without the think tags,
``ToolCallStart`` / ``ToolCallArgumentsDelta`` / ``ToolCallEnd``; the parser holds back text that
may still be a delimiter, so deltas lag the raw text a little; the rest, and its ``StreamEnd``,
come on the "done" event). A text event at which a tool call closed has ``tool_call`` set
(``IndexedToolCall``); several calls closing at once give extra empty-text "tool_call" events.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from ds4_mlx.chat.dsml_stream import DsmlStreamParser, StreamEnd, ToolCallEnd
from ds4_mlx.chat.messages import ToolCall
from ds4_mlx.chat.template import DEFAULT_SYSTEM, THINK_CLOSE, THINK_OPEN, ThinkMode
from ds4_mlx.engine.sampling import SamplingParams, XorShiftRng, argmax, sample, token_logprob, top_logprobs
from ds4_mlx.errors import InferenceError
from ds4_mlx.tokenizer.utf8_stream import Utf8StreamDecoder

MAX_LOGPROBS = 128  # ds4's cap on --dump-logprobs alternatives


class GenerationError(InferenceError):
    """Arguments to ``generate`` / ``stream_generate`` that cannot be run (wrong type or range,
    a prompt that does not fit the context)."""


class _Cancelled(Exception):
    """Raised from the prefill hook to abandon a prefill when the caller cancels."""


@dataclass(frozen=True)
class TokenLogprob:
    """One candidate token: id, its text (UTF-8, U+FFFD for half a character), raw bytes, logprob
    (float32-rounded log-softmax, as ds4) and raw logit."""

    id: int
    text: str
    bytes: bytes
    logprob: float
    logit: float


@dataclass(frozen=True)
class IndexedToolCall:
    """A parsed tool call and its 0-based position among this generation's calls."""

    index: int
    name: str
    arguments: str                  # JSON object text (compact, as ds4 sends it)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens whose state was reused (session or disk), not computed
    cache_source: str = "none"      # where they came from: none | live | snapshot | disk-tokens | disk-text
    generation_tokens: int = 0
    reasoning_tokens: int = 0       # generated while the reasoning section was open (its ``</think>`` included)
    load_time_s: float = 0.0        # the model's open time (``Engine.load_time``)
    prefill_s: float = 0.0
    ttft_s: float | None = None     # call start to first generated token (None: no token)
    decode_s: float = 0.0
    peak_rss_bytes: int = 0         # process RSS high-water mark
    peak_mlx_bytes: int = 0         # mx.get_peak_memory()
    think: str = "none"             # the thinking mode in effect
    draft: str = "none"             # the drafter of speculative decoding in effect (its class), or "none"
    drafted_tokens: int = 0         # draft tokens the target verified
    accepted_tokens: int = 0        # of them, those the target's own choice agreed with (and fed)
    verify_steps: int = 0           # batched verify steps run
    notices: list[str] = field(default_factory=list)  # one-line notices (Think Max fallback, ...)
    cache: list[str] = field(default_factory=list)    # disk KV cache reports, one line each
    # The bounded device expert cache (``model.expert_cache``; None without one): per accessed
    # expert of a layer call, hits and misses, and bytes read from the file, in the decode phase
    # (``expert_*``) and the prefill (``expert_prefill_*``)
    expert_hits: int | None = None
    expert_misses: int | None = None
    expert_bytes_read: int | None = None
    expert_prefill_misses: int | None = None
    expert_prefill_bytes_read: int | None = None

    @property
    def expert_hit_rate(self) -> float | None:
        """Decode hits / accesses of the bounded expert cache; None without one (or no access)."""
        n = (self.expert_hits or 0) + (self.expert_misses or 0)
        return self.expert_hits / n if n else None

    @property
    def expert_bytes_per_token(self) -> float | None:
        """Bytes of routed experts read from the file per generated token (decode)."""
        if self.expert_bytes_read is None or not self.generation_tokens:
            return None
        return self.expert_bytes_read / self.generation_tokens

    @property
    def completion_tokens(self) -> int:
        """``generation_tokens`` under its OpenAI name."""
        return self.generation_tokens

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def prefill_tps(self) -> float | None:
        """Prompt tokens computed per second; None when nothing was computed."""
        n = self.computed_tokens
        return n / self.prefill_s if n > 0 and self.prefill_s > 0 else None

    @property
    def acceptance(self) -> float | None:
        """accepted / drafted tokens; None when nothing was drafted."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def decode_tps(self) -> float:
        n = self.generation_tokens
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def summary(self) -> str:
        """The one-line report the CLI prints."""
        tps = self.prefill_tps
        prefill = (f"{tps:.2f} t/s" if tps is not None else
                   f"all {self.prompt_tokens} prompt tokens cached" if self.prompt_tokens else "0 tokens")
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s:.2f} s"
        spec = ""
        if self.draft != "none":
            acc = self.acceptance
            spec = (f"draft: {self.accepted_tokens}/{self.drafted_tokens} accepted "
                    f"({'-' if acc is None else f'{100 * acc:.0f} %'}, {self.verify_steps} verify steps), ")
        return (f"prompt: {self.prompt_tokens} tokens ({self.cached_tokens} cached), prefill: {prefill}, "
                f"generation: {self.decode_tps:.2f} t/s ({self.generation_tokens} tokens), {spec}"
                f"load: {self.load_time_s:.2f} s, ttft: {ttft}, "
                f"peak memory: {self.peak_rss_bytes / 2**20:.0f} MiB RSS, {self.peak_mlx_bytes / 2**20:.0f} MiB MLX"
                + self._expert_summary())

    def _expert_summary(self) -> str:
        if self.expert_hits is None:
            return ""
        rate, per = self.expert_hit_rate, self.expert_bytes_per_token
        return (f", experts cache: decode {'-' if rate is None else f'{100 * rate:.1f} %'} hits, "
                f"{'-' if per is None else f'{per / 2**20:.2f} MiB'} read/token, "
                f"prefill {(self.expert_prefill_bytes_read or 0) / 2**20:.0f} MiB read")


@dataclass(frozen=True)
class GenerationResult:
    text: str                       # the raw generated text (reasoning, tags, content, DSML)
    reasoning: str | None           # None when no ``</think>`` closed a reasoning section
    content: str
    tool_calls: tuple[ToolCall, ...]
    tokens: list[int]               # generated token ids (EOS excluded)
    finish_reason: str              # stop | length | tool_calls | cancelled | error
    stats: GenerationStats
    prompt_tokens: list[int] = field(default_factory=list, repr=False)
    raw_dsml: str | None = None     # the exact sampled tool block (what ds4 replays in a later request)
    error: str | None = None        # why, when finish_reason is "error"


@dataclass(frozen=True)
class GenerationEvent:
    kind: str                       # reasoning | content | tool_call | notice | cache | done
    text: str = ""
    token: int | None = None
    logprob: float | None = None
    top_logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "done" only
    stats: GenerationStats | None = None  # "done" only
    result: GenerationResult | None = None  # "done" only
    report: object = None           # "cache": the DiskCache report object (SaveResult / SyncReport)
    deltas: tuple = ()              # text and done events: DsmlStreamParser events (see module docstring)
    tool_call: IndexedToolCall | None = None


# ------------------------------------------------------------------------------------------------
# argument checks


def _int_arg(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise GenerationError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise GenerationError(f"{name} must be {rng}, got {value}")
    return int(value)


def _float_arg(name: str, value, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise GenerationError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        raise GenerationError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}")
    return v


def _stop_arg(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise GenerationError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(items)


def _cancel_check(cancel) -> Callable[[], bool]:
    if cancel is None:
        return lambda: False
    if hasattr(cancel, "is_set"):
        return cancel.is_set
    if callable(cancel):
        return lambda: bool(cancel())
    raise GenerationError(f"cancel must be a callable or an Event, got {type(cancel).__name__}")


def _prompt_ids(model, prompt, *, raw: bool, system, think, tools, ctx: int) -> list[int]:
    n_vocab = model.config.n_vocab
    if isinstance(prompt, str):
        if not prompt and raw:
            raise GenerationError("the prompt is empty")
        if raw or tools is None:
            return model.encode_prompt(prompt, raw=raw, system=system, think=think, ctx=ctx)
        return model.apply_chat_template(prompt, tools, think=think, system=system, ctx=ctx)
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise GenerationError(f"a token array prompt must be 1-D integers, got {prompt.dtype} {prompt.shape}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise GenerationError(f"prompt must be a string, a list of messages or a list of token ids, "
                              f"got {type(prompt).__name__}")
    if not prompt:
        raise GenerationError("the prompt is empty")
    if all(isinstance(m, Mapping) for m in prompt):
        return model.apply_chat_template(list(prompt), tools, think=think, system=system, ctx=ctx)
    ids = []
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise GenerationError(f"prompt[{i}] is {type(t).__name__}: a prompt list must hold only token ids "
                                  f"or only message objects")
        if not 0 <= t < n_vocab:
            raise GenerationError(f"prompt token id {t} at index {i} is outside the vocabulary 0..{n_vocab - 1}")
        ids.append(int(t))
    return ids


def _starts_in_reasoning(model, ids: list[int]) -> bool:
    """Whether generation continues inside ``<think>``: the prompt's last think tag is an opening one."""
    open_id = model.tokenizer.token_to_id(THINK_OPEN)
    close_id = model.tokenizer.token_to_id(THINK_CLOSE)
    for t in reversed(ids):
        if t == open_id:
            return True
        if t == close_id:
            return False
    return False


# ------------------------------------------------------------------------------------------------
# stop strings


class _StopFilter:
    """Holds back text that may begin a stop string; cuts the text at the first stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.buf = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.buf += text
        hits = [k for k in (self.buf.find(s) for s in self.stops) if k >= 0]
        if hits:
            out, self.buf = self.buf[:min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.buf)), hold, -1):
                if self.buf.endswith(s[:n]):
                    hold = n
                    break
        out = self.buf[:len(self.buf) - hold]
        self.buf = self.buf[len(self.buf) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


# ------------------------------------------------------------------------------------------------
# the loop


def _token_logprob(tokenizer, score) -> TokenLogprob:
    raw = tokenizer.token_text(score.id)
    return TokenLogprob(score.id, raw.decode("utf-8", errors="replace"), raw, score.logprob, score.logit)


def peak_rss_bytes() -> int:
    """The process's peak resident set in bytes (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def expert_counters(engine) -> tuple[int, int, int] | None:
    """(hits, misses, bytes read) of the model's bounded expert cache so far; None without one."""
    cache = getattr(engine.network, "expert_cache", None)
    if cache is None:
        return None
    c = cache.counters()
    return c.hits, c.misses, c.bytes_read


def save_line(res) -> str:
    """The one line a disk-cache save (``SaveResult``) is reported with."""
    if res.stored:
        return f"kv cache stored {res.tokens} tokens ({res.reason}) in {res.path}"
    return f"kv cache store {res.status} ({res.reason}, {res.tokens} tokens): {res.detail}"


def sync_report_lines(report) -> list[tuple[str, object]]:
    """(line, object) for what a ``DiskCache.sync`` did: refusals, the hit, the saves."""
    out: list[tuple[str, object]] = [(f"kv cache refused {why}", report) for why in report.refused]
    if report.hit_path is not None:
        by = report.source.removeprefix("disk-")
        out.append((f"kv cache hit: {report.cached_tokens} tokens ({by}) from {report.hit_path}", report))
    out += [(save_line(res), res) for res in report.saved]
    return out


def stream_generate(model, prompt, *, max_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
                    min_p: float = 0.05, top_k: int = 0, seed: int | None = None, think=True,
                    system: str | None = DEFAULT_SYSTEM, raw: bool = False, stop=None, tools=None,
                    session=None, logprobs: int = 0, progress: Callable[[int, int, float], None] | None = None,
                    ctx: int | None = None, kv_cache=None, kv_cache_save_on_exit: bool = False,
                    cancel=None, tool_choice=None, logits_processors=None, draft=None,
                    draft_k: int | None = None) -> Iterator[GenerationEvent]:
    """Generate from ``prompt`` and yield events (see the module docstring).

    ``model``: ``ds4_mlx.load(...)``. ``prompt``: a string (ds4's CLI chat template, or tokenized
    as given with ``raw=True`` or when it starts with the BOS marker), a list of OpenAI-style
    messages (``Engine.apply_chat_template``), or a list of token ids (used as is).
    ``temperature`` 0 is greedy; ``seed`` None or 0 is time-based. ``think``: True (the
    checkpoint's default level: high on the preview, low on 0731)/False/"none"/"low"/"high"/"max"
    (the top level needs ctx >= 393216, else a notice and high). ``stop``: strings
    that end the generation (not included in the text). ``tools``: OpenAI tool schemas; a closed
    tool block then ends the generation with finish "tool_calls", and DSML markup is sampled
    greedily as ds4-server does; ``tool_choice="none"`` drops them (OpenAI's meaning; a request
    renderer may also use it for the prompt). ``session``: continue in this ``Session`` (it syncs to the new
    prompt, reusing the shared prefix; one that already holds exactly the prompt is used as it is);
    else a fresh one of ``ctx`` tokens. ``logprobs``: top-k
    alternatives per token (0 = none). ``progress(done, total, tokens_per_s)``: called after each
    prefill chunk. ``kv_cache``: a ``DiskCache`` to sync through and save into.
    ``cancel``: a callable or ``threading.Event`` checked before every token and prefill chunk;
    cancelling (or KeyboardInterrupt inside the loop) ends with finish "cancelled".
    ``logits_processors``: callables ``fn(generated_ids, logits) -> logits`` (as mlx-lm's, on
    float32 numpy logits) applied in order before each token is chosen; they constrain decoding
    (a forced prefix, a tool_choice) and never run when absent, so the numerics are unchanged.
    ``draft``: speculative decoding (``engine/speculative.py``) with this ``Drafter`` (or a draft
    model path); None: the drafter ``ds4_mlx.load(..., draft=...)`` attached to the model, if any;
    False: none. ``draft_k``: the most drafts per verify step (default: the model's, else 4). The
    output is the one plain decoding gives (bit for bit in ds4-cpu numerics, at any temperature).
    """
    from ds4_mlx.engine.engine import Engine, as_think_mode

    t_start = time.perf_counter()
    if not isinstance(model, Engine):
        raise GenerationError(f"model must be the object ds4_mlx.load() returns, got {type(model).__name__}")
    max_tokens = _int_arg("max_tokens", max_tokens, 0)
    temperature = _float_arg("temperature", temperature, 0.0, 1e6)
    top_p = _float_arg("top_p", top_p, 0.0, 1.0, lo_open=True)
    min_p = _float_arg("min_p", min_p, 0.0, 1.0)
    top_k = _int_arg("top_k", top_k, 0, 1024)
    seed = 0 if seed is None else _int_arg("seed", seed, 0, 2**64 - 1)
    logprobs = _int_arg("logprobs", logprobs, 0, MAX_LOGPROBS)
    stops = _stop_arg(stop)
    cancelled = _cancel_check(cancel)
    processors = tuple(logits_processors or ())
    if not all(callable(f) for f in processors):
        raise GenerationError("logits_processors must be a list of callables fn(generated_ids, logits)")
    if progress is not None and not callable(progress):
        raise GenerationError(f"progress must be callable, got {type(progress).__name__}")
    if system is not None and not isinstance(system, str):
        raise GenerationError(f"system must be a string or None, got {type(system).__name__}")
    as_think_mode(think)  # a bad value fails before a session is made
    if tool_choice == "none":
        tools = None
    from ds4_mlx.engine.speculative import DEFAULT_DRAFT_K, Speculator, check_draft_k, resolve_drafter

    drafter = None if draft is False else resolve_drafter(getattr(model, "drafter", None) if draft is None
                                                          else draft, model)
    if draft_k is None:
        draft_k = getattr(model, "draft_k", None) or DEFAULT_DRAFT_K
    draft_k = check_draft_k(draft_k)
    if session is None:
        session = model.new_session(ctx)
    else:
        from ds4_mlx.engine.session import Session

        if not isinstance(session, Session):
            raise GenerationError(f"session must be a Session (model.new_session()), got {type(session).__name__}")
        if session.model is not model.network:
            raise GenerationError("the session belongs to another model")
        if ctx is not None and ctx != session.ctx:
            raise GenerationError(f"ctx={ctx} differs from the session's ctx {session.ctx}")
    ctx = session.ctx
    effective = model.effort(think, ctx)  # the checkpoint's level for ``think`` at this context
    ids = _prompt_ids(model, prompt, raw=raw, system=system, think=effective, tools=tools, ctx=ctx)
    if len(ids) >= ctx:
        raise GenerationError(f"prompt of {len(ids)} tokens does not fit ctx {ctx} (at most {ctx - 1})")

    stats = GenerationStats(prompt_tokens=len(ids), load_time_s=model.load_time, think=effective.value)
    if effective.downgraded:
        stats.notices.append(f"Think Max (level {effective.requested.value}) needs ctx >= 393216 (ctx is {ctx}): "
                             f"using level {effective.value}")
        yield GenerationEvent("notice", stats.notices[-1])

    tokenizer = model.tokenizer
    finish = None
    eos_event: GenerationEvent | None = None
    generated: list[int] = []
    pieces: list[str] = []

    # -- prefill (sync) --
    def on_prefill(done: int, total: int) -> None:
        if progress is not None:
            dt = time.perf_counter() - t_prefill
            progress(done, total, done / dt if dt > 0 else 0.0)
        if cancelled():
            raise _Cancelled

    import mlx.core as mx

    previous_hook = session.on_prefill
    session.on_prefill = on_prefill
    experts0 = expert_counters(model)
    t_prefill = time.perf_counter()
    try:
        plan = session.plan(ids)
        if plan.source == "live" and plan.computed == 0:
            # already at the prompt (a server's session pool brought it there): no second sync. The
            # disk cache's part of a live sync with nothing to compute is its continued-save check.
            stats.cached_tokens, stats.cache_source = len(ids), "live"
            res = kv_cache.after_eval(session) if kv_cache is not None else None
            cache_events = [] if res is None else [(save_line(res), res)]
        elif kv_cache is not None:
            report = kv_cache.sync(session, ids)
            ids, stats.cached_tokens = list(report.effective_prompt), report.cached_tokens
            stats.prompt_tokens = len(ids)
            stats.cache_source = report.source if report.cached_tokens else "none"
            cache_events = sync_report_lines(report)
        else:
            synced = session.sync(ids)
            stats.cached_tokens = synced.reused
            stats.cache_source = synced.source if synced.reused else "none"
            cache_events = []
    except (_Cancelled, KeyboardInterrupt):
        finish, cache_events = "cancelled", []
    finally:
        session.on_prefill = previous_hook
    stats.prefill_s = time.perf_counter() - t_prefill
    experts1 = expert_counters(model)
    if experts1 is not None:
        stats.expert_prefill_misses = experts1[1] - experts0[1]
        stats.expert_prefill_bytes_read = experts1[2] - experts0[2]
    for line, rep in cache_events:
        stats.cache.append(line)
        yield GenerationEvent("cache", line, report=rep)

    # -- decode --
    room = ctx - len(ids)
    limit = 0 if room <= 1 else min(max_tokens, room - 1)
    params = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k)
    rng = XorShiftRng(seed or None)
    decoder = Utf8StreamDecoder(tokenizer)
    parser = DsmlStreamParser(_starts_in_reasoning(model, ids))
    stopper = _StopFilter(stops)
    eos = model.eos_id

    n_calls = 0
    spec = None
    kv_reports: list = []
    if drafter is not None and finish is None:
        boundaries = ()
        if kv_cache is not None:
            from ds4_mlx.engine.kvstore_policy import continued_step

            boundaries = (continued_step(kv_cache.options),)

        def after_feed(s) -> None:
            if kv_cache is not None:
                res = kv_cache.after_eval(s)
                if res is not None:
                    kv_reports.append(res)

        spec = Speculator(session, drafter, draft_k, boundaries=boundaries, on_commit=after_feed)
        stats.draft = type(drafter).__name__

    def emit(text: str, token: int | None, lp=None, top=()) -> list[GenerationEvent]:
        nonlocal n_calls
        was_inside = parser.markers.thinking.inside
        had_end = parser.saw_tool_end
        deltas = ()
        if text:
            pieces.append(text)
            deltas = tuple(parser.feed(text))
        kind = ("reasoning" if was_inside else
                "tool_call" if parser.saw_tool_start and not had_end else "content")
        calls = []
        for d in deltas:
            if isinstance(d, ToolCallEnd):
                calls.append(IndexedToolCall(n_calls, d.call.name, d.call.arguments))
                n_calls += 1
        first = GenerationEvent("tool_call" if calls else kind, text, token, lp, top, deltas=deltas,
                                tool_call=calls[0] if calls else None)
        return [first] + [GenerationEvent("tool_call", tool_call=c) for c in calls[1:]]

    t_decode = time.perf_counter()
    try:
        while finish is None:
            if cancelled():
                finish = "cancelled"
                break
            if len(generated) >= limit:
                finish = "length"
                break
            logits = spec.logits() if spec is not None else session.logits()
            for fn in processors:
                logits = fn(generated, logits)
            greedy = params.greedy or (tools is not None and parser.in_structural_syntax())
            token = argmax(logits) if greedy else sample(logits, params, rng)
            lp, top = None, ()
            if logprobs:
                scores = top_logprobs(logits, logprobs)
                top = tuple(_token_logprob(tokenizer, s) for s in scores)
                lp = next((s.logprob for s in scores if s.id == token), None)
                if lp is None:
                    lp = token_logprob(logits, token).logprob
            if token == eos:
                finish = "stop"
                eos_event = GenerationEvent("done", "", token, lp, top)
                break
            generated.append(token)
            if parser.markers.thinking.inside:  # before this token's text reaches the parser
                stats.reasoning_tokens += 1
            if stats.ttft_s is None:
                stats.ttft_s = time.perf_counter() - t_start
            text, hit = stopper.feed(decoder.feed(token))
            yield from emit(text, token, lp, top)
            if hit:
                finish = "stop"
                break
            if tools is not None and parser.saw_tool_end:
                finish = "tool_calls"
                break
            if len(generated) >= limit:
                finish = "length"
                break
            if spec is not None:
                spec.feed(token, limit - len(generated))
            else:
                session.eval(token)
                if kv_cache is not None:
                    res = kv_cache.after_eval(session)
                    if res is not None:
                        kv_reports.append(res)
            for res in kv_reports:
                stats.cache.append(save_line(res))
                yield GenerationEvent("cache", stats.cache[-1], report=res)
            kv_reports.clear()
    except KeyboardInterrupt:
        finish = "cancelled"
    finally:
        if spec is not None:  # whatever ended the loop: the session keeps only the fed tokens
            spec.finish()
            stats.drafted_tokens, stats.accepted_tokens = spec.stats.drafted, spec.stats.accepted
            stats.verify_steps = spec.stats.verifies
    stats.decode_s = time.perf_counter() - t_decode
    stats.generation_tokens = len(generated)
    experts2 = expert_counters(model)
    if experts2 is not None:
        stats.expert_hits, stats.expert_misses, stats.expert_bytes_read = (
            b - a for a, b in zip(experts1, experts2))

    # -- end --
    tail, hit = stopper.feed(decoder.flush())
    if hit and finish != "cancelled":
        finish = "stop"
    if not hit:
        tail += stopper.flush()
    if tail:
        yield from emit(tail, None)
    if kv_cache is not None and kv_cache_save_on_exit:
        res = kv_cache.close(session)
        if res is not None:
            stats.cache.append(save_line(res))
            yield GenerationEvent("cache", stats.cache[-1], report=res)
    final_deltas = tuple(parser.finish())
    message = [e for e in final_deltas if isinstance(e, StreamEnd)][-1].message
    error = None
    if finish == "stop" and not message.ok:
        finish = "error"  # a tool block started and never closed (ds4-server's finish "error")
        error = "the generated tool call block is malformed or unterminated"
    elif finish == "stop" and message.tool_calls:
        finish = "tool_calls"
    stats.peak_rss_bytes = peak_rss_bytes()
    stats.peak_mlx_bytes = int(mx.get_peak_memory())
    result = GenerationResult(text="".join(pieces), reasoning=message.reasoning, content=message.content,
                              tool_calls=tuple(message.tool_calls), tokens=generated, finish_reason=finish,
                              stats=stats, prompt_tokens=ids, raw_dsml=message.raw_dsml, error=error)
    base = eos_event or GenerationEvent("done")
    yield GenerationEvent("done", "", base.token, base.logprob, base.top_logprobs, finish, stats, result,
                          deltas=final_deltas)


def generate(model, prompt, **kwargs) -> GenerationResult:
    """Run ``stream_generate`` to the end and return its result (same arguments)."""
    result = None
    for event in stream_generate(model, prompt, **kwargs):
        if event.kind == "done":
            result = event.result
    return result
