"""Per-layer inference state as explicit MLX arrays (everything needed to continue exactly).

After n tokens, layer il holds (spec §9.2; R = compress ratio, D = head_dim, Di = indexer_head_dim):
    raw          [min(n, n_swa), D]   last raw KV rows, oldest first, f16-exact float32     all layers
    attn.rows    [n // R, D]          compressed KV rows (FP8-rounded, f16-exact)            R > 0
    attn.kst/gst [coff·R, coff·D]     compressor frontier: values / scores (scores incl. APE) R > 0
    index.rows   [n // 4, Di]         indexer compressed rows (Hadamard + FP4, f16-exact)    R = 4
    index.kst/gst [8, 2·Di]           indexer compressor frontier                            R = 4
The frontier is always the canonical one of spec §6.3 (R = 4: rows 0..3 = last complete window,
rows 4..4+r-1 = the partial window, r = n mod 4; R = 128: rows 0..r-1 = the partial window; all
other rows K = 0, G = EMPTY_SCORE) — every path (prefill, decode, resumed prefill) produces it.

Arrays are never modified in place (each step builds new ones), so ``copy()`` is a cheap snapshot
and a restored snapshot continues bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import InferenceError  # noqa: F401  (re-exported for existing callers)
from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.model.numerics import EMPTY_SCORE


LANES = ("raw", "attn", "index")
FIELDS = ("rows", "kst", "gst")


@dataclass(frozen=True)
class StateArray:
    """One array of the state after ``n`` tokens: layer, lane (``LANES``), field (``FIELDS``; the raw
    lane has only its rows) and shape. ``state_layout`` is the one description of the state's layout:
    ``ModelState`` (de)serialisation and the payload format (``engine/payload.py``) walk it."""

    layer: int
    lane: int
    field: int
    shape: tuple[int, int]

    @property
    def key(self) -> str:
        """The ``ModelState.to_numpy`` key of this array."""
        if self.lane == 0:
            return f"layer.{self.layer}.raw"
        return f"layer.{self.layer}.{LANES[self.lane]}.{FIELDS[self.field]}"


def state_layout(cfg: ModelConfig, n_tokens: int) -> list[StateArray]:
    """Every array of the state after ``n_tokens`` tokens, in order (layer by layer: raw, then the
    attention lane's rows / kst / gst, then the indexer lane's), with its shape (module docstring)."""
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


@dataclass
class CompressorState:
    rows: mx.array  # [n_rows, dim]
    kst: mx.array  # [coff·ratio, coff·dim]
    gst: mx.array  # [coff·ratio, coff·dim]

    @classmethod
    def empty(cls, ratio: int, dim: int, coff: int) -> "CompressorState":
        """No rows, the canonical empty frontier; ``coff`` = ``ModelConfig.coff`` of the layer."""
        shape = (coff * ratio, coff * dim)
        return cls(mx.zeros((0, dim), dtype=mx.float32), mx.zeros(shape, dtype=mx.float32),
                   mx.full(shape, EMPTY_SCORE, dtype=mx.float32))

    @property
    def n_rows(self) -> int:
        return self.rows.shape[0]


@dataclass
class LayerState:
    raw: mx.array  # [min(n, n_swa), head_dim]
    attn: CompressorState | None = None
    index: CompressorState | None = None

    def arrays(self) -> list[mx.array]:
        """The layer's arrays in ``state_layout`` order: raw, then each lane's rows / kst / gst."""
        out = [self.raw]
        for c in (self.attn, self.index):
            if c is not None:
                out += [c.rows, c.kst, c.gst]
        return out


@dataclass
class ModelState:
    """The whole model's state after ``n_tokens`` tokens (token ids and logits live in the session)."""

    n_tokens: int
    layers: list[LayerState] = field(default_factory=list)

    @classmethod
    def empty(cls, cfg: ModelConfig) -> "ModelState":
        layers = []
        for il in range(cfg.n_layer):
            r = cfg.compress_ratio(il)
            layers.append(LayerState(
                raw=mx.zeros((0, cfg.head_dim), dtype=mx.float32),
                attn=CompressorState.empty(r, cfg.head_dim, cfg.coff(il)) if r else None,
                index=CompressorState.empty(r, cfg.indexer_head_dim, cfg.coff(il)) if r == 4 else None,
            ))
        return cls(0, layers)

    def copy(self) -> "ModelState":
        """An independent snapshot (arrays are immutable, so sharing them is safe)."""
        def cc(c: CompressorState | None) -> CompressorState | None:
            return None if c is None else CompressorState(c.rows, c.kst, c.gst)
        return ModelState(self.n_tokens, [LayerState(l.raw, cc(l.attn), cc(l.index)) for l in self.layers])

    def arrays(self) -> list[mx.array]:
        """The state's arrays in ``state_layout`` order."""
        return [a for layer in self.layers for a in layer.arrays()]

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Flat dict of float32 arrays (plus ``n_tokens``), keys ``layer.{il}.{raw|attn.rows|…}``."""
        d: dict[str, np.ndarray] = {"n_tokens": np.array(self.n_tokens, dtype=np.int64)}
        for spec, a in zip(state_layout_of(self), self.arrays()):
            d[spec.key] = np.array(a, dtype=np.float32)
        return d

    @classmethod
    def from_numpy(cls, cfg: ModelConfig, d: dict[str, np.ndarray]) -> "ModelState":
        """Inverse of ``to_numpy``; checks every shape against the config (``state_layout``)."""
        if "n_tokens" not in d:
            raise InferenceError("model state: 'n_tokens' is missing")
        n = int(np.asarray(d["n_tokens"]))
        if n < 0:
            raise InferenceError(f"model state: n_tokens is {n}")
        got: dict[tuple[int, int, int], mx.array] = {}
        for spec in state_layout(cfg, n):
            if spec.key not in d:
                raise InferenceError(f"model state: array {spec.key!r} is missing")
            a = np.asarray(d[spec.key])
            if a.shape != spec.shape:
                raise InferenceError(f"model state: {spec.key!r} has shape {a.shape}, expected {spec.shape}")
            got[spec.layer, spec.lane, spec.field] = mx.array(a.astype(np.float32, copy=False))
        layers = []
        for il in range(cfg.n_layer):
            lanes = [CompressorState(*(got[il, lane, f] for f in range(3))) if (il, lane, 0) in got else None
                     for lane in (1, 2)]
            layers.append(LayerState(got[il, 0, 0], *lanes))
        return cls(n, layers)


def state_layout_of(state: ModelState) -> list[StateArray]:
    """``state_layout`` of a state as it is (its lanes and shapes; no config needed)."""
    out = []
    for il, layer in enumerate(state.layers):
        out.append(StateArray(il, 0, 0, tuple(layer.raw.shape)))
        for lane, c in ((1, layer.attn), (2, layer.index)):
            if c is not None:
                out += [StateArray(il, lane, f, tuple(getattr(c, FIELDS[f]).shape)) for f in range(3)]
    return out
