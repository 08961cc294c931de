"""Per-layer inference caches: the buffers that continue a sequence exactly, one object per layer.

A ``LayerCache`` holds, after n tokens (spec §9.2; R = compress ratio, D = head_dim,
Di = indexer_head_dim, cap = ``capacity`` in tokens):

    ring         [n_swa, D]        raw KV row of position q in slot q mod n_swa; slots of positions
                                   < max(0, n - n_swa) hold stale or zero rows (never read)
    attn.rows    [cap // R, D]     compressed rows 0 .. n//R - 1 valid; slot n//R may hold the pooled
                                   row of the still open window (a decode step writes it every step,
                                   it counts only once the window closes); later slots are zero
    attn.kst/gst [coff·R, coff·D]  the canonical compressor frontier (values / scores incl. APE)
    index.*      the same for the indexer lane of ratio-4 layers (width Di)

The frontier is always the canonical one of spec §6.3 (R = 4: rows 0..3 = the last complete window,
rows 4..4+r-1 = the partial window, r = n mod 4; R = 128: rows 0..r-1 = the partial window; all other
rows K = 0, G = EMPTY_SCORE); every path (prefill chunk, decode step, restored state) produces it.

``state`` is the canonical, exact content (raw window oldest first, valid rows only, frontier) in
``state_layout`` order; ``from_state`` rebuilds the buffers from it. That is what snapshots compare,
what ``to_numpy`` and the payload / disk KV format (``engine/payload.py``) serialise, so the format
is independent of the buffer capacity.

``capacity`` depends only on the number of tokens, never on the session's context size: the
smallest power of two >= max(MIN_CAPACITY, last position of the call + 1). Two sessions at the same
position therefore hold the same shapes (the compiled decode step reuses its trace and agrees bit
for bit), and the buffers grow — one retrace per layer with compressed rows — only log2(ctx /
MIN_CAPACITY) times over a whole context.

Arrays are never modified in place: every update builds new arrays and rebinds the cache's
attributes (MLX may reuse a buffer no one else holds). So ``copy()`` is a cheap snapshot that later
steps of the original cannot change. A snapshot keeps its buffers alive: rows for ``capacity``
tokens (at least MIN_CAPACITY), not only the valid ones; the first update after a snapshot copies
the buffer it writes (the snapshot still holds the old one).

A module call sees *where* it runs through the ``at`` attribute bound for the call: ``ChunkAt``
(host-known positions p0..p0+L-1, exact shapes: prefill chunks, ds4-cpu and uncompiled decode) or
``StepAt`` (one token at a traced position with fixed shapes: the compiled decode step).

Rollback (speculative decoding, ``engine/speculative.py``). A verify chunk of L <= n_swa tokens runs
with ``ChunkAt(record=True)`` on a cache whose state before it is kept as ``mark = cache.mark()`` (a
copy: free). ``cache.rollback(mark, n_keep)`` then makes the cache exactly the one after its first
n_keep - mark.n_tokens tokens, without recomputing anything:

    raw ring     the mark's ring with the slots of the kept positions taken from the chunk's ring
                 (the rejected rows overwrote older rows still inside the window: the mark has them)
    lane rows    the mark's buffer with the rows of windows the kept tokens closed (each compressed
                 row depends only on its window's tokens, so the chunk's rows for them are the rows
                 plain decoding emits)
    frontier     rebuilt from the mark's frontier and the kept tokens' projections, which a
                 recording chunk keeps (``CompressorLane.inputs``), by the very function a chunk of
                 those tokens runs (``_frontier_after``: copies, no arithmetic)

Every array of ``state`` is then bit for bit the one of a cache that fed only the kept tokens
(``tests/test_speculative.py`` checks it across ratio-4 / ratio-128 windows and the ring edge).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import InferenceError
from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.model.host import to_host
from ds4_mlx.model.numerics import EMPTY_SCORE

MIN_CAPACITY = 4096  # tokens; a multiple of every compress ratio

LANES = ("raw", "attn", "index")
FIELDS = ("rows", "kst", "gst")


def capacity_for(position: int) -> int:
    """The row-buffer capacity (tokens) for a call whose last token is at ``position``: the
    smallest power of two >= max(MIN_CAPACITY, position + 1), so the slot position // R exists."""
    cap = MIN_CAPACITY
    while cap < position + 1:
        cap *= 2
    return cap


def lane_shapes(ratio: int, dim: int, coff: int, capacity: int) -> list[tuple[int, int]]:
    """A compressor lane's buffers with row buffers of ``capacity`` tokens (``CompressorLane.empty``):
    rows [capacity // R, dim], frontier kst / gst [coff·R, coff·dim]."""
    front = (coff * ratio, coff * dim)
    return [(capacity // ratio, dim), front, front]


def buffer_shapes(cfg: ModelConfig, il: int, capacity: int) -> list[tuple[int, int]]:
    """The shapes of layer ``il``'s live float32 buffers with row buffers of ``capacity`` tokens, in
    ``LayerCache.arrays`` order: the raw ring [n_swa, D], then ``lane_shapes`` of the attention lane
    (a compressed layer) and of the indexer lane (a ratio-4 layer): what ``LayerCache.empty``
    allocates and ``grow`` extends. The memory plan (``model.memory_plan``) sizes the KV at a
    context with it; ``tests/test_memory_plan.py`` checks it against the allocated arrays."""
    r, coff = cfg.compress_ratio(il), cfg.coff(il)
    dims = ([cfg.head_dim] if r else []) + ([cfg.indexer_head_dim] if r == 4 else [])
    return [(cfg.n_swa, cfg.head_dim)] + [s for dim in dims for s in lane_shapes(r, dim, coff, capacity)]


# -- the serialised layout ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StateArray:
    """One array of the canonical state after ``n`` tokens: layer, lane (``LANES``), field
    (``FIELDS``; the raw lane has only its rows) and shape. ``state_layout`` is the one description
    of the layout: ``ModelCache`` (de)serialisation and the payload format walk it."""

    layer: int
    lane: int
    field: int
    shape: tuple[int, int]

    @property
    def key(self) -> str:
        """The ``ModelCache.to_numpy`` key of this array."""
        if self.lane == 0:
            return f"layer.{self.layer}.raw"
        return f"layer.{self.layer}.{LANES[self.lane]}.{FIELDS[self.field]}"


def state_layout(cfg: ModelConfig, n_tokens: int) -> list[StateArray]:
    """Every array of the canonical state after ``n_tokens`` tokens, in order (layer by layer: raw,
    then the attention lane's rows / kst / gst, then the indexer lane's), with its shape."""
    out = []
    for il in range(cfg.n_layer):
        r, coff = cfg.compress_ratio(il), cfg.coff(il)
        out.append(StateArray(il, 0, 0, (min(n_tokens, cfg.n_swa), cfg.head_dim)))
        lanes = [(1, cfg.head_dim)] if r else []
        if r == 4:
            lanes.append((2, cfg.indexer_head_dim))
        for lane, dim in lanes:
            out.append(StateArray(il, lane, 0, (n_tokens // r, dim)))
            out.append(StateArray(il, lane, 1, (coff * r, coff * dim)))
            out.append(StateArray(il, lane, 2, (coff * r, coff * dim)))
    return out


# -- where a call runs --------------------------------------------------------------------------------


class ChunkAt:
    """L tokens at host-known positions p0..p0+L-1: exact shapes, tables from ``ops``."""

    fixed = False

    def __init__(self, p0: int, L: int, ops, *, record: bool = False):
        self.p0, self.L, self.ops = p0, L, ops
        self.positions = p0 + np.arange(L)
        # a verify chunk: the compressor lanes keep their inputs so the cache can roll back into it
        self.record = record

    def tables(self, rope) -> tuple[mx.array, mx.array]:
        return self.ops.rope_tables(rope, self.positions)

    def inverse_tables(self, rope) -> tuple[mx.array, mx.array]:
        return self.ops.rope_tables(rope, self.positions, inverse=True)

    def window_tables(self, rope, starts: np.ndarray) -> tuple[mx.array, mx.array]:
        return self.ops.rope_tables(rope, starts)

    def ape(self, ape: mx.array, ratio: int) -> mx.array:
        return ape[mx.array(self.positions % ratio)]


class StepAt:
    """One token at the traced position ``pos`` (int32 scalar array), fixed shapes. ``cos``/``sin``
    [1, n_rot/2]: the layer's RoPE tables at pos; ``wcos``/``wsin``: at the first position of the
    compressor window holding pos (None on layers without one). Computed on the host, outside the
    trace, with the same tables as ``ChunkAt``."""

    fixed = True
    L = 1

    def __init__(self, pos: mx.array, cos: mx.array, sin: mx.array, wcos: mx.array | None = None,
                 wsin: mx.array | None = None, *, closes: bool):
        self.pos, self.cos, self.sin, self.wcos, self.wsin = pos, cos, sin, wcos, wsin
        # Known on the host, fixed for a trace: this token is the last of its compressor window
        # (pos % ratio == ratio - 1 on a layer with compressors; False on the others), so the window
        # is pooled into its row now. The decoder traces a layer once for each value.
        self.closes = bool(closes)

    def tables(self, rope) -> tuple[mx.array, mx.array]:
        return self.cos, self.sin

    def inverse_tables(self, rope) -> tuple[mx.array, mx.array]:
        return self.cos, -self.sin

    def window_tables(self, rope, starts) -> tuple[mx.array, mx.array]:
        return self.wcos, self.wsin

    def ape(self, ape: mx.array, ratio: int) -> mx.array:
        return mx.take(ape, (self.pos % ratio).reshape(1), axis=0)


# -- one compressor lane ----------------------------------------------------------------------------


def _overlap_slots(prv: mx.array, cur: mx.array, D: int) -> mx.array:
    """The R = 4 pooling slots of n windows from their tokens' projections prv (the previous window)
    and cur (this one), [n, 4, 2D] each: prv through columns [0, D) and cur through [D, 2D),
    interleaved token by token as ds4 accumulates them -> [n, 8, D]."""
    return mx.stack([prv[..., :D], cur[..., D:]], axis=2).reshape(prv.shape[0], 8, D)


def _frontier_after(kst: mx.array, gst: mx.array, k: mx.array, g: mx.array, p0: int, R: int):
    """The canonical frontier after a chunk of L = len(k) tokens at p0 from the frontier before it:
    (kst, gst, seq_k, seq_g, n_emit, first); seq = the old frontier's rows in position order ++ the
    chunk's projections, n_emit = windows the chunk completes, first = seq index of the first token
    of the first window still open before the chunk. Copies only (no arithmetic)."""
    W = k.shape[1]
    L = k.shape[0]
    r0 = p0 % R
    n_front = R + r0 if R == 4 else r0  # frontier rows in position order
    seq_k = mx.concatenate([kst[:n_front], k], axis=0)
    seq_g = mx.concatenate([gst[:n_front], g], axis=0)
    n_emit = (r0 + L) // R
    first = n_front - r0

    if R == 4:
        # Frontier: the last complete window (or the untouched previous one) + the partial one.
        new_k = [seq_k[4 * n_emit: 4 * n_emit + 4], seq_k[4 + 4 * n_emit:]]
        new_g = [seq_g[4 * n_emit: 4 * n_emit + 4], seq_g[4 + 4 * n_emit:]]
        n_rows_state = 8
    else:
        new_k, new_g = [seq_k[first + R * n_emit:]], [seq_g[first + R * n_emit:]]
        n_rows_state = R
    pad = n_rows_state - sum(a.shape[0] for a in new_k)
    kst = mx.concatenate(new_k + [mx.zeros((pad, W), dtype=mx.float32)], axis=0)
    gst = mx.concatenate(new_g + [mx.full((pad, W), EMPTY_SCORE, dtype=mx.float32)], axis=0)
    return kst, gst, seq_k, seq_g, n_emit, first


class CompressorLane:
    """A compressor's row buffer and canonical frontier (see the module docstring)."""

    def __init__(self, ratio: int, dim: int, coff: int, rows: mx.array, kst: mx.array, gst: mx.array):
        self.ratio, self.dim, self.coff = ratio, dim, coff
        self.rows, self.kst, self.gst = rows, kst, gst
        self.at: ChunkAt | StepAt | None = None
        # (p0, k, g) of the last call when it was a recording chunk (``ChunkAt.record``), else None:
        # what ``rollback`` rebuilds the frontier from
        self.inputs: tuple[int, mx.array, mx.array] | None = None

    @classmethod
    def empty(cls, ratio: int, dim: int, coff: int, capacity: int) -> "CompressorLane":
        rows, kst, gst = lane_shapes(ratio, dim, coff, capacity)
        return cls(ratio, dim, coff, mx.zeros(rows, dtype=mx.float32),
                   mx.zeros(kst, dtype=mx.float32), mx.full(gst, EMPTY_SCORE, dtype=mx.float32))

    def copy(self) -> "CompressorLane":
        out = CompressorLane(self.ratio, self.dim, self.coff, self.rows, self.kst, self.gst)
        out.inputs = self.inputs
        return out

    def arrays(self) -> list[mx.array]:
        return [self.rows, self.kst, self.gst]

    def set_arrays(self, arrays: list[mx.array]) -> None:
        self.rows, self.kst, self.gst = arrays

    def state(self, n: int) -> list[mx.array]:
        return [self.rows[: n // self.ratio], self.kst, self.gst]

    def grow(self, capacity: int) -> None:
        extra = capacity // self.ratio - self.rows.shape[0]
        if extra > 0:
            self.rows = mx.concatenate([self.rows, mx.zeros((extra, self.dim), dtype=mx.float32)], axis=0)

    def rollback(self, mark: "CompressorLane", n_keep: int, capacity: int) -> None:
        """Become the lane after the first ``n_keep`` tokens of the recording chunk that followed
        ``mark`` (module docstring: Rollback)."""
        p0, k, g = self.inputs
        R, L = self.ratio, n_keep - p0
        if L:
            self.kst, self.gst = _frontier_after(mark.kst, mark.gst, k[:L], g[:L], p0, R)[:2]
        else:
            self.kst, self.gst = mark.kst, mark.gst
        rows = mark.rows
        extra = capacity // R - rows.shape[0]
        if extra > 0:
            rows = mx.concatenate([rows, mx.zeros((extra, self.dim), dtype=mx.float32)], axis=0)
        a, b = p0 // R, n_keep // R
        if b > a:  # rows of the windows the kept tokens closed
            rows = mx.slice_update(rows, self.rows[a:b], mx.array([a]), axes=(0,))
        self.rows, self.inputs = rows, None

    # -- the layout-dependent half of ``Compressor.__call__`` -----------------------------------------

    def windows(self, k: mx.array, g: mx.array) -> tuple[mx.array, mx.array, np.ndarray | None] | None:
        """Take this call's projections k, g [L, coff·dim] (g incl. APE) into the frontier, leave it
        canonical, and return the windows to pool: (slot_k, slot_g [n, S, dim], first positions of
        the windows or None for a step), or None when a chunk or a step closes no window.

        Slots: R = 128: the window's tokens; R = 4: (previous window r, this window r) interleaved
        through the column halves [0, D) / [D, 2D), as ds4 accumulates them. A chunk returns every
        window it completes; a step the window its token closes (``StepAt.closes``).
        """
        if self.at.fixed:
            return self._step_windows(k, g)
        return self._chunk_windows(k, g)

    def _chunk_windows(self, k, g):
        R, D, W = self.ratio, self.dim, self.coff * self.dim
        p0, L = self.at.p0, self.at.L
        self.inputs = (p0, k, g) if self.at.record else None
        self.kst, self.gst, seq_k, seq_g, n_emit, first = _frontier_after(self.kst, self.gst, k, g, p0, R)
        if n_emit == 0:
            return None
        if R == 4:
            cur_k = seq_k[4: 4 + 4 * n_emit].reshape(n_emit, 4, W)
            cur_g = seq_g[4: 4 + 4 * n_emit].reshape(n_emit, 4, W)
            prv_k = seq_k[: 4 * n_emit].reshape(n_emit, 4, W)
            prv_g = seq_g[: 4 * n_emit].reshape(n_emit, 4, W)
            slot_k, slot_g = _overlap_slots(prv_k, cur_k, D), _overlap_slots(prv_g, cur_g, D)
        else:
            slot_k = seq_k[first: first + R * n_emit].reshape(n_emit, R, D)
            slot_g = seq_g[first: first + R * n_emit].reshape(n_emit, R, D)
        return slot_k, slot_g, R * (p0 // R + np.arange(n_emit))

    def _step_windows(self, k, g):
        R, D, W = self.ratio, self.dim, self.coff * self.dim
        self.inputs = None
        r = self.at.pos % R
        row = (r + 4 if R == 4 else r).reshape(1)
        kst = mx.slice_update(self.kst, k, row, axes=(0,))
        gst = mx.slice_update(self.gst, g, row, axes=(0,))
        if not self.at.closes:  # the window stays open: nothing to pool, its row is not visible yet
            self.kst, self.gst = kst, gst
            return None
        if R == 4:
            slot_k = _overlap_slots(kst[None, :4], kst[None, 4:], D)
            slot_g = _overlap_slots(gst[None, :4], gst[None, 4:], D)
            # the window's rows leave the frontier: they become the previous half
            self.kst = mx.concatenate([kst[4:], mx.zeros((4, W), dtype=mx.float32)], axis=0)
            self.gst = mx.concatenate([gst[4:], mx.full((4, W), EMPTY_SCORE, dtype=mx.float32)], axis=0)
        else:
            slot_k, slot_g = kst.reshape(1, R, D), gst.reshape(1, R, D)
            self.kst = mx.zeros_like(kst)
            self.gst = mx.full(gst.shape, EMPTY_SCORE, dtype=mx.float32)
        return slot_k, slot_g, None

    def commit(self, rows: mx.array | None) -> mx.array:
        """Store the pooled rows of ``windows`` and return the rows this call's queries may see:
        a chunk: exactly the valid rows after it [n_new // R, dim] (built as before any buffer
        existed: the previous rows followed by the emitted ones); a step: the whole buffer (the
        caller masks rows >= (pos + 1) // R; slots of open windows hold nothing meaningful)."""
        R = self.ratio
        if self.at.fixed:
            if rows is not None:
                self.rows = mx.slice_update(self.rows, rows, (self.at.pos // R).reshape(1), axes=(0,))
            return self.rows
        prev = self.rows[: self.at.p0 // R]
        if rows is None:
            return prev
        self.rows = mx.slice_update(self.rows, rows, mx.array([self.at.p0 // R]), axes=(0,))
        return mx.concatenate([prev, rows], axis=0)


# -- one layer --------------------------------------------------------------------------------------


class LayerCache:
    """The raw ring and the compressor / indexer lanes of one layer (module docstring)."""

    def __init__(self, n_swa: int, ring: mx.array, attn: CompressorLane | None = None,
                 index: CompressorLane | None = None, offset: int = 0):
        self.n_swa, self.ring, self.attn, self.index, self.offset = n_swa, ring, attn, index, offset
        self.at: ChunkAt | StepAt | None = None

    @classmethod
    def empty(cls, cfg: ModelConfig, il: int, capacity: int) -> "LayerCache":
        r, coff = cfg.compress_ratio(il), cfg.coff(il)
        return cls(cfg.n_swa, mx.zeros((cfg.n_swa, cfg.head_dim), dtype=mx.float32),
                   CompressorLane.empty(r, cfg.head_dim, coff, capacity) if r else None,
                   CompressorLane.empty(r, cfg.indexer_head_dim, coff, capacity) if r == 4 else None)

    @property
    def lanes(self) -> list[CompressorLane]:
        return [lane for lane in (self.attn, self.index) if lane is not None]

    def bind(self, at: ChunkAt | StepAt | None) -> None:
        """Set where the next call runs (its positions) for the layer and its lanes."""
        self.at = at
        for lane in self.lanes:
            lane.at = at

    def copy(self) -> "LayerCache":
        """An independent snapshot (arrays are immutable and every update rebinds, so sharing them
        is safe and costs nothing)."""
        return LayerCache(self.n_swa, self.ring, *(None if c is None else c.copy() for c in (self.attn, self.index)),
                          offset=self.offset)

    def arrays(self) -> list[mx.array]:
        """The live buffers (ring, then each lane's rows / kst / gst): what a compiled step takes
        and returns, what ``mx.eval`` needs."""
        return [self.ring] + [a for lane in self.lanes for a in lane.arrays()]

    def set_arrays(self, arrays: list[mx.array]) -> None:
        self.ring = arrays[0]
        for i, lane in enumerate(self.lanes):
            lane.set_arrays(arrays[1 + 3 * i: 4 + 3 * i])

    def view(self, arrays: list[mx.array], at: StepAt) -> "LayerCache":
        """A cache of the same structure over ``arrays`` (inside a compiled step's trace)."""
        out = self.copy()
        out.set_arrays(arrays)
        out.bind(at)
        return out

    def grow(self, capacity: int) -> None:
        for lane in self.lanes:
            lane.grow(capacity)

    def rollback(self, mark: "LayerCache", n_keep: int, capacity: int) -> None:
        """Become the layer's cache after the first ``n_keep`` tokens of the recording chunk that
        followed ``mark`` (module docstring: Rollback)."""
        p0, m = mark.offset, n_keep - mark.offset
        ring = mark.ring
        if m:  # the kept positions' raw rows, into the mark's ring (its other slots are plain decoding's)
            ring = self._write_ring(ring, mx.take(self.ring, self._window_slots(p0, m), axis=0), p0)
        self.ring = ring
        for lane, old in zip(self.lanes, mark.lanes):
            lane.rollback(old, n_keep, capacity)
        self.offset = n_keep

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    # -- canonical state ------------------------------------------------------------------------------

    def _window_slots(self, first: int, count: int) -> mx.array:
        return mx.array((np.arange(first, first + count) % self.n_swa).astype(np.int32))

    def raw_rows(self) -> mx.array:
        """The last min(n, n_swa) raw rows, oldest first."""
        n = self.offset
        m = min(n, self.n_swa)
        if not m:
            return mx.zeros((0, self.ring.shape[1]), dtype=mx.float32)
        return mx.take(self.ring, self._window_slots(n - m, m), axis=0)

    @property
    def state(self) -> list[mx.array]:
        """The canonical arrays, in ``state_layout`` order."""
        return [self.raw_rows()] + [a for lane in self.lanes for a in lane.state(self.offset)]

    def _write_ring(self, ring: mx.array, rows: mx.array, first: int) -> mx.array:
        """``rows`` (positions first.., at most n_swa of them) into their slots: two contiguous pieces."""
        m, s0 = rows.shape[0], first % self.n_swa
        head = min(m, self.n_swa - s0)
        ring = mx.slice_update(ring, rows[:head], mx.array([s0]), axes=(0,))
        if head < m:
            ring = mx.slice_update(ring, rows[head:], mx.array([0]), axes=(0,))
        return ring

    @classmethod
    def from_state(cls, cfg: ModelConfig, il: int, n: int, arrays: list[mx.array], capacity: int) -> "LayerCache":
        """Layer ``il``'s cache after ``n`` tokens from its canonical arrays (``state``; shapes
        checked by ``ModelCache.from_state``), with row buffers of ``capacity`` tokens."""
        lc = cls.empty(cfg, il, capacity)
        lc.set_state(n, arrays, capacity)
        return lc

    def set_state(self, n: int, arrays: list[mx.array], capacity: int) -> None:
        """Rebuild the buffers from canonical arrays after ``n`` tokens (exact copies)."""
        raw, rest = arrays[0], arrays[1:]
        m = raw.shape[0]
        ring = mx.zeros(self.ring.shape, dtype=mx.float32)
        self.ring = self._write_ring(ring, raw, n - m) if m else ring
        for i, lane in enumerate(self.lanes):
            rows, kst, gst = rest[3 * i: 3 * i + 3]
            buf = mx.zeros((capacity // lane.ratio, lane.dim), dtype=mx.float32)
            lane.rows = mx.slice_update(buf, rows, mx.array([0]), axes=(0,)) if rows.shape[0] else buf
            lane.kst, lane.gst = kst, gst
        self.offset = n

    # -- the layout-dependent half of ``Attention.__call__`` ------------------------------------------

    def update_raw(self, kv: mx.array):
        """Append this call's raw KV rows kv [L, D] and return what its queries attend to:
        a chunk: (raw [n_prev + L, D] = the previous window oldest first ++ kv, n_prev), masked per
        query by ``ops.raw_window``; a step: (keys [n_swa, D] at positions p-n_swa+1..p, mask
        [1, n_swa]) with the slots of positions < 0 masked."""
        at = self.at
        if at.fixed:
            pos = at.pos
            ring = mx.slice_update(self.ring, kv, (pos % self.n_swa).reshape(1), axes=(0,))
            j = mx.arange(self.n_swa, dtype=mx.int32)
            self.ring = ring
            return mx.take(ring, (pos + 1 + j) % self.n_swa, axis=0), (j >= self.n_swa - 1 - pos)[None]
        prev = self.raw_rows()
        raw = mx.concatenate([prev, kv], axis=0)
        keep = raw[-self.n_swa:] if raw.shape[0] > self.n_swa else raw
        self.ring = self._write_ring(self.ring, keep, at.p0 + at.L - keep.shape[0])
        return raw, prev.shape[0]


# -- the whole model ---------------------------------------------------------------------------------


@dataclass
class ModelCache:
    """The whole model's cache after ``n_tokens`` tokens (token ids and logits live in the session).

    ``layers[il]`` is layer il's ``LayerCache``, or None for a layer this process does not run (a
    pipeline rank holds only its own range: ``empty(cfg, layers)``); every method below walks the
    present entries only, so such a cache's state, arrays and bytes are its own layers'. A cache
    of every layer (one process) has no None entry and serialises as before."""

    layers: list[LayerCache | None] = field(default_factory=list)
    capacity: int = MIN_CAPACITY
    # A distributed run's rank 0: which state the other ranks hold of this cache (``model.distributed``).
    # ``copy`` passes it on, so a snapshot and its copies name the same state.
    tag: object = field(default=None, compare=False, repr=False)

    @classmethod
    def empty(cls, cfg: ModelConfig, layers: range | None = None) -> "ModelCache":
        """An empty cache of every layer, or only of ``layers`` (the others None)."""
        cap = capacity_for(0)
        own = range(cfg.n_layer) if layers is None else layers
        return cls([LayerCache.empty(cfg, il, cap) if il in own else None for il in range(cfg.n_layer)], cap)

    @property
    def own(self) -> list[LayerCache]:
        """The layer caches present (all of them but on a pipeline rank)."""
        return [lc for lc in self.layers if lc is not None]

    @property
    def n_tokens(self) -> int:
        own = self.own
        return own[0].offset if own else 0

    def advance(self, n: int) -> None:
        """Every layer has taken tokens up to ``n`` (the call's positions are unbound)."""
        for lc in self.own:
            lc.offset = n
            lc.bind(None)

    def reserve(self, last_position: int) -> None:
        """Grow the row buffers for a call whose last token is at ``last_position``."""
        cap = capacity_for(last_position)
        if cap > self.capacity:
            for lc in self.own:
                lc.grow(cap)
            self.capacity = cap

    def copy(self) -> "ModelCache":
        """An independent snapshot (cheap: see ``LayerCache.copy``)."""
        return ModelCache([None if lc is None else lc.copy() for lc in self.layers], self.capacity, self.tag)

    def mark(self) -> "ModelCache":
        """The state to roll back to (``rollback``): a copy, which costs nothing (module docstring)."""
        return self.copy()

    def rollback(self, mark: "ModelCache", n_keep: int) -> None:
        """Become exactly the cache after ``n_keep`` tokens, mark.n_tokens <= n_keep <= n_tokens,
        where the last call was one recording chunk (``ChunkAt(record=True)``) of at most n_swa
        tokens fed on top of ``mark`` (module docstring: Rollback). In place; ``mark`` is unchanged."""
        p0, n = mark.n_tokens, self.n_tokens
        if not p0 <= n_keep <= n:
            raise InferenceError(f"rollback to {n_keep} tokens: the cache holds {n}, its mark {p0}")
        own, old = self.own, mark.own
        if len(own) != len(old):
            raise InferenceError("rollback: the mark is a cache of other layers")
        for lc in own:
            if n - p0 > lc.n_swa or any(lane.inputs is None or lane.inputs[0] != p0 for lane in lc.lanes):
                raise InferenceError(f"rollback: the last call was not one recording chunk of at most "
                                     f"{lc.n_swa} tokens after the mark ({p0} -> {n} tokens)")
        cap = max(mark.capacity, capacity_for(max(n_keep - 1, 0)))
        for lc, m in zip(own, old):
            lc.rollback(m, n_keep, cap)
            lc.bind(None)
        self.capacity = cap

    def arrays(self) -> list[mx.array]:
        """Every live buffer (for ``mx.eval`` and memory accounting)."""
        return [a for lc in self.own for a in lc.arrays()]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    @property
    def state_nbytes(self) -> int:
        """Bytes of the canonical state (what a payload stores, what ds4's snapshot holds): raw
        window, valid rows and frontiers; ``nbytes`` counts the buffers as allocated."""
        n, total = self.n_tokens, 0
        for lc in self.own:
            total += min(n, lc.n_swa) * lc.ring.shape[1] * 4
            total += sum((n // lane.ratio * lane.dim + lane.kst.size + lane.gst.size) * 4 for lane in lc.lanes)
        return total

    # -- canonical state ------------------------------------------------------------------------------

    @property
    def state(self) -> list[mx.array]:
        """The canonical arrays in ``state_layout`` order (exact; independent of the capacity)."""
        return [a for lc in self.own for a in lc.state]

    def layout(self) -> list[StateArray]:
        """``state_layout`` of this cache as it is (its lanes and shapes; no config needed)."""
        out = []
        for il, lc in enumerate(self.layers):
            if lc is None:
                continue
            for i, a in enumerate(lc.state):
                lane, fld = (0, 0) if i == 0 else (1 + (i - 1) // 3, (i - 1) % 3)
                out.append(StateArray(il, lane, fld, tuple(a.shape)))
        return out

    @classmethod
    def from_state(cls, cfg: ModelConfig, n_tokens: int, arrays: list[mx.array]) -> "ModelCache":
        """Inverse of ``state``: canonical arrays (``state_layout(cfg, n_tokens)`` order and shapes,
        checked) -> a cache with buffers of ``capacity_for`` the last position."""
        layout = state_layout(cfg, n_tokens)
        if len(arrays) != len(layout):
            raise InferenceError(f"model state: {len(arrays)} arrays, expected {len(layout)}")
        for spec, a in zip(layout, arrays):
            if tuple(a.shape) != spec.shape:
                raise InferenceError(f"model state: {spec.key!r} has shape {tuple(a.shape)}, expected {spec.shape}")
        cap = capacity_for(max(n_tokens - 1, 0))
        layers, i = [], 0
        for il in range(cfg.n_layer):
            k = sum(1 for spec in layout if spec.layer == il)
            layers.append(LayerCache.from_state(cfg, il, n_tokens, arrays[i: i + k], cap))
            i += k
        cache = cls(layers, cap)
        mx.eval(*cache.arrays())
        return cache

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Flat dict of float32 arrays (plus ``n_tokens``), keys ``layer.{il}.{raw|attn.rows|…}``."""
        d: dict[str, np.ndarray] = {"n_tokens": np.array(self.n_tokens, dtype=np.int64)}
        for spec, a in zip(self.layout(), self.state):
            d[spec.key] = to_host(a, np.float32)
        return d

    @classmethod
    def from_numpy(cls, cfg: ModelConfig, d: dict[str, np.ndarray]) -> "ModelCache":
        """Inverse of ``to_numpy``; checks every shape against the config (``state_layout``)."""
        if "n_tokens" not in d:
            raise InferenceError("model state: 'n_tokens' is missing")
        n = int(np.asarray(d["n_tokens"]))
        if n < 0:
            raise InferenceError(f"model state: n_tokens is {n}")
        arrays = []
        for spec in state_layout(cfg, n):
            if spec.key not in d:
                raise InferenceError(f"model state: array {spec.key!r} is missing")
            a = np.asarray(d[spec.key])
            if a.shape != spec.shape:
                raise InferenceError(f"model state: {spec.key!r} has shape {a.shape}, expected {spec.shape}")
            arrays.append(mx.array(a.astype(np.float32, copy=False)))
        return cls.from_state(cfg, n, arrays)
