"""Partial rotary embedding on the tail of a head: adjacent pairs, per-layer base and YaRN ramp.

Only the last ``n_rot`` dims of a vector are rotated, as ``n_rot/2`` adjacent pairs (x[2i], x[2i+1])
(GGML "normal" mode, not the NeoX half split). Dense layers use base 10000 unscaled; compressed
layers use base 160000 with YaRN (frequency scale 1/16 blended by a linear ramp over the pair
index, no magnitude change). The same rotation applies to queries, raw KV rows, compressed rows
(at their window's first position), indexer queries, and — inverted — to the attention output.

Angles are computed in numpy float32 exactly as ds4's CPU loop does: θ starts at the position and
is multiplied by base^(-2/n_rot) once per pair (an iterated float32 product, not a pow per pair),
then blended; cos/sin are the correctly rounded float32 values of that float32 angle.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ds4_mlx.formats.config import ModelConfig

f32 = np.float32


def _yarn_corr_dim(n_rot: int, n_ctx_orig: int, beta: float, base: float) -> np.float32:
    num = f32(n_rot) * np.log(f32(n_ctx_orig) / (f32(beta) * f32(2.0) * f32(math.pi)))
    return f32(num / (f32(2.0) * np.log(f32(base))))


class Rope:
    """Rotation parameters of one layer (all its RoPE uses share them)."""

    def __init__(self, cfg: ModelConfig, il: int):
        self.n_rot = cfg.n_rot
        self.half = cfg.n_rot // 2
        compressed = cfg.compress_ratio(il) != 0
        self.base = f32(cfg.compress_rope_freq_base if compressed else cfg.rope_freq_base)
        self.freq_scale = f32(1.0) / f32(cfg.rope_scaling_factor) if compressed else f32(1.0)
        self.yarn = compressed and cfg.rope_scaling_factor > 1.0
        # powf(base, -2/n_rot), correctly rounded (numpy's float32 power is off by an ulp for 10000)
        self.theta_scale = f32(np.float64(self.base) ** np.float64(f32(-2.0) / f32(self.n_rot)))
        self.mscale = f32(1.0)
        if self.yarn:
            lo = np.floor(_yarn_corr_dim(self.n_rot, cfg.rope_orig_ctx, cfg.yarn_beta_fast, self.base))
            hi = np.ceil(_yarn_corr_dim(self.n_rot, cfg.rope_orig_ctx, cfg.yarn_beta_slow, self.base))
            lo, hi = max(f32(0.0), lo), min(f32(self.n_rot - 1), hi)
            y = (np.arange(self.half, dtype=f32) - lo) / max(f32(0.001), f32(hi - lo))
            self.ramp = (f32(1.0) - np.minimum(f32(1.0), np.maximum(f32(0.0), y))).astype(f32)
            # ds4 hands the helper attn_factor = 1/(1 + 0.1 ln(1/s)) so its YaRN magnitude factor
            # cancels; the float32 product is exactly 1 for s = 1/16, but keep whatever it is.
            corr = f32(1.0) + f32(0.1) * np.log(f32(1.0) / self.freq_scale)
            self.mscale = (f32(1.0) / corr) * corr

    def angles(self, positions: np.ndarray) -> np.ndarray:
        """θ[len(positions), n_rot/2] in float32, as ds4's rope_tail_ext_inplace computes it."""
        theta_ext = np.asarray(positions, dtype=np.int64).astype(f32)
        out = np.empty((theta_ext.shape[0], self.half), dtype=f32)
        for i in range(self.half):
            interp = self.freq_scale * theta_ext
            if self.yarn:
                r = self.ramp[i]
                out[:, i] = interp * (f32(1.0) - r) + theta_ext * r
            else:
                out[:, i] = interp
            theta_ext = theta_ext * self.theta_scale
        return out

    def tables(self, positions: np.ndarray, inverse: bool = False,
               libm: bool = False) -> tuple[mx.array, mx.array]:
        """(cos, sin) float32 MLX arrays [len(positions), n_rot/2]; inverse negates sin.

        Default: correctly rounded float32 cos/sin of the float32 angle. ``libm`` (ds4-cpu ops): the C library's
        cosf/sinf, as ds4 calls them (glibc's are within 0.56 ulp, so ~1 % of values differ from
        the correctly rounded ones; falls back to those when no C math library can be loaded).
        """
        positions = np.asarray(positions, dtype=np.int64)
        if libm and _libm_trig() is not None:
            c, s = self._libm_rows(positions)
        else:
            th = self.angles(positions).astype(np.float64)
            c, s = np.cos(th).astype(f32), np.sin(th).astype(f32)
        if self.mscale != f32(1.0):
            c, s = c * self.mscale, s * self.mscale
        if inverse:
            s = -s
        return mx.array(c), mx.array(s)

    def _libm_rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cosf, sinf = _libm_trig()
        key = (float(self.base), float(self.freq_scale), self.yarn, self.half)
        cache = _LIBM_CACHE.setdefault(key, {})
        missing = [int(p) for p in np.unique(positions) if int(p) not in cache]
        if missing:
            th = self.angles(np.array(missing))
            for p, row in zip(missing, th):
                cache[p] = (np.array([cosf(float(v)) for v in row], dtype=f32),
                            np.array([sinf(float(v)) for v in row], dtype=f32))
            while len(cache) > _LIBM_CACHE_MAX:
                cache.pop(next(iter(cache)))
        rows = [cache[int(p)] for p in positions]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


_LIBM_CACHE: dict[tuple, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
_LIBM_CACHE_MAX = 1 << 16
_LIBM: list = []


def _libm_trig():
    """(cosf, sinf) of the C math library through ctypes, or None where there is none."""
    if not _LIBM:
        fns = None
        try:
            import ctypes
            import ctypes.util

            name = ctypes.util.find_library("m") or "libm.so.6"
            lib = ctypes.CDLL(name)
            fns = []
            for fname in ("cosf", "sinf"):
                fn = getattr(lib, fname)
                fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
                fns.append(fn)
            fns = tuple(fns)
        except (OSError, AttributeError):
            fns = None
        _LIBM.append(fns)
    return _LIBM[0]


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate the last 2·cos.shape[-1] dims of x [T, ..., D] with per-row tables [T, n_rot/2]."""
    half = cos.shape[-1]
    n_rot = 2 * half
    lead = x.shape[:-1]
    bshape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    c, s = cos.reshape(bshape), sin.reshape(bshape)
    tail = x[..., x.shape[-1] - n_rot:].reshape(*lead, half, 2)
    x0, x1 = tail[..., 0], tail[..., 1]
    y = mx.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(*lead, n_rot)
    return mx.concatenate([x[..., : x.shape[-1] - n_rot], y], axis=-1)
