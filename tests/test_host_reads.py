"""Reads of MLX arrays into numpy raise when the evaluation fails (``ds4_mlx.model.host.to_host``).

numpy's ``np.array(a)`` on an MLX array whose evaluation fails returns whatever the output buffer
held and raises nothing (numpy clears the buffer protocol's error and falls back to ``__array__``,
which evaluates again after MLX has already handed the error out; how often depends on timing, so
no test here relies on the hazard itself). That turned a killed rank of an expert-parallel run into
decoding on garbage and then a hang (tests/test_distributed.py, the killed-rank tests with the
native expert products); these tests pin the guard."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import ds4_mlx
from ds4_mlx.model.host import to_host
from ds4_mlx.engine.session import Session

from host_traffic import HostTraffic  # benchmarks/, on the path by conftest


def _failing() -> mx.array:
    # An evaluation that fails on the CPU: the LU factorisation of a singular matrix.
    return mx.linalg.inv(mx.zeros((2, 2)), stream=mx.cpu)


def test_to_host_raises_the_evaluations_error():
    with pytest.raises(RuntimeError, match="LU factorization failed"):
        to_host(_failing())
    with pytest.raises(RuntimeError, match="LU factorization failed"):
        to_host(_failing(), np.float32)


def test_to_host_reads_values_and_converts():
    a = mx.arange(6, dtype=mx.int32).reshape(2, 3) * 2
    out = to_host(a, np.float32)
    assert out.dtype == np.float32 and out.tolist() == [[0, 2, 4], [6, 8, 10]]
    assert to_host([1, 2]).tolist() == [1, 2]  # not MLX: what numpy makes of it


@pytest.mark.parametrize("numerics", ["default", "ds4-cpu"])
def test_generation_reads_nothing_from_mlx_without_evaluating_it_first(tiny_model_path, numerics):
    """Prefill, compiled decode steps, logits and a snapshot's payload on the tiny model: every numpy
    conversion of an MLX array in the package comes right after its own ``mx.eval`` (HostTraffic
    counts a conversion that evaluates by itself as an ``np.*`` sync). A new ``np.array(mlx_array)``
    on these paths fails here."""
    model = ds4_mlx.load(tiny_model_path, numerics=numerics).network
    s = Session(model, 256, compile=True)
    with HostTraffic() as traffic:
        s.append(list(range(1, 30)))
        for t in range(4):
            s.eval(200 + t)
            s.logits()
        s.state.to_numpy()
    unguarded = {k: v for k, v in traffic.by_kind.items() if k.startswith("np.")}
    assert not unguarded, (unguarded, [k for k in traffic.by_site if k[1].startswith("np.")])
