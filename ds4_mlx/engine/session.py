"""The inference session (``ds4_mlx.Session``): a token history and the model state that continues it exactly.

The one session class: it holds the live ``ModelCache``, runs the network's chunked prefill,
compiled one-token decode and speculative verify on it, and adds sync, rewind, snapshots, payload
files and next-token scoring. Get one from ``ds4_mlx.load(path).new_session(ctx=...)``;
``Session(network, ctx)`` drives a bare network (``ds4_mlx.load(path).network``) the same way.

``sync(tokens)`` brings the live state to exactly that prefix (ds4_session_sync, with snapshots).
``plan(tokens)`` says how, without doing it (``SyncPlan``); ``sync`` executes that plan, and the
callers that bring a session to a prompt in their own steps (``DiskCache``, ``SessionPool``) ask
it too, so the choice below is made in this one place:

* the live tokens are a prefix of the target: only the suffix is computed. A suffix shorter than
  ``resume_prefill_min`` tokens is decoded token by token, a longer one is prefilled in chunks whose
  ends fall on absolute multiples of ``chunk`` (as a cold prefill of the whole would), so resuming
  from a chunk-aligned length executes exactly the chunks a cold prefill executes from there;
* the target diverges inside the live tokens (or is shorter): compressed state cannot be rewound
  in place (a compressed row or a compressor frontier mixes tokens on both sides of any cut), so
  the session restores the longest snapshot whose tokens are a prefix of the target and computes
  the rest from it, or, with none, rebuilds from token 0. ``allow_rebuild=False`` raises
  ``RebuildNeeded`` instead of rebuilding (ds4's REBUILD_NEEDED; a server can then try its disk
  cache first).

Forward. One chunk loop: prefill chunks replace the live cache with the cache after the chunk
(``Model.forward_chunk``). In DEFAULT numerics a one-token feed (a decode step, or a one-token
suffix) runs the compiled decode step (``Model.step``) on the live cache, updated in place; its
new arrays stay lazy, tied to its logits, so the caller's one read of the logits evaluates both
(one host sync per decoded token), and a step whose logits nobody read is evaluated before the
next feed or snapshot, so a run of unread steps never grows one long lazy graph. ``compile=False``
keeps every feed on the chunk path; its default is the load's (``LoadPlan.compile``, the
``DS4_MLX_COMPILE`` variable read once at load; on for a network built without the loader);
ds4-cpu numerics never compile (``compiled`` is then False whatever was asked). A prefill chunk
of ``TRIM_AFTER_TOKENS`` or more leaves GiBs of freed temporaries in the heap: they are given back.

Snapshots. ``snapshot()`` is O(1) (``ModelCache.copy``: the arrays are shared, never written in
place); it holds that cache's buffers alive: the raw rings and frontiers plus the compressed-row
buffers, sized by the cache's power-of-two capacity (at least 4096 tokens, so up to 2x the rows
written so far; spec §9.2, ≈ 13.8 KB per token on the real model). ``Snapshot.nbytes`` counts the
saved (canonical) size. The session keeps two pools it searches on divergence:
the last ``auto_checkpoints`` states at chunk boundaries (free to take: prefill reaches them
anyway, and restoring one then prefilling is bit-identical to a cold prefill), and up to
``kept_checkpoints`` snapshots taken with ``snapshot(keep=True)`` (e.g. the end of a prompt, before
generation, so that a rewrite of the generated tail restores it instead of rebuilding).

``rewind(pos)`` costs one restore plus the prefill of ``pos - s`` tokens, s the longest kept or
automatic snapshot at or before ``pos`` on this history (0: a full re-prefill of ``pos`` tokens).

Crossover. ``resume_prefill_min`` = 2 is measured on this machine's MLX CPU backend with the
oracle's tiny model (``benchmarks/bench_session_restore.py --crossover``): one chunk of m tokens
costs less than m one-token steps from m = 2 on, in both numerics modes (ds4 measured 4 on
Metal). Its default is the load's (``LoadPlan.resume_prefill_min``: ``DS4_MLX_RESUME_PREFILL_MIN``
read once at load, like ds4's ``DS4_METAL_RESUME_PREFILL_MIN``; a session opened later follows the
load, not the variable). A one-token step *is* a one-token chunk here, so below the crossover the
two paths are the same computation; the value matters for speed only.

Speculative decoding (``engine/speculative.py``): ``verify(tokens)`` feeds a drafted chunk and keeps
the state before it, ``commit(n)`` keeps its first n tokens (``ModelCache.rollback``: exact, no
recomputation). In between the session refuses snapshots, payloads and feeds, so no saved state ever
holds a draft token.

Across ranks (``distributed="pipeline"``): snapshots, checkpoints and several sessions work as in
one process (each rank keeps its part of every state rank 0 still holds, ``model.distributed``),
and a payload gathers every rank's layers, so its file is the one a single process writes.

Equality. Restoring a snapshot or a payload gives the saved arrays bit for bit, so a restored
session continues exactly as the one that never stopped. Against a *cold* prefill: in the
``ds4-cpu`` numerics every chunking gives identical bits; in the ``default`` numerics a resume is
bit-identical when it starts at a chunk-aligned length, and otherwise differs from cold by the
rounding of differently shaped BLAS matmuls, amplified a little by FP8 rounding flips (tiny model,
300 tokens: logit rms 3e-4 .. 9e-4 against logits of std 1, max up to 0.04 seen; the oracle
README measures rms 0.03 between two builds of ds4 itself). ds4 makes the same trade on Metal and therefore saves disk
checkpoints only at chunk-aligned lengths; ``kvstore_policy`` keeps that rule.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import mlx.core as mx
import numpy as np

from ds4_mlx import allocator
from ds4_mlx.engine import payload as payload_format
from ds4_mlx.engine.payload import PayloadError
from ds4_mlx.engine.sampling import SamplingParams, TokenScore, XorShiftRng, argmax, sample, token_logprob, top_logprobs
from ds4_mlx.errors import InferenceError
from ds4_mlx.model.cache import ModelCache
from ds4_mlx.model.host import to_host
from ds4_mlx.model.load_plan import RESUME_PREFILL_MIN  # the default of a network built without the loader

DEFAULT_CHUNK = 2048
# A prefill chunk at least this long leaves GiBs of freed temporaries in the (tuned) heap: give them back.
TRIM_AFTER_TOKENS = 256


class RebuildNeeded(InferenceError):
    """``sync(..., allow_rebuild=False)``: neither the live state nor a snapshot covers the target
    far enough to avoid recomputing it from token 0. The session is unchanged."""


@dataclass(frozen=True, eq=False)
class Snapshot:
    """A restorable session state: the token history, the model state after it, the logits."""

    tokens: tuple[int, ...]
    state: ModelCache
    logits: mx.array | None

    @property
    def pos(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        """Bytes of the state as serialised (canonical arrays) plus the logits."""
        return self.state.state_nbytes + (0 if self.logits is None else self.logits.nbytes)


@dataclass(frozen=True)
class SyncStats:
    """What a ``sync`` / ``rewind`` did. ``reused``: tokens whose state was taken as is (from the
    live session or a snapshot); ``computed``: tokens run through the model; ``source``: "live",
    "snapshot" or "cold"; ``path``: "none", "decode" or "prefill"."""

    reused: int
    computed: int
    source: str
    path: str


@dataclass(frozen=True, eq=False)
class SyncPlan:
    """How ``sync`` would reach a target (``Session.plan``), decided without touching the state.

    ``source``: "live" (the live tokens, a non-empty prefix of the target, are kept), "snapshot"
    (``snapshot``, the longest one whose tokens are a prefix of the target, is restored) or "cold"
    (from token 0; ``rebuild`` when that discards live tokens, which ``allow_rebuild=False``
    refuses). ``reused`` target tokens are taken as is, ``computed`` run through the model."""

    source: str
    reused: int
    computed: int
    snapshot: Snapshot | None = None
    rebuild: bool = False


def plan_sync(live: Sequence[int], snapshots: Iterable[Snapshot], target: Sequence[int]) -> SyncPlan:
    """The sync decision over token lists alone (``Session.plan`` applies it to its live tokens and
    its snapshot pools): the live tokens when they are a prefix of the target, else the longest
    snapshot that is, else token 0."""
    n = min(len(live), len(target))
    common = 0
    while common < n and live[common] == target[common]:
        common += 1
    if common == len(live):
        return SyncPlan("live" if common else "cold", common, len(target) - common)
    best = None
    for snap in snapshots:
        k = snap.pos
        if 0 < k <= len(target) and (best is None or k > best.pos) and list(snap.tokens) == list(target[:k]):
            best = snap
    if best is not None:
        return SyncPlan("snapshot", best.pos, len(target) - best.pos, best)
    return SyncPlan("cold", 0, len(target), rebuild=True)


@dataclass(frozen=True)
class _Verify:
    """A speculative verify not yet committed: the cache mark before it, the tokens before it, its
    logits [L, n_vocab]."""

    mark: ModelCache
    n0: int
    logits: mx.array


class Session:
    """``model``: ``ds4_mlx.load(p)`` or its network (``ds4_mlx.model.transformer.Model``).

    ``on_prefill``: optional ``callable(done, total)`` called after each prefill chunk of a
    ``sync`` / ``append`` / ``rewind`` (``done`` of the ``total`` tokens that call computes); it
    observes only, the chunks are the same with or without it. ``compile`` / ``resume_prefill_min``
    (None: the load's, see the module docstring) and the checkpoint pools are per session.
    """

    def __init__(self, model, ctx: int, *, chunk: int = DEFAULT_CHUNK, model_id: bytes | None = None,
                 resume_prefill_min: int | None = None, auto_checkpoints: int = 2,
                 kept_checkpoints: int = 4, compile: bool | None = None):
        # ds4_mlx.load()'s object works as well as its network; it is kept because it computes the
        # model id (a read of ~80 MB on the real model) once for all its sessions.
        self._engine = model if hasattr(model, "network") else None
        model = getattr(model, "network", model)
        if not hasattr(model, "forward_chunk"):
            raise InferenceError(f"Session needs a model from ds4_mlx.load(), got {type(model).__name__}")
        plan = getattr(model, "load_plan", None)  # None: a network built without the loader
        if resume_prefill_min is None:
            resume_prefill_min = plan.resume_prefill_min if plan is not None else RESUME_PREFILL_MIN
        if isinstance(resume_prefill_min, bool) or not isinstance(resume_prefill_min, int) or resume_prefill_min < 1:
            raise InferenceError(f"resume_prefill_min must be an integer >= 1, got {resume_prefill_min!r}")
        if auto_checkpoints < 0 or kept_checkpoints < 0:
            raise InferenceError("checkpoint pool sizes must be >= 0")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise InferenceError(f"prefill chunk size must be an integer >= 1, got {chunk!r}")
        if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 2:
            raise InferenceError(f"session ctx must be an integer >= 2, got {ctx!r}")
        max_ctx = model.config.context_length
        if ctx > max_ctx:
            raise InferenceError(f"ctx {ctx} is larger than the model's context length {max_ctx}")
        self.model = model
        self.config = model.config
        self.ctx = ctx
        self.chunk = chunk
        want = (plan.compile if plan is not None else True) if compile is None else bool(compile)
        self.compiled = want and model.ops.compilable
        self.on_prefill: Callable[[int, int], None] | None = None
        self._model_id = model_id
        self.resume_prefill_min = resume_prefill_min
        self.auto_checkpoints = auto_checkpoints
        self.kept_checkpoints = kept_checkpoints
        self._auto: list[Snapshot] = []
        self._kept: list[Snapshot] = []  # most recently used last
        # The live cache after ``pos`` tokens (a pipeline rank: its own layers only). Decode steps
        # update it in place: anything that must outlive the next feed takes ``copy()``.
        self.state: ModelCache = model.empty_cache()
        self._tokens: list[int] = []
        self._logits: mx.array | None = None
        self._lazy = False  # the last feed was a compiled step whose logits nobody read yet
        self._pending: _Verify | None = None

    # -- identity and position -----------------------------------------------------------------------

    @property
    def pos(self) -> int:
        return self.state.n_tokens

    @property
    def n_tokens(self) -> int:
        """Tokens the live state holds (same as ``pos``)."""
        return self.state.n_tokens

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def model_id(self) -> bytes:
        if self._model_id is None and self._engine is not None:
            self._model_id = self._engine.model_id
        if self._model_id is None:
            src = getattr(self.model, "source", None)
            if src is None:
                raise PayloadError("the model has no GGUF source to identify it; pass model_id")
            self._model_id = payload_format.model_fingerprint(src)
        return self._model_id

    def common_prefix(self, tokens: Sequence[int]) -> int:
        """Length of the longest common prefix of the live tokens and ``tokens``."""
        live = self._tokens
        n = min(len(live), len(tokens))
        i = 0
        while i < n and live[i] == tokens[i]:
            i += 1
        return i

    # -- moving the state ----------------------------------------------------------------------------

    def plan(self, tokens: Sequence[int], *, snapshots: bool = True) -> SyncPlan:
        """How ``sync(tokens)`` would reach ``tokens`` (module docstring): from the live tokens, a
        snapshot of the pools (``snapshots=False``: not considered, as a caller that searches its
        own store after the live state does) or token 0. Changes nothing."""
        self._no_pending()
        pools = self._auto + self._kept if snapshots else ()
        return plan_sync(self._tokens, pools, [int(t) for t in tokens])

    def sync(self, tokens: Sequence[int], *, allow_rebuild: bool = True) -> SyncStats:
        """Bring the live state to exactly ``tokens`` (0 < len < ctx): executes ``plan(tokens)``."""
        self._no_pending()
        target = self._check_tokens(tokens)
        if not target:
            raise InferenceError("sync needs at least one token")
        if len(target) >= self.ctx:
            raise InferenceError(f"prompt of {len(target)} tokens does not fit ctx {self.ctx} "
                                 f"(at most {self.ctx - 1})")
        return self._run(self.plan(target), target, allow_rebuild)

    def append(self, tokens: Sequence[int]) -> SyncStats:
        """Extend the live history by ``tokens`` (decode or aligned prefill, as in ``sync``)."""
        self._no_pending()
        suffix = self._check_tokens(tokens)
        self._check_room(len(suffix))
        path = self._extend(suffix)
        return SyncStats(self.pos - len(suffix), len(suffix), "live", path)

    def eval(self, token: int) -> None:
        """One decode step: feed ``token`` at position ``pos`` (``append([token])``, straight to the
        one feed: the decode loop's every token passes here)."""
        self._no_pending()
        self._check_room(1)
        self._feed(self._check_tokens([token]))

    def prefill(self, tokens: Sequence[int]) -> SyncStats:
        """Deprecated since 0.2 (removed in 0.3): ``append(tokens)``, which it always was; ``sync``
        brings the session to a whole prompt and reuses what it holds."""
        warnings.warn("Session.prefill(tokens) is deprecated and will be removed in ds4-mlx 0.3: use "
                      "Session.append(tokens) (extend the history) or Session.sync(prompt) (bring the "
                      "session to a whole prompt, reusing its prefix)", DeprecationWarning, stacklevel=2)
        return self.append(tokens)

    def rewind(self, pos: int, *, allow_rebuild: bool = True) -> SyncStats:
        """Go back to the exact state after the first ``pos`` live tokens (see the module docstring
        for the cost). ``pos == 0`` empties the session."""
        self._no_pending()
        if not 0 <= pos <= self.pos:
            raise InferenceError(f"cannot rewind to {pos}: the session holds {self.pos} tokens")
        if pos == self.pos:
            return SyncStats(pos, 0, "live", "none")
        if pos == 0:
            self.reset()
            return SyncStats(0, 0, "cold", "none")
        target = self.tokens[:pos]
        return self._run(self.plan(target), target, allow_rebuild)

    def reset(self) -> None:
        """Empty the live state (snapshot pools are kept)."""
        self._set(Snapshot((), self.model.empty_cache(), None))

    def _run(self, plan: SyncPlan, target: list[int], allow_rebuild: bool) -> SyncStats:
        """Execute ``plan`` (made for ``target`` on the current state)."""
        if plan.rebuild and not allow_rebuild:
            raise RebuildNeeded(f"rewriting behind the live end needs a rebuild: common="
                                f"{self.common_prefix(target)} live={self.pos} target={len(target)}, "
                                f"no snapshot covers it")
        if plan.snapshot is not None:
            if any(s is plan.snapshot for s in self._kept):  # most recently used last
                self._kept = [s for s in self._kept if s is not plan.snapshot] + [plan.snapshot]
            self._set(plan.snapshot)
        elif plan.rebuild:
            self.reset()
        path = self._extend(target[plan.reused:])
        return SyncStats(plan.reused, plan.computed, plan.source, path)

    def _extend(self, suffix: list[int]) -> str:
        """The one chunk loop: ``suffix`` decoded token by token below the crossover, else in chunks
        that end on absolute multiples of ``chunk``."""
        if not suffix:
            return "none"
        hook, total = self.on_prefill, len(suffix)
        if len(suffix) < self.resume_prefill_min:
            for t in suffix:
                self._feed([t])
            if hook is not None:
                hook(total, total)
            return "decode"
        i = 0
        while i < len(suffix):
            take = min(len(suffix) - i, self.chunk - self.pos % self.chunk)
            self._feed(suffix[i:i + take])
            i += take
            if hook is not None:
                hook(i, total)
        return "prefill"

    def _feed(self, tokens: list[int]) -> None:
        """One forward on the live state: the compiled step for one token (when compiled), else one
        chunk. Every chunk computes its logits: an automatic checkpoint at its end, or a sync
        abandoned there by ``on_prefill``, leaves a state whose logits are its own."""
        self._settle()
        if len(tokens) == 1 and self.compiled:
            logits = self.model.step(tokens[0], self.state, evaluate=False)
            self._logits = mx.depends([logits], self.state.arrays())[0]
            self._lazy = True
        else:
            self._logits, self.state = self.model.forward_chunk(np.asarray(tokens, dtype=np.int64), self.state,
                                                                want_logits=True)
        self._tokens.extend(tokens)
        if len(tokens) >= TRIM_AFTER_TOKENS:
            allocator.trim_heap()
        self._auto_checkpoint()

    def _settle(self) -> None:
        """Evaluate a decode step whose logits were never read (see ``_lazy``)."""
        if self._lazy:
            mx.eval(*self.state.arrays())
            self._lazy = False

    def _auto_checkpoint(self) -> None:
        if self.auto_checkpoints and self.pos % self.chunk == 0:
            _push(self._auto, self._capture(), self.auto_checkpoints)

    def _check_tokens(self, tokens: Sequence[int]) -> list[int]:
        if isinstance(tokens, np.ndarray) and tokens.ndim != 1:
            raise InferenceError(f"tokens must be a 1-D sequence of ids, got shape {tokens.shape}")
        out = [int(t) for t in tokens]
        n_vocab = self.config.n_vocab
        for i, t in enumerate(out):
            if not 0 <= t < n_vocab:
                raise InferenceError(f"token id {t} at index {i} is outside the vocabulary 0..{n_vocab - 1}")
        return out

    def _check_room(self, n: int) -> None:
        if self.pos + n > self.ctx:
            raise InferenceError(f"context overflow: {self.pos} + {n} tokens > ctx {self.ctx}")

    def append_with_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Extend the live history by ``tokens`` in one forward (not cut at chunk boundaries) and
        return the next-token logits after each of them, float32 [len, n_vocab]: teacher-forced
        scoring (``engine/perplexity.py``'s chunked path)."""
        self._no_pending()
        toks = self._check_tokens(tokens)
        if not toks:
            raise InferenceError("append_with_logits needs at least one token")
        self._check_room(len(toks))
        self._settle()
        rows, self.state = self.model.forward_chunk(np.asarray(toks, dtype=np.int64), self.state,
                                                    want_logits="all")
        out = to_host(rows, np.float32)
        self._tokens.extend(toks)
        self._logits = rows[-1]
        self._auto_checkpoint()
        return out

    # -- speculative verify ----------------------------------------------------------------------------

    def verify(self, tokens: Sequence[int], taps: Sequence[int] | None = None) -> tuple[mx.array, mx.array]:
        """Feed ``tokens`` (1 .. n_swa of them) as one speculative verify chunk: returns the logits of
        every position [L, n_vocab] and the target's last-block rows [L, n_hc, n_embd] (evaluated;
        ``taps``: those layers' HC-mean rows [L, len(taps), n_embd] instead, ``Model.forward_verify``).
        The session then holds all L tokens until ``commit(n)`` keeps the first n; until then it
        refuses snapshots, payloads and feeds, so no saved state ever holds a draft
        (``engine/speculative.py`` drives this)."""
        self._no_pending()
        toks = self._check_tokens(tokens)
        if not 1 <= len(toks) <= self.config.n_swa:
            raise InferenceError(f"a verify chunk holds 1..{self.config.n_swa} tokens, got {len(toks)}")
        self._check_room(len(toks))
        self._settle()
        mark, n0 = self.state.mark(), len(self._tokens)
        logits, H, self.state = self.model.forward_verify(np.asarray(toks, dtype=np.int64), self.state, taps)
        mx.eval(logits, H)
        self._pending = _Verify(mark, n0, logits)
        self._tokens.extend(toks)
        self._logits = logits[-1]
        return logits, H

    def commit(self, n: int) -> None:
        """Keep the first ``n`` tokens of the pending verify; the state is then exactly the one plain
        decoding of those tokens has (``ModelCache.rollback``: bit for bit in ds4-cpu numerics), with
        no recomputation. An automatic checkpoint is taken when the position lands on a chunk
        boundary, as a feed does."""
        v = self._pending
        if v is None:
            raise InferenceError("commit without a pending verify")
        L = len(self._tokens) - v.n0
        if not 1 <= n <= L:
            raise InferenceError(f"commit keeps 1..{L} tokens of the verify, got {n}")
        self.state.rollback(v.mark, v.n0 + n)
        del self._tokens[v.n0 + n:]
        self._logits = v.logits[n - 1]
        self._pending = None
        self._auto_checkpoint()

    @property
    def verify_pending(self) -> bool:
        return self._pending is not None

    def _no_pending(self) -> None:
        if self._pending is not None:
            raise InferenceError("a speculative verify is pending: commit it first")

    # -- snapshots -------------------------------------------------------------------------------------

    def _capture(self) -> Snapshot:
        if self._pending is not None:  # a snapshot never holds draft tokens
            raise InferenceError("a verify is pending: commit it before taking a snapshot")
        self._settle()
        return Snapshot(tuple(self._tokens), self.state.copy(), self._logits)

    def _set(self, snap: Snapshot) -> None:
        # a copy: the live cache is updated in place by decode steps, the snapshot must not be
        self.state, self._tokens, self._logits = snap.state.copy(), list(snap.tokens), snap.logits
        self._lazy = False  # a snapshot is taken settled
        self._pending = None  # a verify in flight is dropped with the state it was on

    def snapshot(self, *, keep: bool = False) -> Snapshot:
        """The live state, restorable with ``restore``. ``keep``: also remember it, so that ``sync``
        and ``rewind`` can restore it when a later target diverges after its end."""
        snap = self._capture()
        if keep and snap.pos > 0 and self.kept_checkpoints:
            _push(self._kept, snap, self.kept_checkpoints)
        return snap

    def restore(self, snap: Snapshot) -> None:
        """Make ``snap`` the live state (any session of the same model and a large enough ctx)."""
        if not isinstance(snap, Snapshot):
            raise InferenceError(f"restore needs a Snapshot, got {type(snap).__name__}")
        if snap.state.n_tokens != snap.pos or len(snap.state.layers) != self.config.n_layer:
            raise InferenceError(f"snapshot is inconsistent: {snap.pos} tokens, state of {snap.state.n_tokens} "
                                 f"tokens over {len(snap.state.layers)} layers")
        if snap.pos > self.ctx:
            raise InferenceError(f"snapshot of {snap.pos} tokens does not fit ctx {self.ctx}")
        self._set(snap)

    def checkpoints(self) -> list[int]:
        """Positions of the snapshots ``sync`` / ``rewind`` may restore (automatic and kept)."""
        return sorted({s.pos for s in self._auto + self._kept})

    def drop_checkpoints(self) -> None:
        self._auto, self._kept = [], []

    # -- next token ------------------------------------------------------------------------------------

    def logits(self) -> np.ndarray:
        """float32 [n_vocab]: next-token logits after the live tokens."""
        if self._logits is None:
            raise InferenceError("no logits yet: feed at least one token first")
        out = to_host(self._logits, np.float32)
        self._lazy = False  # the read evaluated the step's cache arrays with the logits
        return out

    def argmax(self) -> int:
        return argmax(self.logits())

    def sample(self, params: SamplingParams, rng: XorShiftRng) -> int:
        return sample(self.logits(), params, rng)

    def top_logprobs(self, k: int) -> list[TokenScore]:
        return top_logprobs(self.logits(), k)

    def token_logprob(self, token: int) -> TokenScore:
        return token_logprob(self.logits(), token)

    # -- payload ---------------------------------------------------------------------------------------

    def payload_chunks(self, snap: Snapshot | None = None) -> list[bytes | memoryview]:
        """The payload of the live state (or of ``snap``) as a list of buffers, for the KV store."""
        snap = self._capture() if snap is None else snap
        if snap.pos == 0 or snap.logits is None:
            raise PayloadError("nothing to save: the session holds no tokens")
        return payload_format.encode(
            self.config, model_id=self.model_id, ctx=self.ctx, chunk=self.chunk,
            numerics=getattr(getattr(self.model, "numerics", None), "value", "default"),
            tokens=snap.tokens, logits=to_host(snap.logits, np.float32),
            arrays=self._whole(snap.state).to_numpy())

    def _whole(self, state: ModelCache) -> ModelCache:
        # A pipeline's rank 0 holds its own layers only: the others' come from their ranks
        gather = getattr(self.model, "gather_state", None)
        return state if gather is None else gather(state)

    def payload_bytes(self) -> int:
        """Exact byte size ``save_payload`` would write now."""
        return payload_format.nbytes(self.payload_chunks())

    def save_payload(self, fp: BinaryIO, snap: Snapshot | None = None) -> int:
        """Write the payload to a binary file; returns the bytes written."""
        return payload_format.write(fp, self.payload_chunks(snap))

    def load_payload(self, src, size: int | None = None) -> int:
        """Replace the live state with a payload (a bytes-like object, or a binary file at its start;
        ``size`` bounds the read when the payload is followed by other data). Returns its token
        count. Raises PayloadError, leaving the session unchanged, when it does not fit here."""
        p = payload_format.decode(src, self.config, model_id=self.model_id, ctx=self.ctx, chunk=self.chunk,
                                  size=size)
        d = dict(p.arrays)
        d["n_tokens"] = np.array(len(p.tokens), dtype=np.int64)
        state = ModelCache.from_numpy(self.config, d)
        scatter = getattr(self.model, "scatter_state", None)
        if scatter is not None:  # a pipeline: every rank keeps its own layers of the loaded state
            state = scatter(state)
        self._set(Snapshot(tuple(p.tokens), state, mx.array(p.logits)))
        return len(p.tokens)

    def load_payload_file(self, path) -> int:
        try:
            with open(path, "rb") as fh:
                return self.load_payload(fh)
        except OSError as exc:
            raise PayloadError(f"cannot read session file {path}: {exc.strerror or exc}") from None

    def save(self, path) -> int:
        """Write the live state to a payload file at ``path``; returns the bytes written."""
        chunks = self.payload_chunks()
        try:
            with open(path, "wb") as fh:
                return payload_format.write(fh, chunks)
        except OSError as exc:
            raise PayloadError(f"cannot write session file {path}: {exc.strerror or exc}") from None

    def load(self, path) -> int:
        """Replace the live state with the payload file at ``path`` (see ``load_payload``)."""
        return self.load_payload_file(path)

    # -- description -----------------------------------------------------------------------------------

    def memory_bytes(self) -> int:
        """Bytes of the live state's arrays (the decode cache's, when decoding: its rows are
        preallocated, so this is what the session holds, not only what its tokens fill)."""
        return self.state.nbytes

    def __repr__(self) -> str:
        from ds4_mlx.engine.describe import mib

        return (f"Session(ctx={self.ctx}, tokens={self.pos}, chunk={self.chunk}, "
                f"memory={mib(self.memory_bytes())}, checkpoints={len(self._auto) + len(self._kept)})")

    def _repr_html_(self) -> str:
        """The notebook view: tokens held against the context, memory, checkpoints."""
        from ds4_mlx.engine.describe import html_table, session_rows

        return html_table("ds4_mlx Session", session_rows(self))


def _push(pool: list[Snapshot], snap: Snapshot, cap: int) -> None:
    """Append ``snap`` (replacing one with the same tokens) and keep the ``cap`` most recent."""
    pool[:] = [s for s in pool if s.tokens != snap.tokens]
    pool.append(snap)
    if len(pool) > cap:
        del pool[:len(pool) - cap]
