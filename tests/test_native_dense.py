"""The native Q8_0 product (``ds4_mlx/native/dense.c``) and the output head it multiplies on the host.

The C code sums every row in one fixed order (32 lanes, a fixed fold): a numpy twin of that order gives
the same bits, for the AVX2 loop and for the portable one (built here with ``-DDS4N_PORTABLE``), whatever
the thread count, on hostile scales too. The model: in DEFAULT numerics on the CPU with the host
strategy the head is multiplied there (``Model.host_head``), builds no float32 form, and its logits equal
MLX's float32 head's up to the summation order; ds4-cpu, the device strategy and ``DS4_MLX_NATIVE=off``
keep MLX's head."""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil

import ds4_mlx
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx import native
from ds4_mlx.errors import InferenceError, LayoutError
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.quants import dequantize_rows
from ds4_mlx.model.linear import DenseWeight
from ds4_mlx.engine.session import Session


def _have_compiler() -> bool:
    cc = shlex.split(os.environ.get("CC", "").strip() or "cc")
    return shutil.which(cc[0]) is not None


@pytest.fixture(scope="module")
def lib():
    if not _have_compiler():
        pytest.skip("no C compiler: the native path cannot be built here")
    got = native.library()
    if got is None and native._setting() == "off":
        pytest.skip("DS4_MLX_NATIVE=off")
    assert got is not None, native.status()
    return got


def q8_0_blocks(rng, rows: int, n_in: int, hostile: bool = False) -> np.ndarray:
    """uint8 [rows, n_in/32*34]: f16 scales of realistic sizes (``hostile``: also 0, subnormal, inf,
    NaN and the largest half) and random int8 codes (the extremes -128 and 127 included)."""
    nb = n_in // 32
    d = (rng.uniform(0.2, 2.0, (rows, nb)) * rng.choice([1e-4, 1e-2, 0.5], (rows, nb))).astype(np.float16)
    if hostile:
        flat = d.reshape(-1)
        flat[:6] = np.array([0.0, 6e-8, np.inf, np.nan, 65504.0, -65504.0], dtype=np.float16)[: flat.size]
    q = rng.integers(-128, 128, (rows, nb, 32), dtype=np.int16).astype(np.int8)
    q[0, 0, :2] = (-128, 127)
    raw = np.empty((rows, nb, 34), dtype=np.uint8)
    raw[:, :, :2] = d.view(np.uint8).reshape(rows, nb, 2)
    raw[:, :, 2:] = q.view(np.uint8)
    return raw.reshape(rows, nb * 34)


def twin(raw: np.ndarray, n_in: int, x: np.ndarray) -> np.ndarray:
    """dense.c's arithmetic in numpy, operation by operation (float32 throughout, no fused
    multiply-adds): lane j of a row accumulates (d_b * q_bj) * x_bj over the blocks b in order; the
    lanes fold as s_i = (l_i + l_8+i) + (l_16+i + l_24+i), then ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7))."""
    rows, nb = raw.shape[0], n_in // 32
    with np.errstate(all="ignore"):  # the project's dequantization: d * q, one float32 rounding
        w = dequantize_rows(raw, GGMLType.Q8_0).reshape(rows, nb, 32)
    out = np.empty((x.shape[0], rows), dtype=np.float32)
    with np.errstate(all="ignore"):
        for t in range(x.shape[0]):
            xb = x[t].reshape(nb, 32)
            lanes = np.zeros((rows, 32), dtype=np.float32)
            for b in range(nb):
                lanes = lanes + w[:, b, :] * xb[b]
            s = (lanes[:, 0:8] + lanes[:, 8:16]) + (lanes[:, 16:24] + lanes[:, 24:32])
            out[t] = ((s[:, 0] + s[:, 4]) + (s[:, 2] + s[:, 6])) + ((s[:, 1] + s[:, 5]) + (s[:, 3] + s[:, 7]))
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (payloads are not specified)."""
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(nan_a, nan_b) and np.array_equal(a.view(np.uint32)[~nan_a], b.view(np.uint32)[~nan_b]))


SHAPES = [(1, 32, 1), (7, 64, 2), (300, 512, 1), (1001, 256, 3), (40, 4096, 1)]


@pytest.mark.parametrize("rows,n_in,T", SHAPES)
@pytest.mark.parametrize("hostile", [False, True])
def test_bit_identical_to_the_twin(lib, rows, n_in, T, hostile):
    rng = np.random.default_rng(rows * 7 + n_in + T)
    raw = q8_0_blocks(rng, rows, n_in, hostile)
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    if hostile:
        x[0, :3] = (0.0, 1e30, -1e-30)
    got = native.q8_0_rows(lib, raw, n_in, x)
    assert got.shape == (T, rows) and got.dtype == np.float32
    assert same_bits(got, twin(raw, n_in, x))


def test_close_to_the_float32_matmul(lib):
    """What DEFAULT numerics computed before: MLX's float32 matmul on the dequantized weight. Only the
    order of the sums differs: within the float32 bound of a 4096-long dot product."""
    rng = np.random.default_rng(5)
    raw = q8_0_blocks(rng, 200, 4096)
    x = rng.standard_normal((2, 4096)).astype(np.float32)
    w = DenseWeight("w", GGMLType.Q8_0, raw, 4096, backend="cpu")
    ref = np.array(w(mx.array(x)))
    got = w.host_product(x)
    bound = 4096 * np.finfo(np.float32).eps * (np.abs(np.array(w.dense())) @ np.abs(x.T)).T
    assert np.all(np.abs(got - ref) <= bound)


def test_threads_and_row_slices_do_not_change_bits(lib, monkeypatch):
    rng = np.random.default_rng(8)
    raw = q8_0_blocks(rng, 5000, 512)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    whole = native.q8_0_rows(lib, raw, 512, x)
    for n in ("1", "2", "3", "7"):
        monkeypatch.setenv(native.THREADS_VAR, n)
        assert same_bits(native.q8_0_rows(lib, raw, 512, x), whole), n
    # a pipeline rank's rows: a view of those rows' bytes, as ``DenseWeight.from_gguf(rows=)`` takes them
    assert same_bits(native.q8_0_rows(lib, raw[1234:4321], 512, x), whole[:, 1234:4321])


def test_the_portable_loop_gives_the_same_bits(lib, tmp_path):
    """Machines without AVX2 (or F16C) run the portable C loop: built here with ``-DDS4N_PORTABLE`` and
    without ``-march=native``, it must give the AVX2 loop's bits."""
    path = tmp_path / native.LIBRARY
    error = native.compile_library(path, native.BASE_FLAGS + ("-DDS4N_PORTABLE",))
    assert error is None, error
    portable = native.load_library(path)
    rng = np.random.default_rng(11)
    for rows, n_in, T, hostile in [(301, 512, 2, False), (64, 4096, 1, True), (3, 32, 1, True)]:
        raw = q8_0_blocks(rng, rows, n_in, hostile)
        x = rng.standard_normal((T, n_in)).astype(np.float32)
        assert same_bits(native.q8_0_rows(portable, raw, n_in, x), native.q8_0_rows(lib, raw, n_in, x))


def test_arguments_the_c_code_would_trust_are_refused(lib):
    rng = np.random.default_rng(2)
    raw = q8_0_blocks(rng, 4, 64)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        native.q8_0_rows(lib, raw, 96, x)  # more inputs than a row holds
    with pytest.raises(ValueError, match="do not fit"):
        native.q8_0_rows(lib, raw, 48, x)  # not whole blocks
    with pytest.raises(ValueError, match="do not fit"):
        native.q8_0_rows(lib, raw.view(np.int8), 64, x)
    with pytest.raises(ValueError, match="do not fit"):
        native.q8_0_rows(lib, raw[:, ::2], 32, x[:, :32])  # rows not contiguous
    with pytest.raises(ValueError, match="activations of shape"):
        native.q8_0_rows(lib, raw, 64, x[:, :32])
    with pytest.raises(ValueError, match="activations of shape"):
        native.q8_0_rows(lib, raw, 64, x[0])
    assert lib.ds4n_q8_0_rows(raw.ctypes.data, 1, 4, 64, 1, x.ctypes.data,
                              ctypes.c_void_p(0), 1) == -3  # the C checks stand on their own
    w = DenseWeight("w", GGMLType.F16, np.zeros((4, 64), np.float16), 64, backend="cpu")
    with pytest.raises(InferenceError, match="not Q8_0"):
        w.host_product(x)
    with pytest.raises(LayoutError, match="expected"):
        DenseWeight("w", GGMLType.Q8_0, raw, 64, backend="cpu").host_product(x[:, :32])


# -- the model's head -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(tiny_model_path, lib):
    return {k: ds4_mlx.load(tiny_model_path, **kw) for k, kw in
            [("host", {}), ("device", {"experts": "device"}), ("ds4", {"numerics": "ds4-cpu"})]}


def test_only_default_host_cpu_multiplies_the_head_on_the_host(engines):
    assert engines["host"].network.host_head is True
    assert engines["device"].network.host_head is False
    assert engines["ds4"].network.host_head is False


def test_the_host_head_matches_mlxs_float32_head_and_builds_nothing(engines):
    net = engines["host"].network
    tokens = list(range(200, 260))
    s = Session(net, 128)
    s.append(tokens)
    prefill = s.logits()
    decoded = []
    for t in (7, 8, 9):
        s.eval(t)
        decoded.append(s.logits())
    out = net.output
    assert out._dense is None and out._dense_t is None  # no float32 form was built
    # the same logits from MLX's float32 head, on the same hidden states
    hidden = net.head_hidden(mx.zeros((1, net.config.n_hc, net.config.n_embd)) + 0.5)
    ref = np.array(net.ops.linear(out, hidden))
    got = np.array(net.head_logits(hidden))
    assert np.allclose(got, ref, rtol=0, atol=5e-5 * np.abs(ref).max())
    # and the session's logits (prefilled and compiled decode) against the same session on MLX's head
    net.host_head = False
    try:
        s2 = Session(net, 128)
        s2.append(tokens)
        mlx_prefill = s2.logits()
        for t in (7, 8, 9):
            s2.eval(t)
        mlx_last = s2.logits()
    finally:
        net.host_head = True
        out._dense = out._dense_t = None
    scale = np.abs(mlx_prefill).max()
    assert np.abs(prefill - mlx_prefill).max() <= 5e-5 * scale
    assert np.abs(decoded[-1] - mlx_last).max() <= 5e-5 * scale
    assert int(np.argmax(decoded[-1])) == int(np.argmax(mlx_last))


def test_off_by_environment_keeps_mlxs_head(tiny_model_path, monkeypatch):
    monkeypatch.setenv(native.ENV_VAR, "off")
    native._reset_for_tests()
    try:
        net = ds4_mlx.load(tiny_model_path).network
        assert net.host_head is False
    finally:
        monkeypatch.setenv(native.ENV_VAR, "on")
        native._reset_for_tests()
