"""The native expert products (``ds4_mlx/native``) against the MLX-ops twin of ``ExpertWeights``.

ds4-cpu numerics: bit for bit, every routed-expert type, odd output widths, 1..16 super-blocks, 1..40
pairs with repeated experts and rows, hostile activations and scales. Default numerics: within the
float32 summation bound of the twin, and the same bits whatever else the call holds or how many
threads run. Fallbacks (``DS4_MLX_NATIVE=off``, no compiler, a compiler that fails): a clear status,
one warning, the twin's bits."""

from __future__ import annotations

import os
import shutil
import shlex
import warnings

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx import native
from ds4_mlx.errors import InferenceError
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType
from ds4_mlx.formats.quants_mlx import dequantize_rows_mlx
from ds4_mlx.model.experts import ExpertCache, ExpertWeights

QTYPES = [GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.MXFP4]
SCALE_OFFSETS = {GGMLType.IQ2_XXS: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q4_K: (0, 2)}


def _have_compiler() -> bool:
    cc = shlex.split(os.environ.get("CC", "").strip() or "cc")
    return shutil.which(cc[0]) is not None


@pytest.fixture(autouse=True)
def _fresh_native(monkeypatch):
    """Each test sees native switched on (DS4_MLX_NATIVE=on, as by default) unless it changes it; the library state
    is restored afterwards so no test leaves the process on a path the next one did not choose."""
    monkeypatch.setenv(native.ENV_VAR, "on")
    yield
    native._reset_for_tests()


@pytest.fixture
def lib():
    if not _have_compiler():
        pytest.skip("no C compiler: the native path cannot be built here (its fallback is tested below)")
    got = native.library()
    assert got is not None, native.status()  # a compiler is there: the build must work
    return got


def blocks(rng, qtype: GGMLType, n_expert: int, out_dim: int, n_in: int, hostile: bool = False) -> np.ndarray:
    """Random blocks with realistic f16 scales; ``hostile``: also zero, NaN and inf scales (MXFP4: E8M0
    scales 2^-17..2^2; hostile: 0, 254 and 255, the subnormal, overflowing and infinite ones)."""
    elems, block_bytes = BLOCK_GEOMETRY[qtype]
    nb = n_in // elems
    raw = rng.integers(0, 256, size=(n_expert, out_dim, nb, block_bytes), dtype=np.uint8)
    if qtype == GGMLType.MXFP4:
        e = rng.integers(110, 130, size=(n_expert, out_dim, nb)).astype(np.uint8)
        if hostile:
            e.reshape(-1)[[0, len(e.reshape(-1)) // 2, -1]] = [0, 255, 254]
        raw[..., 0] = e
        return raw.reshape(n_expert, out_dim, nb * block_bytes)
    for off in SCALE_OFFSETS[qtype]:
        d = (rng.uniform(0.2, 2.0, size=(n_expert, out_dim, nb))
             * rng.choice([1e-3, 3e-2], size=(n_expert, out_dim, nb))).astype(np.float16)
        if hostile:
            flat = d.reshape(-1)
            flat[0], flat[-1] = np.float16(0), np.float16(np.inf)
            flat[len(flat) // 2] = np.float16(np.nan)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(n_expert, out_dim, nb, 2)
    return raw.reshape(n_expert, out_dim, nb * block_bytes)


def pair_case(rng, P: int, n_expert: int):
    """ids [T, k] and the input's k axis (kx) for P pairs, with repeated experts and repeated rows."""
    if P == 1:
        T, k, kx = 1, 1, 1
    elif P == 6:
        T, k, kx = 1, 6, 1  # one token: every pair reads the same row
    elif P == 17:
        T, k, kx = 17, 1, 1
    else:
        T, k, kx = P // 4, 4, 4
    ids = rng.integers(0, n_expert, size=(T, k))
    ids.reshape(-1)[-1] = ids.reshape(-1)[0]  # at least one repeated expert
    return ids, kx


def pair_experts(qtype, raw, n_in):
    a = ExpertWeights("e", qtype, raw, n_in, backend="cpu", use_kernels=False, native=True)
    b = ExpertWeights("e", qtype, raw, n_in, backend="cpu", use_kernels=False, native=False)
    b.cache = ExpertCache(0)
    return a, b


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (payloads are not specified)."""
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(nan_a, nan_b) and np.array_equal(a.view(np.uint32)[~nan_a], b.view(np.uint32)[~nan_b]))


SHAPES = [(1, 256, 1), (5, 512, 6), (61, 256, 17), (5, 4096, 40), (61, 512, 40), (1, 4096, 6), (61, 4096, 1)]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("out_dim,n_in,P", SHAPES)
def test_ds4_cpu_bit_identical_to_twin(lib, qtype, out_dim, n_in, P):
    rng = np.random.default_rng(out_dim * 1000 + n_in + P + int(qtype))
    raw = blocks(rng, qtype, 5, out_dim, n_in)
    raw.setflags(write=False)  # as the GGUF mmap
    ids, kx = pair_case(rng, P, 5)
    x = rng.standard_normal((ids.shape[0], kx, n_in)).astype(np.float32) * 10.0 ** rng.uniform(-3, 2)
    a, b = pair_experts(qtype, raw, n_in)
    got, want = np.array(a.ds4_cpu(mx.array(x), ids)), np.array(b.ds4_cpu(mx.array(x), ids))
    assert got.shape == want.shape == (*ids.shape, out_dim)
    assert same_bits(got, want)
    assert a.bytes_read == b.bytes_read == a.bytes_selected == len(np.unique(ids)) * a.expert_nbytes


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_ds4_cpu_hostile_values(lib, qtype):
    """Zero rows, huge rows, NaN and inf in x, zero / NaN / inf scales in the blocks: no crash and the
    twin's results (non-finite where it is non-finite)."""
    rng = np.random.default_rng(77 + int(qtype))
    n_in, out_dim = 512, 13
    raw = blocks(rng, qtype, 4, out_dim, n_in, hostile=True)
    x = rng.standard_normal((6, 1, n_in)).astype(np.float32)
    x[0] = 0.0
    x[1] *= np.float32(1e30)
    x[2, 0, 7] = np.nan
    x[3, 0, 300] = np.inf
    x[4, 0, 3] = -np.inf
    x[5, 0, :256] = np.float32(3e38)
    ids = rng.integers(0, 4, size=(6, 1))
    a, b = pair_experts(qtype, raw, n_in)
    got, want = np.array(a.ds4_cpu(mx.array(x), ids)), np.array(b.ds4_cpu(mx.array(x), ids))
    assert same_bits(got, want)
    assert not np.isfinite(got).all()  # the hostile scales did reach the output


def dense_bound(raw, qtype, x, ids, kx):
    """Per output, the float32 bound on any summation order of the same products: 2 * n * u * |W| @ |x|
    (one order's error <= n * u * sum |w x|; two orders differ by at most twice that)."""
    T, k = ids.shape
    n_in = x.shape[-1]
    out = np.zeros((T, k, raw.shape[1]))
    for t in range(T):
        for j in range(k):
            w = np.array(dequantize_rows_mlx(mx.array(raw[ids[t, j]]), qtype)).astype(np.float64)
            out[t, j] = np.abs(w) @ np.abs(x[t, j if kx == k else 0].astype(np.float64))
    return 2 * n_in * 2.0 ** -24 * out


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("out_dim,n_in,P", [(5, 512, 6), (61, 256, 17), (5, 4096, 40)])
def test_default_within_the_summation_bound_of_twin(lib, qtype, out_dim, n_in, P):
    rng = np.random.default_rng(out_dim + n_in + P + int(qtype))
    raw = blocks(rng, qtype, 5, out_dim, n_in)
    ids, kx = pair_case(rng, P, 5)
    x = rng.standard_normal((ids.shape[0], kx, n_in)).astype(np.float32)
    a, b = pair_experts(qtype, raw, n_in)
    got, want = np.array(a(mx.array(x), ids)), np.array(b(mx.array(x), ids))
    bound = dense_bound(raw, qtype, x, ids, kx)
    assert (np.abs(got.astype(np.float64) - want) <= bound).all()
    assert not np.array_equal(got, np.zeros_like(got))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_default_is_batch_and_thread_invariant(lib, qtype, monkeypatch):
    """A pair's output has the same bits alone or among 40 pairs, and on 1 or 3 threads: what the
    model's chunked-prefill == whole-prefill == decode invariants rest on."""
    rng = np.random.default_rng(5 + int(qtype))
    n_in, out_dim = 1024, 165  # 40 pairs: enough work for 3 threads (WORK_PER_THREAD in experts.c)
    raw = blocks(rng, qtype, 6, out_dim, n_in)
    ids = rng.integers(0, 6, size=(10, 4))
    x = rng.standard_normal((10, 4, n_in)).astype(np.float32)
    a, _ = pair_experts(qtype, raw, n_in)
    monkeypatch.setenv(native.THREADS_VAR, "1")
    whole = np.array(a(mx.array(x), ids))
    monkeypatch.setenv(native.THREADS_VAR, "3")
    assert np.array_equal(np.array(a(mx.array(x), ids)).view(np.uint32), whole.view(np.uint32))
    for t in range(10):
        for j in range(4):
            alone = np.array(a(mx.array(x[t:t + 1, j:j + 1]), ids[t:t + 1, j:j + 1]))
            assert np.array_equal(alone.reshape(-1).view(np.uint32), whole[t, j].view(np.uint32)), (t, j)
    ds4_1 = np.array(a.ds4_cpu(mx.array(x), ids))
    monkeypatch.setenv(native.THREADS_VAR, "1")
    assert same_bits(np.array(a.ds4_cpu(mx.array(x), ids)), ds4_1)


def test_native_is_what_runs_when_on(lib):
    """With a compiler and DS4_MLX_NATIVE=on, a host tensor takes the native path (the MLX path would count
    the same bytes; the library is what tells them apart) and the status says so."""
    rng = np.random.default_rng(3)
    raw = blocks(rng, GGMLType.Q2_K, 3, 4, 256)
    e = ExpertWeights("e", GGMLType.Q2_K, raw, 256, backend="cpu", use_kernels=False)
    assert e._native_lib() is lib
    st = native.status()
    assert st["enabled"] is True and "-ffp-contract=off" in st["reason"] and os.path.exists(st["path"])
    assert "-ffast-math" not in st["reason"]


def _twin_ds4(qtype, raw, n_in, x, ids):
    b = ExpertWeights("e", qtype, raw, n_in, backend="cpu", use_kernels=False, native=False)
    return np.array(b.ds4_cpu(mx.array(x), ids))


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv(native.ENV_VAR, "off")
    native._reset_for_tests()
    rng = np.random.default_rng(4)
    raw = blocks(rng, GGMLType.IQ2_XXS, 3, 7, 256)
    x = rng.standard_normal((2, 1, 256)).astype(np.float32)
    ids = np.array([[0], [2]])
    e = ExpertWeights("e", GGMLType.IQ2_XXS, raw, 256, backend="cpu", use_kernels=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # off is a choice, not a failure: no warning
        got = np.array(e.ds4_cpu(mx.array(x), ids))
    assert e._native_lib() is None
    assert same_bits(got, _twin_ds4(GGMLType.IQ2_XXS, raw, 256, x, ids))
    st = native.status(probe=True)
    assert st["enabled"] is False and "DS4_MLX_NATIVE=off" in st["reason"]
    forced = ExpertWeights("e", GGMLType.IQ2_XXS, raw, 256, backend="cpu", use_kernels=False, native=True)
    with pytest.raises(InferenceError, match="native experts requested but unavailable"):
        forced.ds4_cpu(mx.array(x), ids)


@pytest.mark.parametrize("cc,reason", [
    ("/nonexistent/ds4-cc", "no C compiler"),
    ("false", "does not run"),
    ("cc -include /nonexistent/ds4.h", "failed"),
])
def test_broken_compiler_falls_back_once(monkeypatch, tmp_path, cc, reason):
    if cc.startswith("cc") and not _have_compiler():
        pytest.skip("needs cc to fail a compile")
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native._reset_for_tests()
    rng = np.random.default_rng(6)
    raw = blocks(rng, GGMLType.Q4_K, 3, 5, 512)
    x = rng.standard_normal((3, 1, 512)).astype(np.float32)
    ids = np.array([[1], [1], [0]])
    e = ExpertWeights("e", GGMLType.Q4_K, raw, 512, backend="cpu", use_kernels=False)
    with pytest.warns(native.NativeWarning, match="using the MLX path") as record:
        got = np.array(e.ds4_cpu(mx.array(x), ids))
    assert len(record) == 1 and "\n" not in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process, not per call
        again = np.array(e.ds4_cpu(mx.array(x), ids))
    assert same_bits(got, _twin_ds4(GGMLType.Q4_K, raw, 512, x, ids)) and same_bits(again, got)
    st = native.status()
    assert st["enabled"] is False and reason in st["reason"] and st["path"] is None
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers == []  # no half-written library left behind


def test_build_is_cached_and_atomic(monkeypatch, tmp_path):
    if not _have_compiler():
        pytest.skip("no C compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native._reset_for_tests()
    assert native.library() is not None
    path = native.status()["path"]
    assert path.startswith(str(tmp_path / "ds4-mlx" / "native"))
    stamp = os.stat(path).st_mtime_ns
    native._reset_for_tests()
    assert native.library() is not None and native.status()["path"] == path
    assert os.stat(path).st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [native.LIBRARY]


def test_unknown_setting_is_said_and_runs_the_mlx_path(monkeypatch):
    monkeypatch.setenv(native.ENV_VAR, "of")
    monkeypatch.setattr(native, "_warned", set())
    native._reset_for_tests()
    with pytest.warns(native.NativeWarning, match="DS4_MLX_NATIVE='of' is neither on nor off"):
        assert native.library() is None
    assert native.status()["reason"] == "disabled by DS4_MLX_NATIVE=of"
    monkeypatch.setenv(native.THREADS_VAR, "two")
    with pytest.warns(native.NativeWarning, match="DS4_MLX_NATIVE_THREADS='two' is not a whole number"):
        assert native.threads() >= 1


@pytest.mark.parametrize("bad", ["expert", "row", "order", "bounds", "n_in"])
def test_indices_the_c_code_would_trust_are_refused(lib, bad):
    """Whatever a caller passes, the C code never reads outside the blocks or the activations."""
    rng = np.random.default_rng(9)
    qtype, n_in = GGMLType.Q2_K, 256
    raw = blocks(rng, qtype, 3, 5, n_in)
    x = rng.standard_normal((2, n_in)).astype(np.float32)
    args = dict(uniq=np.array([0, 2]), bounds=np.array([0, 1, 2]), order=np.array([0, 1]), rows=np.array([0, 1]))
    grid = np.zeros(256, np.uint64)
    native.pairs_f32(lib, int(qtype), raw, n_in, x=x, signed_grid=grid, **args)  # the good call runs
    n = n_in
    if bad == "expert":
        args["uniq"] = np.array([0, 3])
    elif bad == "row":
        args["rows"] = np.array([0, 2])
    elif bad == "order":
        args["order"] = np.array([0, -1])
    elif bad == "bounds":
        args["bounds"] = np.array([0, 1, 3])
    else:
        n = 512
    with pytest.raises(ValueError, match="native experts"):
        native.pairs_f32(lib, int(qtype), raw, n, x=x, signed_grid=grid, **args)


def test_on_by_default(monkeypatch):
    """Unset means on: with a compiler the library builds, silently (no warning for the default)."""
    if not _have_compiler():
        pytest.skip("no C compiler")
    monkeypatch.delenv(native.ENV_VAR)
    native._reset_for_tests()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.library() is not None
    assert native.status()["enabled"] is True


def test_switched_on_after_a_call_while_off_it_builds(monkeypatch):
    """A call made while off (say an earlier status probe, as in the full suite) is not a failed build:
    switched on later in the same process, the library builds. (The full CI run failed the first
    native test this way: ``ds4-mlx inspect``'s test had asked while the default was off.)"""
    if not _have_compiler():
        pytest.skip("no C compiler")
    monkeypatch.setenv(native.ENV_VAR, "off")
    native._reset_for_tests()
    assert native.library() is None and native.status(probe=True)["enabled"] is False
    monkeypatch.setenv(native.ENV_VAR, "on")
    assert native.library() is not None and native.status()["enabled"] is True


@pytest.mark.parametrize("numerics", ["default", "ds4-cpu"])
def test_gate_and_up_read_their_shared_input_once(lib, numerics):
    """A MoE's gate and up calls take the same input array: the second reuses the first's host copy
    (one wait on the device less per routed layer). Another array with the same values is read again
    (the key is the array itself), and the products are the bits of separate reads."""
    from host_traffic import HostTraffic  # benchmarks/, on the path by conftest

    rng = np.random.default_rng(11)
    gate = ExpertWeights("gate", GGMLType.IQ2_XXS, blocks(rng, GGMLType.IQ2_XXS, 4, 16, 256), 256,
                         backend="cpu", use_kernels=False)
    up = ExpertWeights("up", GGMLType.IQ2_XXS, blocks(rng, GGMLType.IQ2_XXS, 4, 16, 256), 256,
                       backend="cpu", use_kernels=False)
    ids = np.array([[0, 3]])
    x_host = rng.standard_normal((1, 1, 256)).astype(np.float32)
    call = (lambda e, x: e(x, ids)) if numerics == "default" else (lambda e, x: e.ds4_cpu(x, ids))

    def pair(x):
        with HostTraffic() as t:
            g, u = call(gate, x), call(up, x)
        return t.syncs, np.array(g), np.array(u)

    x = mx.array(x_host) * 1.0  # unevaluated: reading it waits on the device
    shared_syncs, g1, u1 = pair(x)
    with HostTraffic() as t:
        g2, u2 = call(gate, mx.array(x_host) * 1.0), call(up, mx.array(x_host) * 1.0)
    assert shared_syncs == 1 and t.syncs == 2
    assert same_bits(g1, np.array(g2)) and same_bits(u1, np.array(u2))


def test_the_shared_input_is_per_thread(lib):
    """Two threads (two models, say) never see each other's cached input."""
    import threading

    from ds4_mlx.model.experts import _HOST_INPUT

    x = mx.zeros((1, 4))
    _HOST_INPUT.get(x, "f32", lambda: np.ones(4, np.float32))
    seen = []
    t = threading.Thread(target=lambda: seen.append(_HOST_INPUT.get(x, "f32", lambda: np.zeros(4, np.float32))))
    t.start()
    t.join()
    assert seen[0].tolist() == [0, 0, 0, 0]
    assert _HOST_INPUT.get(x, "f32", lambda: None).tolist() == [1, 1, 1, 1]
