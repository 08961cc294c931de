"""What every multi-rank mode shares (``--distributed pipeline`` / ``experts``): joining the ranks
``mlx.launch`` started, the transport, and the rank-0 / follower command protocol.

Rank 0 drives: it owns the tokenizer, the sessions, sampling and output, and calls
``forward_chunk`` / ``step`` like any ``Model``. A mode *wraps* the rank's ``Model`` (composition:
``DistributedModel.model`` holds this rank's blocks and runs them with its own ``run_blocks`` /
``forward_chunk`` / decoder, the very code one process runs) and adds the messages around them. Each call first sends a *command* down the chain
of ranks (0 -> 1 -> ... -> last; every rank relays it to the next one before acting on it, so a
command needs links between neighbours only, which is all the ring backend offers):

    header  int64 [5]   op, p0 (the position it applies at), n tokens, want logits, arg
    tokens  int64 [max(n, 1)]

then whatever the mode adds on the same links (a pipeline's hidden state, ``model.pipeline``; an
expert-parallel layer's ``all_sum``, ``model.expert_parallel``). The other ranks run ``follow()``:
receive a command, relay it, dispatch it to the handler the mode registered for its op
(``DistributedModel.handlers``), until STOP (sent by rank 0's ``close()``, also at its exit).

A mode is a ``DistributedModel`` and supplies only what differs: what rank 0 does around the
command for a chunk and a step, and the follower's ``follow_chunk`` / ``follow_step``. A new
command (say, keep the live cache under an id) is one op number next to STOP/CHUNK/STEP, what rank 0
sends (``command(Command(op, ..., arg=...))``) and one entry in ``handlers()``; its integer argument
rides in the header's ``arg`` field, bulk data follows on the same links with ``Transport.send_array``.

States across ranks. Each state the other ranks computed gets an id on rank 0: a ``StateTag`` in
the fed cache's ``tag`` (``ModelCache.copy`` passes it on, so a snapshot, its copies and the cache a
session restores from it all name that state). Before rank 0 moves the other ranks off their live
state (any CHUNK / STEP), it asks them to *keep* it under its id when a cache on rank 0 still holds
that tag (a session snapshot, a checkpoint, another session of a server's pool); feeding such a
cache later first makes every rank *restore* its own part; and when the last cache holding a kept
tag is gone (a weakref finalizer), its id is *dropped* on the other ranks with the next command, so
their memory follows rank 0's. All three ride in one STATE command, sent only when there is
something to do. A cache whose state the other ranks never held (one built on rank 0 alone) is
refused with a ``DistributedError`` (``_claim``) instead of computing on a mismatched state.

Failure: joining waits at most ``join_timeout`` seconds for the other ranks and their first
message, which compares what every rank was started with (a watchdog process, because
``mx.distributed.init`` blocks in C); a rank that dies later closes its sockets, the ring backend
raises on its neighbours, and that becomes a one-line ``DistributedError``.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import math
import os
import subprocess
import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import DistributedError, InferenceError
from ds4_mlx.model import join_watchdog, load_plan
from ds4_mlx.model.cache import LayerCache, ModelCache, capacity_for
from ds4_mlx.model.host import to_host
from ds4_mlx.model.transformer import Model

MODES = ("pipeline", "experts")
# The command protocol's version, compared when the ranks join (``join``): ranks running different
# ds4-mlx code would misread each other's messages. Bump it on any change to the commands or to what
# follows them on the links. 2: the pipeline's last rank sends the normed hidden state, then the logits
# of its rows of the head only (rank 0 holds the others).
PROTOCOL_VERSION = 2
DEFAULT_JOIN_TIMEOUT_S = 120.0

# The command ops. 0..15 are this module's and the modes'; further commands take the next free number.
STOP, CHUNK, STEP = 0, 1, 2
STATE = 3  # p0: keep the live cache under this id (0: no); arg: restore this id (0: no); tokens: ids to drop
GATHER = 4  # p0: n tokens; arg: the kept id whose state each rank sends to rank 0 (0: the live one)
SCATTER = 5  # p0: n tokens; arg: the id each rank keeps the state rank 0 sends under
HEADER_LEN = 5  # op, p0, n, want, arg
DTYPES = (mx.float32, mx.float16, mx.bfloat16)  # the codes of ``send_array``
PHASES = ("prefill", "decode", "session", "stop")  # what the traffic served (``Transport.sent``)


def phase_of(op: int, n_tokens: int) -> str:
    if op == STOP:
        return "stop"
    if op in (CHUNK, STEP):
        return "decode" if n_tokens == 1 else "prefill"
    return "session"


# -- joining -------------------------------------------------------------------------------------


def join_timeout(timeout: float | None) -> float:
    """``timeout`` (the loader passes its plan's: ``load(join_timeout=)`` or ``DS4_MLX_DIST_TIMEOUT``,
    read and checked by ``load_plan``), else 120 s."""
    return DEFAULT_JOIN_TIMEOUT_S if timeout is None else float(timeout)


def join(timeout: float | None = None, mode: str = "pipeline", checks: Sequence[tuple[str, str]] = ()):
    """The distributed group of this process (``mx.distributed.init``), waiting at most
    ``timeout`` seconds (default 120; a load passes its plan's) for the other ranks; past it the
    process ends with a one-line message. Raises ``DistributedError`` when no launcher started it
    (the message names ``mode``).

    Joined, the ranks exchange a first message under the same deadline: the digest of each of
    ``checks`` (``(what, value)`` pairs, e.g. ``("model file", "tiny.gguf, 251 MiB, 1a2b...")``) and of
    the mode. Two things it turns into one line on every rank instead of a silent wrong answer or a
    hang: ranks started on different models, numerics or modes (``DistributedError`` naming the first
    difference), and a link that connected but carries nothing (the ring backend waits for ever on
    a socket whose peer was some other process; the deadline ends it)."""
    limit = join_timeout(timeout)
    if not (limit > 0 and math.isfinite(limit)):
        raise DistributedError(f"the join timeout must be a finite number of seconds > 0, got {limit:g}")
    msg = (f"ds4-mlx: error: rank {load_plan.launcher_rank()}: the other ranks did not join within "
           f"{limit:g} s (is every host of the hostfile running the same command?)")
    dog = subprocess.Popen([sys.executable, "-I", join_watchdog.__file__, str(os.getpid()), str(limit), msg],
                           stdin=subprocess.PIPE)
    try:
        try:
            group = mx.distributed.init(strict=False, backend="any")
        except RuntimeError as exc:
            raise DistributedError(f"cannot join the distributed group: {exc}") from None
        if group.size() < 2:
            raise DistributedError(f"--distributed {mode} needs two or more ranks: start every rank with "
                                   "mlx.launch (e.g. mlx.launch -n 2 --backend ring -- ds4-mlx generate ...)")
        _agree(group, [("ds4-mlx protocol", f"version {PROTOCOL_VERSION}"), ("mode", f"--distributed {mode}"),
                       *checks])
    finally:
        dog.stdin.close()  # EOF: the watchdog exits without firing
        dog.wait()
    return group


def _digest(value: str) -> int:
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little", signed=True)


def _gathered(group, values: Sequence[int], failed: str) -> np.ndarray:
    """Every rank's int64 ``values`` (same length everywhere), as [ranks, len(values)]; a lost link is
    a one-line ``DistributedError`` starting ``failed``."""
    mine = mx.array(np.asarray(values, dtype=np.int64))
    try:
        every = to_host(mx.distributed.all_gather(mine, group=group, stream=mx.cpu))
    except RuntimeError as exc:
        raise DistributedError(f"rank {group.rank()}: {failed}: {exc}") from None
    return every.reshape(group.size(), len(values))


def _agree(group, checks: Sequence[tuple[str, str]]) -> None:
    """Every rank sends every other the digests of ``checks``; the first that differs from this
    rank's is a ``DistributedError`` (each rank raises its own line, all at once)."""
    every = _gathered(group, [_digest(value) for _, value in checks], "the first message between the ranks failed")
    for (what, value), column in zip(checks, every.T):
        other = next((r for r, d in enumerate(column) if d != column[group.rank()]), None)
        if other is not None:
            raise DistributedError(f"rank {group.rank()}: rank {other} runs with a different {what} "
                                   f"(this rank: {value}); every rank must run the same command on the same model")


def rank0s(group, values: Sequence[int]) -> list[int]:
    """Rank 0's ``values`` on every rank (same length everywhere): for a choice all ranks must make
    alike though each computes it from what its own host sees (the pipeline's split weighs what a
    rank will hold, which depends on its backend and on whether it could build the native code)."""
    return [int(v) for v in _gathered(group, values, "lost the connection to the other ranks")[0]]


# -- the transport --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """What rank 0 asks of every rank: ``op`` at position ``p0`` (0: from an empty cache) over
    ``tokens``; ``want``: rank 0 wants logits; ``arg``: the op's own integer (e.g. a cache id)."""

    op: int
    p0: int = 0
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    want: bool = False
    arg: int = 0

    def header(self) -> np.ndarray:
        return np.array([self.op, self.p0, len(self.tokens), int(self.want), self.arg], dtype=np.int64)


class Transport:
    """Point-to-point messages of one rank over ``group``; every failure of a link becomes a one-line
    ``DistributedError`` and marks the transport ``broken`` (nothing more is sent on it)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.broken = False
        # Bytes and messages this rank sent, by what the command in flight served (``PHASES``: a
        # one-token CHUNK or STEP is decode; STATE/GATHER/SCATTER are session): bench_distributed
        # reads them. Collectives (an all_sum inside the model) are not point-to-point sends and
        # are not counted here.
        self.sent = {phase: {"bytes": 0, "messages": 0} for phase in PHASES}
        self.phase = "stop"

    def lost(self, exc: Exception) -> DistributedError:
        # No STOP at exit after this: the ring backend has failed its connections, and a send over
        # one of them can block for ever, leaving the process hanging after its error line.
        self.broken = True
        return DistributedError(f"rank {self.rank}: lost the connection to the other ranks "
                                f"(one exited or was killed): {exc}")

    def send(self, arrays: list[mx.array], dst: int) -> None:
        try:
            for a in arrays:  # one at a time: the messages must leave in this order
                mx.eval(mx.distributed.send(a, dst, group=self.group, stream=mx.cpu))
                self.sent[self.phase]["bytes"] += a.nbytes
                self.sent[self.phase]["messages"] += 1
        except RuntimeError as exc:
            raise self.lost(exc) from None

    def recv(self, shape, dtype, src: int) -> mx.array:
        try:
            a = mx.distributed.recv(shape, dtype, src, group=self.group, stream=mx.cpu)
            mx.eval(a)  # now: an unread message would shift every later one
            return a
        except RuntimeError as exc:
            raise self.lost(exc) from None

    @contextmanager
    def collective(self):
        """Around evaluations that hold collectives (an expert-parallel layer's ``all_sum``): a lost
        rank surfaces as MLX's RuntimeError from whichever evaluation runs the collective, anywhere in
        the model code; here it becomes the one-line ``DistributedError`` of a lost link."""
        try:
            yield
        except RuntimeError as exc:
            raise self.lost(exc) from None

    def send_array(self, a: mx.array, dst: int) -> None:
        """``a`` preceded by its dtype code, for a receiver that knows the shape but not the dtype."""
        self.send([mx.array(np.array([DTYPES.index(a.dtype)], dtype=np.int64)), a], dst)

    def recv_array(self, shape, src: int) -> mx.array:
        code = int(np.array(self.recv((1,), mx.int64, src))[0])
        if not 0 <= code < len(DTYPES):
            raise DistributedError(f"rank {self.rank}: rank {src} sent an unknown dtype code {code}")
        return self.recv(shape, DTYPES[code], src)

    def send_command(self, cmd: Command, dst: int) -> None:
        self.phase = phase_of(cmd.op, len(cmd.tokens))
        tokens = cmd.tokens if len(cmd.tokens) else np.zeros(1, np.int64)
        self.send([mx.array(cmd.header()), mx.array(np.asarray(tokens, dtype=np.int64))], dst)

    def recv_command(self, src: int) -> Command:
        op, p0, n, want, arg = (int(v) for v in np.array(self.recv((HEADER_LEN,), mx.int64, src)))
        if n < 0:
            raise DistributedError(f"rank {self.rank}: rank {src} sent a command over {n} tokens")
        self.phase = phase_of(op, n)  # what this rank sends next serves this command
        tokens = np.array(self.recv((max(n, 1),), mx.int64, src))[:n]
        return Command(op, p0, tokens, bool(want), arg)


# -- the model of one rank ----------------------------------------------------------------------


class StateTag:
    """Rank 0's name for one state of the other ranks (``id`` > 0), shared by every cache holding it."""

    __slots__ = ("id", "__weakref__")

    def __init__(self, id: int):
        self.id = id

    def __repr__(self) -> str:
        return f"StateTag({self.id})"


class DistributedModel:
    """One rank's model in a multi-rank run, wrapping the rank's ``Model`` (``model``: its blocks, and
    whatever of the embedding and head it holds): rank 0 uses it as a ``Model`` (its ``forward_chunk``
    / ``step`` also drive the other ranks), the others call ``follow()``. Subclasses are the modes.
    Every other attribute (config, ops, the head, the plans, ...) is the wrapped model's."""

    mode = "?"
    # a speculative verify needs a rollback of every rank's state, which the protocol does not carry
    can_verify = False

    def __init__(self, model: Model, *, group):
        self.model = model
        self.config, self.ops, self.source = model.config, model.ops, model.source
        self.group = group
        self.transport = Transport(group)
        self.rank, self.size = group.rank(), group.size()
        # rank 0: the tag of the other ranks' live state (weak: a state no cache holds needs no keeping),
        # the ids they keep, and kept ids whose last holder is gone (a finalizer appends: any thread)
        self._live: weakref.ref | None = None
        self._next_id = 1
        self._kept: set[int] = set()
        self._dead: collections.deque[int] = collections.deque()
        self._closed = False
        self.cache: ModelCache | None = None  # a follower's live cache
        self.kept: dict[int, ModelCache] = {}  # a follower's kept states, by rank 0's id
        if self.rank == 0:
            atexit.register(self.close)

    # What the wrapper reads through from the rank's model: its weights, its parts of the forward, what
    # the loader recorded. Nothing that runs the model's whole forward on its own (``forward_chunk``,
    # ``step``, ``forward_verify``: the wrapper's own, which add the messages), so no caller can run
    # rank 0's blocks alone by mistake.
    DELEGATED = frozenset({"embedding", "embed", "blocks", "head", "head_hidden", "head_logits", "output",
                           "output_hc", "output_norm", "host_head", "numerics", "expert_strategy",
                           "expert_cache", "load_plan", "memory_plan", "decoder", "run_blocks", "check_taps",
                           "tap_rows"})

    def __getattr__(self, name: str):
        # only reached for names this wrapper does not define
        model = self.__dict__.get("model")
        if model is None or name not in self.DELEGATED:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(model, name)

    def empty_cache(self) -> ModelCache:
        return self.model.empty_cache()

    def forward_verify(self, tokens, cache, taps=None):
        raise InferenceError(f"a speculative verify runs in one process only, not with distributed={self.mode!r}")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    # -- rank 0 -------------------------------------------------------------------------------

    def _driver_only(self) -> None:
        if self.rank != 0:
            raise InferenceError(f"only rank 0 drives a distributed ({self.mode}) model; "
                                 "the other ranks run follow()")

    def _claim(self, cache: ModelCache) -> None:
        """Refuse a cache the other ranks do not hold, live or kept (an empty one starts them over)."""
        self.check_open()
        if cache.n_tokens != 0 and not self.holds(cache):
            raise DistributedError(f"a distributed ({self.mode}) run can only continue a state every rank "
                                   "holds (its live state or a snapshot of it); this cache was built on "
                                   "rank 0 alone")

    def check_open(self) -> None:
        """Rank 0: refuse to talk to ranks that stopped or were lost (a send on a failed link can
        block for ever)."""
        if self._closed or self.transport.broken:
            raise DistributedError(f"the {self.mode} group is closed: the other ranks have stopped")

    def holds(self, cache: ModelCache) -> bool:
        """Rank 0: whether the other ranks hold ``cache``'s state (live, or kept under its tag)."""
        tag = cache.tag
        if not isinstance(tag, StateTag):
            return False
        return tag.id in self._kept or (self._live is not None and self._live() is tag)

    def new_kept_tag(self) -> StateTag:
        """Rank 0: a fresh id the other ranks are about to keep a state under (``SCATTER``); it is
        dropped on them after the last cache holding the returned tag is gone."""
        tag = StateTag(self._next_id)
        self._next_id += 1
        self._kept.add(tag.id)
        weakref.finalize(tag, self._dead.append, tag.id)
        return tag

    def state_id(self, cache: ModelCache) -> int:
        """Rank 0: the id of ``cache``'s state on the other ranks, 0 for their live state;
        ``DistributedError`` when they do not hold it."""
        if not self.holds(cache):
            raise DistributedError(f"the other ranks of this {self.mode} run do not hold this state "
                                   "(it was built on rank 0 alone)")
        return 0 if self._live is not None and self._live() is cache.tag else cache.tag.id

    def feeding(self, cache: ModelCache, origin: ModelCache | None = None) -> None:
        """Rank 0, just before the command that feeds ``cache`` (the other ranks then compute on
        their part of its state): tag ``cache`` with the state it becomes, and send the STATE command
        that gets the other ranks there first (keep their live state if a cache on rank 0 still holds
        it, restore ``cache``'s state if it is not the live one, drop the states nobody holds).
        ``origin``: the caller's cache ``cache`` was copied from, about to be replaced by the result;
        it does not count as a holder of the live state."""
        old = cache.tag if cache.n_tokens else None
        live = self._live() if self._live is not None else None
        restore = old.id if old is not None and old is not live else 0
        # Keep the live state if a cache other than ``cache`` (and ``origin``) still holds its tag.
        cache.tag = None
        untag_origin = origin is not None and live is not None and origin.tag is live
        if untag_origin:
            origin.tag = None
        live_id = 0 if live is None else live.id
        del old, live
        keep = 0
        live = self._live() if self._live is not None else None  # alive now only if held elsewhere
        if live is not None and live_id not in self._kept:
            keep = live_id
            self._kept.add(keep)
            weakref.finalize(live, self._dead.append, keep)
        del live
        if untag_origin:  # it holds the live state again if anything else does (else it is refused later)
            origin.tag = self._live() if self._live is not None else None
        # a restored state whose last holder was ``cache`` is dropped in this same command, after
        # the restore (``follow_state`` keeps, restores, then drops)
        drops = []
        while self._dead:
            i = self._dead.popleft()
            if i in self._kept:
                self._kept.discard(i)
                drops.append(i)
        if keep or restore or drops:
            self.command(Command(STATE, keep, np.array(drops, dtype=np.int64), arg=restore))
        cache.tag = StateTag(self._next_id)
        self._next_id += 1
        self._live = weakref.ref(cache.tag)

    def command(self, cmd: Command) -> None:
        """Rank 0: send ``cmd`` down the chain (rank 1 relays it on)."""
        self.transport.send_command(cmd, 1)

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop (also run at exit). Safe to call twice."""
        if self.rank != 0 or self._closed or self.transport.broken:
            return
        self._closed = True
        atexit.unregister(self.close)  # the exit hook held the model alive (serve closes on its worker)
        try:
            self.command(Command(STOP))
        except DistributedError:
            pass  # the others are gone already: nothing to stop

    # -- whole states (payloads, the disk KV cache) -----------------------------------------------
    # Loading a payload, rank 0 sends every other rank the layers whose state it holds (SCATTER:
    # each rank keeps its own layers and relays those a later rank holds) and they keep them under
    # a new id, like a snapshot, until rank 0 feeds it. A mode says which layers a rank holds
    # (``state_layers``: all of them by default, as in expert parallelism, where every rank holds
    # the whole state) and which a later rank holds (``later_ranks_hold``). Saving one is the mode's
    # ``gather_state`` (a pipeline fetches the other ranks' layers; an expert-parallel rank 0
    # already has them all).

    @property
    def state_layers(self) -> range:
        """The layers whose state this rank holds."""
        return range(self.config.n_layer)

    def later_ranks_hold(self, il: int) -> bool:
        """Whether a rank after this one holds layer ``il``'s state (so it is relayed on)."""
        return True

    def scatter_state(self, cache: ModelCache) -> ModelCache:
        """Rank 0: send the other ranks their layers of ``cache`` (a whole state, e.g. a loaded
        payload) to keep; returns rank 0's part of it, tagged with the state they keep."""
        self._driver_only()
        self.check_open()
        n = cache.n_tokens
        if n == 0:
            return cache
        tag = self.new_kept_tag()
        self.command(Command(SCATTER, n, arg=tag.id))
        self._send_layers([(il, cache.layers[il].state) for il in range(self.config.n_layer)
                           if self.later_ranks_hold(il)], 1)
        mine = self.state_layers
        return ModelCache([lc if il in mine else None
                           for il, lc in enumerate(cache.layers)], cache.capacity, tag)

    def _send_layers(self, layers: list[tuple[int, list[mx.array]]], dst: int) -> None:
        t = self.transport
        t.send([mx.array(np.array([len(layers)], dtype=np.int64))], dst)
        for il, arrays in layers:
            t.send([mx.array(np.array([il, len(arrays)], dtype=np.int64))], dst)
            for a in arrays:
                t.send([mx.array(np.array(a.shape, dtype=np.int64))], dst)
                if a.size:  # an empty array (no compressed row yet) is its shape alone
                    t.send_array(a, dst)

    def _recv_layers(self, src: int) -> list[tuple[int, list[mx.array]]]:
        t, n_layer = self.transport, self.config.n_layer
        count = int(np.array(t.recv((1,), mx.int64, src))[0])
        if not 0 <= count <= n_layer:
            raise DistributedError(f"rank {self.rank}: rank {src} sent the state of {count} layers")
        out = []
        for _ in range(count):
            il, k = (int(v) for v in np.array(t.recv((2,), mx.int64, src)))
            if not (0 <= il < n_layer and 1 <= k <= 7):
                raise DistributedError(f"rank {self.rank}: rank {src} sent a bad layer state record ({il}, {k})")
            arrays = []
            for _ in range(k):
                shape = tuple(int(v) for v in np.array(t.recv((2,), mx.int64, src)))
                arrays.append(t.recv_array(shape, src) if shape[0] * shape[1] else mx.zeros(shape, mx.float32))
            out.append((il, arrays))
        return out

    # -- the other ranks ----------------------------------------------------------------------

    def handlers(self) -> dict[int, Callable[[Command], None]]:
        """op -> what a follower does for it (after relaying it). Modes extend this dict."""
        return {CHUNK: self.follow_chunk, STEP: self.follow_step, STATE: self.follow_state,
                SCATTER: self.follow_scatter}

    def follow_state(self, cmd: Command) -> None:
        """Keep the live cache under ``p0``, make the one kept under ``arg`` live, drop ``tokens``."""
        if cmd.p0:
            self.kept[cmd.p0] = self.cache.copy()
        if cmd.arg:
            kept = self.kept.get(cmd.arg)
            if kept is None:
                raise DistributedError(f"rank {self.rank}: rank 0 restores state {cmd.arg}, which this rank "
                                       "does not hold (out of step with rank 0)")
            self.cache = kept.copy()
        for i in cmd.tokens:
            self.kept.pop(int(i), None)

    def follow_scatter(self, cmd: Command) -> None:
        """Keep the state rank 0 sends under ``arg`` (this rank's layers; the later ranks' relayed on)."""
        parts = self._recv_layers(self.rank - 1)
        if not self.is_last:
            self._send_layers([(il, a) for il, a in parts if self.later_ranks_hold(il)], self.rank + 1)
        mine = self.state_layers
        own = {il: a for il, a in parts if il in mine}
        if sorted(own) != list(mine):
            raise DistributedError(f"rank {self.rank}: rank 0 sent layers {sorted(own)} of a state, "
                                   f"this rank holds layers {mine.start}..{mine.stop - 1}")
        n, cfg = cmd.p0, self.config
        cap = capacity_for(max(n - 1, 0))
        self.kept[cmd.arg] = ModelCache([LayerCache.from_state(cfg, il, n, own[il], cap) if il in own
                                         else None for il in range(cfg.n_layer)], cap)

    def follow(self) -> None:
        """Ranks > 0: receive rank 0's commands, relay each to the next rank, run it, until STOP
        (or a lost rank: ``DistributedError``)."""
        if self.rank == 0:
            raise InferenceError(f"rank 0 drives the {self.mode} group; follow() is for the other ranks")
        self.cache = self.empty_cache()
        table = self.handlers()
        while True:
            cmd = self.transport.recv_command(self.rank - 1)
            if not self.is_last:
                self.transport.send_command(cmd, self.rank + 1)
            if cmd.op == STOP:
                return
            handler = table.get(cmd.op)
            if handler is None:
                raise DistributedError(f"rank {self.rank}: unknown {self.mode} command {cmd.op} from rank 0")
            handler(cmd)

    def live_cache(self, cmd: Command) -> ModelCache:
        """A follower's cache for a command at ``cmd.p0`` (p0 = 0: rank 0 fed an empty cache, start
        over); a cache at another position is out of step with rank 0, a ``DistributedError``."""
        if cmd.p0 == 0:
            self.cache = self.empty_cache()
        if self.cache.n_tokens != cmd.p0:
            raise DistributedError(f"rank {self.rank}: out of step with rank 0 (it feeds position {cmd.p0}, "
                                   f"this rank holds {self.cache.n_tokens} tokens)")
        if self.source is not None:
            self.source.check_intact()
        return self.cache

    def follow_chunk(self, cmd: Command) -> None:
        raise NotImplementedError

    def follow_step(self, cmd: Command) -> None:
        raise NotImplementedError

