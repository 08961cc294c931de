"""Reading an MLX array into numpy: ``to_host``, the one way the model and the engine do it.

``np.array(a)`` / ``np.asarray(a)`` on an unevaluated MLX array hide a failed evaluation. numpy asks
for the buffer protocol first; MLX evaluates the array there, the evaluation raises, and numpy clears
that error and falls back to ``a.__array__()``. MLX has already handed the error out (a stream's
error is raised once, then cleared), so the second evaluation "succeeds" and numpy returns whatever
the output buffer held: a silent wrong answer, never an exception. Seen for real in an expert-parallel
run: a peer was killed, the ring backend failed the layer's ``all_sum``, the router's read swallowed
it, decoding went on with garbage, and the next ``all_sum`` waited for ever on the dead connection.
``mx.eval`` raises normally, so evaluating first and reading second gives the error to the caller.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def to_host(a, dtype=None) -> np.ndarray:
    """``np.array(a, dtype)`` that raises when ``a``'s evaluation fails (module docstring); a
    non-MLX ``a`` is converted as numpy would."""
    if isinstance(a, mx.array):
        mx.eval(a)
    return np.array(a, dtype=dtype)
