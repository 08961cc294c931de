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
        out = []
        for l in self.layers:
            out.append(l.raw)
            for c in (l.attn, l.index):
                if c is not None:
                    out += [c.rows, c.kst, c.gst]
        return out

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Flat dict of float32 arrays (plus ``n_tokens``), keys ``layer.{il}.{raw|attn.rows|…}``."""
        d: dict[str, np.ndarray] = {"n_tokens": np.array(self.n_tokens, dtype=np.int64)}
        for il, l in enumerate(self.layers):
            d[f"layer.{il}.raw"] = np.array(l.raw, dtype=np.float32)
            for lane, c in (("attn", l.attn), ("index", l.index)):
                if c is not None:
                    for k in ("rows", "kst", "gst"):
                        d[f"layer.{il}.{lane}.{k}"] = np.array(getattr(c, k), dtype=np.float32)
        return d

    @classmethod
    def from_numpy(cls, cfg: ModelConfig, d: dict[str, np.ndarray]) -> "ModelState":
        """Inverse of ``to_numpy``; checks every shape against the config."""
        def get(key: str, shape: tuple[int | None, ...]) -> mx.array:
            if key not in d:
                raise InferenceError(f"model state: array {key!r} is missing")
            a = np.asarray(d[key])
            if a.ndim != len(shape) or any(s is not None and s != a.shape[i] for i, s in enumerate(shape)):
                raise InferenceError(f"model state: {key!r} has shape {a.shape}, expected {shape}")
            return mx.array(a.astype(np.float32, copy=False))

        if "n_tokens" not in d:
            raise InferenceError("model state: 'n_tokens' is missing")
        n = int(np.asarray(d["n_tokens"]))
        if n < 0:
            raise InferenceError(f"model state: n_tokens is {n}")
        layers = []
        for il in range(cfg.n_layer):
            r = cfg.compress_ratio(il)
            raw = get(f"layer.{il}.raw", (min(n, cfg.n_swa), cfg.head_dim))
            lanes: dict[str, CompressorState | None] = {"attn": None, "index": None}
            for lane, dim, on in (("attn", cfg.head_dim, r > 0), ("index", cfg.indexer_head_dim, r == 4)):
                if not on:
                    continue
                coff = cfg.coff(il)
                fshape = (coff * r, coff * dim)
                lanes[lane] = CompressorState(get(f"layer.{il}.{lane}.rows", (n // r, dim)),
                                              get(f"layer.{il}.{lane}.kst", fshape),
                                              get(f"layer.{il}.{lane}.gst", fshape))
            layers.append(LayerState(raw, lanes["attn"], lanes["index"]))
        return cls(n, layers)
