"""The float32 rounding bound of a dot product, for assertions on products whose summation order a
BLAS or MLX kernel chooses (kernel family, blocking, thread split: one machine's bits are not another's).

Any two orders of a float32 sum of n products x_i*w_i are within 2*gamma(n-1)*sum|x_i*w_i| of each other,
gamma(k) = k*u/(1-k*u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, §3.1). The
products themselves are exact here (float32 inputs, the dequantized weights exact in float32) up to
their one rounding, which the bound's n-1 leaves room for. Rows from the wrong place or a wrong formula
are O(1) off; this bound is ~1e-5 relative."""

from __future__ import annotations

import numpy as np

U = 2.0 ** -24


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


def matmul_bound(x, w) -> np.ndarray:
    """Bound on |a - b| for two float32 evaluations a, b of x @ w.T (x [T, n], w [out, n]) -> [T, out]."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return 2 * gamma(x.shape[-1]) * (np.abs(x) @ np.abs(w).T)


def assert_within_matmul_bound(a, b, x, w, what="") -> None:
    """a and b are two float32 orders of the same x @ w.T (NaN-free inputs)."""
    diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    bound = matmul_bound(x, w)
    bad = ~(diff <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} products beyond the float32 summation "
                           f"bound, worst {float(np.max(diff - bound)):.3g} over it")
