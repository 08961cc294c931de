"""Fixed-shape decode state: the same information as ``ModelState``, laid out so that the arrays of
a decode step keep their shapes from one token to the next (what ``mx.compile`` needs to reuse a trace).

Per layer, after n tokens (spec §9.2; R = compress ratio, D = head_dim, Di = indexer_head_dim):

    ring        [n_swa, D]      raw KV row of position q in slot q mod n_swa; slots of positions
                                < max(0, n - n_swa) hold stale or zero rows (masked by position)
    attn.rows   [cap // R, D]   compressed rows 0 .. n//R - 1 valid; slot n//R may hold the pooled
                                row of the still open window (written every step, counted only when
                                the window closes); later slots are zero
    attn.kst/gst                the canonical compressor frontier, exactly as in ``ModelState``
    index.*                     the same for the indexer lane of ratio-4 layers

``capacity`` (tokens) sizes the row buffers. It depends only on the number of tokens, never on the
session's context size: a power of two, at least ``MIN_CAPACITY``, so a session that decodes from
position p uses the same shapes (and therefore the same arithmetic) as any other one at p, and a
buffer grows — one retrace of the compiled step per layer — only log2(ctx / MIN_CAPACITY) times
over a whole context.

Conversions are exact copies: ``from_state`` scatters the raw rows into their ring slots and pads
the compressed rows with zeros; ``to_state`` gathers the last min(n, n_swa) ring slots oldest first
and slices the valid rows. The frontier is canonical in both representations, so it is shared as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.model.state import CompressorState, InferenceError, LayerState, ModelState

MIN_CAPACITY = 4096  # tokens; a multiple of every compress ratio


def capacity_for(n_tokens: int) -> int:
    """The row-buffer capacity (tokens) for a step at position ``n_tokens``: the smallest power of
    two >= max(MIN_CAPACITY, n_tokens + 1), so the slot the step writes, n_tokens // R, exists."""
    cap = MIN_CAPACITY
    while cap < n_tokens + 1:
        cap *= 2
    return cap


@dataclass
class LaneCache:
    rows: mx.array  # [capacity // ratio, dim]
    kst: mx.array  # [coff·ratio, coff·dim]
    gst: mx.array


@dataclass
class LayerCache:
    ring: mx.array  # [n_swa, head_dim]
    attn: LaneCache | None = None
    index: LaneCache | None = None


@dataclass
class DecodeCache:
    """Live decode state after ``n_tokens`` tokens. Unlike ``ModelState`` it is updated in place by
    each decode step (so MLX may reuse the row buffers instead of copying them); take a
    ``to_state()`` for anything that must outlive the next step."""

    n_tokens: int
    capacity: int
    layers: list[LayerCache]

    @classmethod
    def from_state(cls, cfg: ModelConfig, state: ModelState, capacity: int | None = None) -> "DecodeCache":
        n = state.n_tokens
        cap = capacity_for(n) if capacity is None else capacity
        if cap <= n or any(cap % cfg.compress_ratio(il) for il in range(cfg.n_layer) if cfg.compress_ratio(il)):
            raise InferenceError(f"decode cache capacity {cap} does not fit {n} tokens and the compress ratios")
        m = min(n, cfg.n_swa)
        slots = (np.arange(n - m, n) % cfg.n_swa).astype(np.int32)
        layers = []
        for il, ls in enumerate(state.layers):
            if ls.raw.shape[0] != m:
                raise InferenceError(f"model state layer {il}: {ls.raw.shape[0]} raw rows, expected {m}")
            ring = mx.zeros((cfg.n_swa, cfg.head_dim), dtype=mx.float32)
            if m:
                ring[mx.array(slots)] = ls.raw
            r = cfg.compress_ratio(il)
            layers.append(LayerCache(ring, _lane_in(ls.attn, cap, r), _lane_in(ls.index, cap, r)))
        cache = cls(n, cap, layers)
        mx.eval(*cache.arrays())
        return cache

    def to_state(self, cfg: ModelConfig) -> ModelState:
        n = self.n_tokens
        m = min(n, cfg.n_swa)
        idx = mx.array((np.arange(n - m, n) % cfg.n_swa).astype(np.int32))
        layers = []
        for il, lc in enumerate(self.layers):
            r = cfg.compress_ratio(il)
            raw = mx.take(lc.ring, idx, axis=0) if m else mx.zeros((0, cfg.head_dim), dtype=mx.float32)
            layers.append(LayerState(raw, _lane_out(lc.attn, n, r), _lane_out(lc.index, n, r)))
        state = ModelState(n, layers)
        mx.eval(*state.arrays())
        return state

    def grown(self, capacity: int) -> "DecodeCache":
        """The same state with row buffers of ``capacity`` tokens (zero-padded)."""
        if capacity < self.capacity:
            raise InferenceError(f"decode cache cannot shrink from {self.capacity} to {capacity} tokens")
        if capacity == self.capacity:
            return self

        def pad(lane: LaneCache | None, r: int) -> LaneCache | None:
            if lane is None:
                return None
            extra = capacity // r - lane.rows.shape[0]
            rows = mx.concatenate([lane.rows, mx.zeros((extra, lane.rows.shape[1]), dtype=mx.float32)], axis=0)
            return LaneCache(rows, lane.kst, lane.gst)

        layers = []
        for lc in self.layers:
            r = self.capacity // lc.attn.rows.shape[0] if lc.attn is not None else 0
            layers.append(LayerCache(lc.ring, pad(lc.attn, r), pad(lc.index, r)))
        out = DecodeCache(self.n_tokens, capacity, layers)
        mx.eval(*out.arrays())
        return out

    def arrays(self) -> list[mx.array]:
        out = []
        for lc in self.layers:
            out.append(lc.ring)
            for lane in (lc.attn, lc.index):
                if lane is not None:
                    out += [lane.rows, lane.kst, lane.gst]
        return out


def _lane_in(c: CompressorState | None, cap: int, r: int) -> LaneCache | None:
    if c is None:
        return None
    n_rows, dim = c.rows.shape
    rows = mx.concatenate([c.rows, mx.zeros((cap // r - n_rows, dim), dtype=mx.float32)], axis=0)
    return LaneCache(rows, c.kst, c.gst)


def _lane_out(lane: LaneCache | None, n: int, r: int) -> CompressorState | None:
    if lane is None:
        return None
    return CompressorState(lane.rows[: n // r], lane.kst, lane.gst)
