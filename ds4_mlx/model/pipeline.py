"""Pipeline parallel runs over ``mx.distributed``: each rank holds a contiguous range of the layers.

    rank 0          embed, layers [0, a)      --H-->  rank 1   layers [a, b)  --H--> ... last rank
    rank 0  <--logits--  last rank: layers [.., n_layer), output HC, norm, head

Layers are split by their weight bytes (``split_layers``, the head counted on the last rank), so each rank maps and touches only its share of the GGUF: the loader
builds only the rank's own blocks (``loader.load(..., distributed="pipeline")``); the embedding is
gathered only on rank 0 and the head exists only on the last rank.

Rank 0 drives: it owns the tokenizer, the sessions, sampling and output, and calls
``forward_chunk`` / ``step`` like any ``Model``. Each call sends a header (what to do, the
position, the token ids, the dtype of H) and H down the ranks; the other ranks run ``follow()``,
a loop that receives, runs its layers on its own ``ModelCache`` and passes H on, until rank 0
sends STOP (at its exit). The last rank sends the logits back to rank 0 when they are wanted. So
every rank computes exactly what one process computes for its layers (same module code, same
compiled decode functions), and the logits are bit-identical to a one-process run.

The other ranks mirror rank 0's *live* cache only: rank 0 continues the cache it last fed (or an
empty one, which resets them). Restoring an older state (a session snapshot, a payload, the disk
KV cache) would need every rank to restore its own layers' part; that is not built yet, and such a
feed is refused with a ``DistributedError`` instead of computing on a mismatched state.

Failure: joining waits at most ``join_timeout`` seconds for the other ranks (a watchdog process,
because ``mx.distributed.init`` blocks in C); a rank that dies later closes its sockets, the ring
backend raises on its neighbours, and that becomes a one-line ``DistributedError``.
"""

from __future__ import annotations

import atexit
import math
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import DistributedError, InferenceError
from ds4_mlx.model import join_watchdog
from ds4_mlx.model.cache import ModelCache
from ds4_mlx.model.experts import EXPERT_CACHE, routed_share
from ds4_mlx.model.transformer import Model, all_finite, raise_nonfinite

MODES = ("pipeline",)
DEFAULT_JOIN_TIMEOUT_S = 120.0

_STOP, _CHUNK, _STEP = 0, 1, 2
_PHASES = ("prefill", "decode", "stop")  # traffic counted by what it served: >1 token, 1 token, the end
_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_HEADER = 5  # op, p0 (0: start from an empty cache), n tokens, want logits, dtype code


def _phase(op: int, n: int) -> str:
    return "stop" if op == _STOP else ("decode" if n == 1 else "prefill")


# -- the split -----------------------------------------------------------------------------------


def split_layers(layer_bytes: list[int], n_ranks: int, first_extra: int = 0, last_extra: int = 0) -> list[range]:
    """Contiguous layer ranges, one per rank in order, that minimise the largest rank's bytes
    (``first_extra`` counts on rank 0, ``last_extra`` on the last rank). Every rank gets at least
    one layer; among equal maxima the earliest cut points win, so the split is deterministic."""
    n = len(layer_bytes)
    if not isinstance(n_ranks, int) or n_ranks < 1:
        raise DistributedError(f"the number of ranks must be >= 1, got {n_ranks!r}")
    if n_ranks > n:
        raise DistributedError(f"{n_ranks} ranks but the model has only {n} layers: "
                               f"a pipeline needs at least one layer per rank")
    cum = [0]
    for b in layer_bytes:
        cum.append(cum[-1] + int(b))

    def load(r: int, i: int, j: int) -> int:  # bytes of rank r holding layers [i, j)
        return cum[j] - cum[i] + (first_extra if r == 0 else 0) + (last_extra if r == n_ranks - 1 else 0)

    # best[r][j]: the smallest max load of ranks 0..r covering layers [0, j); cut[r][j] its last cut
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_ranks)]
    cut = [[0] * (n + 1) for _ in range(n_ranks)]
    for j in range(1, n + 1):
        best[0][j] = load(0, 0, j)
    for r in range(1, n_ranks):
        for j in range(r + 1, n + 1):
            for i in range(r, j):
                v = max(best[r - 1][i], load(r, i, j))
                if v < best[r][j]:
                    best[r][j], cut[r][j] = v, i
    ranges, j = [], n
    for r in range(n_ranks - 1, 0, -1):
        i = cut[r][j]
        ranges.append(range(i, j))
        j = i
    ranges.append(range(0, j))
    return ranges[::-1]


def gguf_split(f, n_layer: int, n_ranks: int) -> list[range]:
    """``split_layers`` over the GGUF's tensor bytes: ``blk.N.*`` per layer, the output head
    (``output*``) on the last rank. The embedding is not counted: rank 0 gathers only the rows of the
    tokens it sees out of the mapping, so it never becomes resident as a whole (on the tiny model,
    counting its 126 MiB would leave rank 0 one layer and the last rank the other five and the head)."""
    per_layer = [0] * n_layer
    head = 0
    for name in f.tensors:
        nbytes = int(f.tensor(name).nbytes)
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            if 0 <= il < n_layer:
                per_layer[il] += nbytes
        elif name.startswith("output"):
            head += nbytes
    return split_layers(per_layer, n_ranks, 0, head)


# -- joining -------------------------------------------------------------------------------------


def _join_timeout(timeout: float | None) -> float:
    if timeout is not None:
        return float(timeout)
    env = os.environ.get("DS4_MLX_DIST_TIMEOUT", "")
    try:
        return float(env) if env else DEFAULT_JOIN_TIMEOUT_S
    except ValueError:
        raise DistributedError(f"DS4_MLX_DIST_TIMEOUT={env!r} is not a number of seconds") from None


def join(timeout: float | None = None):
    """The distributed group of this process (``mx.distributed.init``), waiting at most
    ``timeout`` seconds (default ``DS4_MLX_DIST_TIMEOUT`` or 120) for the other ranks; past it the
    process ends with a one-line message. Raises ``DistributedError`` when no launcher started it."""
    limit = _join_timeout(timeout)
    if not (limit > 0 and math.isfinite(limit)):
        raise DistributedError(f"the join timeout must be a finite number of seconds > 0, got {limit:g}")
    msg = (f"ds4-mlx: error: rank {os.environ.get('MLX_RANK', '?')}: the other ranks did not join within "
           f"{limit:g} s (is every host of the hostfile running the same command?)")
    dog = subprocess.Popen([sys.executable, "-I", join_watchdog.__file__, str(os.getpid()), str(limit), msg],
                           stdin=subprocess.PIPE)
    try:
        group = mx.distributed.init(strict=False, backend="any")
    except RuntimeError as exc:
        raise DistributedError(f"cannot join the distributed group: {exc}") from None
    finally:
        dog.stdin.close()  # EOF: the watchdog exits without firing
        dog.wait()
    if group.size() < 2:
        raise DistributedError("--distributed pipeline needs two or more ranks: start every rank with "
                               "mlx.launch (e.g. mlx.launch -n 2 --backend ring -- ds4-mlx generate ...)")
    return group


# -- the model of one rank ---------------------------------------------------------------------


class PipelineModel(Model):
    """One rank's share of the model: ``blocks`` are its layers (``layers``, a range), the head
    exists on the last rank only. Rank 0 uses it as a ``Model``; the others call ``follow()``."""

    def __init__(self, *args, group, layers: range, **kwargs):
        super().__init__(*args, **kwargs)
        self.group, self.layers = group, layers
        self.rank, self.size = group.rank(), group.size()
        self._mirrored: ModelCache | None = None  # rank 0: the cache the other ranks hold a copy of
        self._stopped = False
        # Bytes and messages this rank has sent, by the kind of call they served (``_PHASES``; a
        # one-token chunk counts as decode): benchmarks/bench_distributed.py reads them.
        self.sent = {phase: {"bytes": 0, "messages": 0} for phase in _PHASES}
        self._phase = "stop"
        if self.source is not None:  # the default expert-LRU budget: this rank's share (its docstring)
            EXPERT_CACHE.scale_default(routed_share(self.source, layers))
        if self.rank == 0:
            atexit.register(self.close)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    # -- transport ------------------------------------------------------------------------------

    def _lost(self, exc: Exception) -> DistributedError:
        # No STOP at exit after this: the ring backend has failed its connections, and a send over
        # one of them can block for ever, leaving the process hanging after its error line.
        self._stopped = True
        return DistributedError(f"rank {self.rank}: lost the connection to the other ranks "
                                f"(one exited or was killed): {exc}")

    def _send(self, arrays: list[mx.array], dst: int) -> None:
        try:
            for a in arrays:  # one at a time: the messages must leave in this order
                mx.eval(mx.distributed.send(a, dst, group=self.group, stream=mx.cpu))
                self.sent[self._phase]["bytes"] += a.nbytes
                self.sent[self._phase]["messages"] += 1
        except RuntimeError as exc:
            raise self._lost(exc) from None

    def _recv(self, shape, dtype, src: int) -> mx.array:
        try:
            a = mx.distributed.recv(shape, dtype, src, group=self.group, stream=mx.cpu)
            mx.eval(a)  # now: an unread message would shift every later one
            return a
        except RuntimeError as exc:
            raise self._lost(exc) from None

    def _pass_on(self, header: np.ndarray, tokens: np.ndarray, H: mx.array) -> None:
        self._send([mx.array(header), mx.array(tokens), H], self.rank + 1)

    def _recv_logits(self) -> mx.array:
        code = int(np.array(self._recv((1,), mx.int64, self.size - 1))[0])
        return self._recv((self.config.n_vocab,), _DTYPES[code], self.size - 1)

    def _send_logits(self, logits: mx.array) -> None:
        code = mx.array(np.array([_DTYPES.index(logits.dtype)], dtype=np.int64))
        self._send([code, logits], 0)

    # -- rank 0 -------------------------------------------------------------------------------

    def _claim(self, cache: ModelCache) -> None:
        """Refuse a cache the other ranks do not hold (an empty one starts them over: p0 = 0)."""
        if self._stopped:
            raise DistributedError("the pipeline is closed: the other ranks have stopped")
        if cache.n_tokens != 0 and cache is not self._mirrored:
            raise DistributedError("a distributed (pipeline) session can only continue its live state: "
                                   "restoring a snapshot, a payload or a disk KV cache entry is not "
                                   "supported across ranks yet")

    def _header(self, op: int, p0: int, n: int, want: bool, H: mx.array | None) -> np.ndarray:
        code = 0 if H is None else _DTYPES.index(H.dtype)
        self._phase = _phase(op, n)
        return np.array([op, p0, n, int(want), code], dtype=np.int64)

    def forward_chunk(self, tokens: np.ndarray, cache: ModelCache,
                      want_logits: bool = True) -> tuple[mx.array | None, ModelCache]:
        if self.rank != 0:
            raise InferenceError("only rank 0 drives a pipeline; the other ranks run follow()")
        self._claim(cache)
        return super().forward_chunk(tokens, cache, want_logits)

    def _chunk_logits(self, H: mx.array, tokens: np.ndarray, p0: int, cache: ModelCache,
                      want_logits: bool) -> mx.array | None:
        # ``Model.forward_chunk`` ran rank 0's blocks on a copy of the caller's cache (on an error
        # before this point the caller keeps its cache, the other ranks theirs); the rest runs there.
        self._pass_on(self._header(_CHUNK, p0, len(tokens), want_logits, H), tokens, H)
        self._mirrored = cache
        return self._recv_logits() if want_logits else None

    def step(self, token: int, cache: ModelCache) -> mx.array:
        if self.rank != 0:
            raise InferenceError("only rank 0 drives a pipeline; the other ranks run follow()")
        self._claim(cache)
        if self.source is not None:
            self.source.check_intact()
        p = cache.n_tokens
        H = self.decoder().run(self.embed(np.array([token], dtype=np.int64)), int(token), cache,
                               head=False, evaluate=False)
        mx.eval(H, *cache.arrays())
        self._pass_on(self._header(_STEP, p, 1, True, H), np.array([token], dtype=np.int64), H)
        self._mirrored = cache
        return self._recv_logits()

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop (also run at exit). Safe to call twice."""
        if self.rank != 0 or self._stopped:
            return
        self._stopped = True
        try:
            self._pass_on(self._header(_STOP, 0, 0, False, None), np.zeros(1, np.int64),
                          mx.zeros((1,), mx.float32))
        except DistributedError:
            pass  # the others are gone already: nothing to stop

    # -- the other ranks ----------------------------------------------------------------------

    def follow(self) -> None:
        """Ranks > 0: serve this rank's layers for rank 0 until it sends STOP (or is lost:
        ``DistributedError``)."""
        if self.rank == 0:
            raise InferenceError("rank 0 drives the pipeline; follow() is for the other ranks")
        cfg = self.config
        cache = ModelCache.empty(cfg, self.layers)  # this rank's layers only
        src = self.rank - 1
        while True:
            header = np.array(self._recv((_HEADER,), mx.int64, src))
            op, p0, n, want, code = (int(v) for v in header)
            self._phase = _phase(op, n)
            tokens = np.array(self._recv((max(n, 1),), mx.int64, src))
            if op == _STOP:
                self._recv((1,), mx.float32, src)
                if not self.is_last:
                    self._pass_on(header, tokens, mx.zeros((1,), mx.float32))
                return
            H = self._recv((n, cfg.n_hc, cfg.n_embd), _DTYPES[code], src)
            if p0 == 0:  # rank 0 feeds an empty cache (``_claim``): start over
                cache = ModelCache.empty(cfg, self.layers)  # this rank's layers only
            if cache.n_tokens != p0:
                raise DistributedError(f"rank {self.rank}: out of step with rank 0 (it feeds position {p0}, "
                                       f"this rank holds {cache.n_tokens} tokens)")
            if self.source is not None:
                self.source.check_intact()
            if op == _CHUNK:
                with self.ops.stream():
                    H = self.run_blocks(H, tokens, cache)
                    out = self.head(H[-1:])[0] if self.is_last and want else None
            elif op == _STEP:
                y = self.decoder().run(H, int(tokens[0]), cache, head=self.is_last, evaluate=False)
                out, H = (y, None) if self.is_last else (None, y)
                mx.eval(*([] if H is None else [H]), *cache.arrays())
            else:
                raise DistributedError(f"rank {self.rank}: unknown pipeline message {op} from rank {src}")
            if self.is_last:
                if out is not None:
                    self._send_logits(out)
            else:
                header[4] = _DTYPES.index(H.dtype)
                self._pass_on(header, tokens, H)
