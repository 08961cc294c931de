"""Counting the per-token host work of a decode step: ``mx.array(...)`` constructions (host data
copied into MLX) and ``mx.eval`` calls, by the source file that made them.

Only calls made through the module attributes (``mx.array(...)``, ``mx.eval(...)``, how the package
calls them) are seen; ``isinstance(x, mx.array)`` keeps working while counting.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys

import mlx.core as mx


@contextlib.contextmanager
def counting():
    """Yields a Counter of (file basename, "array" | "eval") -> calls, filled while the block runs."""
    counts: collections.Counter = collections.Counter()
    real_array, real_eval = mx.array, mx.eval

    def caller() -> str:
        return os.path.basename(sys._getframe(2).f_code.co_filename)

    class _Meta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, real_array)

        def __call__(cls, *args, **kwargs):
            counts[(os.path.basename(sys._getframe(1).f_code.co_filename), "array")] += 1
            return real_array(*args, **kwargs)

    class CountingArray(metaclass=_Meta):
        pass

    def counting_eval(*args, **kwargs):
        counts[(caller(), "eval")] += 1
        return real_eval(*args, **kwargs)

    mx.array, mx.eval = CountingArray, counting_eval
    try:
        yield counts
    finally:
        mx.array, mx.eval = real_array, real_eval
