"""The load-time plan (``model.load_plan``): resolved once from the machine and the options, and obeyed
below the loader. A CUDA device is mocked by patching the one detector (``load_plan.detect_backend``);
the CUDA dialect of the expert kernels then runs on the strict host shim (tests/kernel_shim)."""

from __future__ import annotations

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.errors import LayoutError
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.formats.quants import dequantize_rows
from ds4_mlx.model import load_plan
from ds4_mlx.model.device_experts import DeviceExpertWeights, expert_matvec_twin_ids
from ds4_mlx.model.expert_cache import CachedDeviceExpertWeights
from ds4_mlx.model.experts import ExpertWeights
from ds4_mlx.model.linear import Backend, DenseWeight, q8_0_to_affine
from ds4_mlx.model import metal_kernels as mk
from kernel_shim import shim


def _counting(value):
    calls = []

    def detect():
        calls.append(1)
        return value
    return detect, calls


@pytest.mark.parametrize("machine, experts, kernels", [("cpu", "host", None), ("metal", "device", "metal"),
                                                       ("cuda", "device", "cuda")])
def test_plan_from_the_machine(machine, experts, kernels):
    detect, calls = _counting(machine)
    plan = load_plan.resolve(detect=detect)
    assert (plan.backend, plan.experts, plan.kernels) == (machine, experts, kernels)
    assert len(calls) == 1  # the machine is read once
    if machine != "cpu":
        assert plan.native is False  # the native host products serve MLX's CPU only
    line = plan.describe()
    assert line.startswith("load plan: ") and "\n" not in line
    assert f"backend {machine}" in line and f"experts {experts}" in line
    if machine != "cpu":
        assert "dense Q8_0 affine-8 group 32, F16 float16" in line and f"kernels {machine}" in line
        assert "native off" in line


def test_explicit_options_do_not_read_the_machine():
    detect, calls = _counting("cuda")
    plan = load_plan.resolve("ds4-cpu", "cpu", "device", "pipeline", detect=detect)
    assert calls == [] and (plan.backend, plan.experts, plan.kernels) == ("cpu", "device", None)
    assert plan.numerics == "ds4-cpu" and plan.distributed == "pipeline"


@pytest.mark.parametrize("kw, what", [({"backend": "rocm"}, "backend"), ({"experts": "gpu"}, "expert strategy")])
def test_bad_options_name_the_value(kw, what):
    with pytest.raises(LayoutError, match=what):
        load_plan.resolve(detect=lambda: "cpu", **kw)


def test_compile_switch(monkeypatch):
    monkeypatch.setenv(load_plan.COMPILE_VAR, "off")
    assert load_plan.resolve(detect=lambda: "cpu").compile is False
    monkeypatch.delenv(load_plan.COMPILE_VAR)
    assert load_plan.resolve(detect=lambda: "cpu").compile is True


ENV_VARS = (load_plan.EXPERT_CACHE_VAR, load_plan.EXPERT_GROUP_VAR, load_plan.KV_LOCK_VAR,
            load_plan.DIST_TIMEOUT_VAR)


def test_the_environment_is_read_into_the_plan(monkeypatch):
    """Each tunable the environment sets is a plan field, read once in ``resolve`` (#23), with the
    defaults the modules below used to read for themselves."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    plan = load_plan.resolve(detect=lambda: "cpu")
    assert (plan.expert_cache_bytes, plan.expert_cache_explicit) == (1024 << 20, False)
    assert (plan.expert_group_bytes, plan.kv_lock_timeout, plan.join_timeout) == (512 << 20, 5.0, None)
    assert "expert LRU 1024 MiB default" in plan.describe()
    monkeypatch.setenv(load_plan.EXPERT_CACHE_VAR, "0.5")
    monkeypatch.setenv(load_plan.EXPERT_GROUP_VAR, "3")
    monkeypatch.setenv(load_plan.KV_LOCK_VAR, "0.25")
    monkeypatch.setenv(load_plan.DIST_TIMEOUT_VAR, "7")
    plan = load_plan.resolve(distributed="pipeline", detect=lambda: "cpu")
    assert (plan.expert_cache_bytes, plan.expert_cache_explicit) == (1 << 19, True)
    assert (plan.expert_group_bytes, plan.kv_lock_timeout, plan.join_timeout) == (3 << 20, 0.25, 7.0)
    line = plan.describe()
    assert "expert LRU 0.5 MiB," in line and "distributed pipeline (join within 7 s)" in line
    assert load_plan.resolve(distributed="pipeline", join_timeout=2, detect=lambda: "cpu").join_timeout == 2.0
    monkeypatch.setenv(load_plan.EXPERT_CACHE_VAR, "0")  # 0 disables the LRU: explicit, allowed
    assert load_plan.resolve(detect=lambda: "cpu").expert_cache_bytes == 0
    assert load_plan.kv_lock_timeout() == 0.25  # the ``kv`` commands' reader: the same rule


@pytest.mark.parametrize("var, value, why", [
    (load_plan.EXPERT_CACHE_VAR, "lots", "is not a number of MiB"),
    (load_plan.EXPERT_CACHE_VAR, "-1", "must be a finite number of MiB >= 0"),
    (load_plan.EXPERT_GROUP_VAR, "0", "must be a finite number of MiB > 0"),
    (load_plan.KV_LOCK_VAR, "soon", "is not a number of seconds"),
    (load_plan.KV_LOCK_VAR, "inf", "must be a finite number of seconds >= 0"),
    (load_plan.DIST_TIMEOUT_VAR, "abc", "is not a number of seconds"),
    (load_plan.DIST_TIMEOUT_VAR, "0", "must be a finite number of seconds > 0"),
    (load_plan.DIST_TIMEOUT_VAR, "nan", "must be a finite number of seconds > 0"),
])
def test_a_bad_variable_is_a_layout_error_naming_it(monkeypatch, var, value, why):
    monkeypatch.setenv(var, value)
    with pytest.raises(LayoutError) as info:
        load_plan.resolve(distributed="pipeline", detect=lambda: "cpu")
    msg = str(info.value)
    assert msg.startswith(f"{var}={value!r}") and why in msg and "\n" not in msg


def test_the_distributed_timeout_is_read_for_a_distributed_load_only(monkeypatch):
    monkeypatch.setenv(load_plan.DIST_TIMEOUT_VAR, "abc")
    assert load_plan.resolve(detect=lambda: "cpu").join_timeout is None  # not used: not read
    with pytest.raises(LayoutError, match="join_timeout=0: must be a finite number of seconds > 0"):
        load_plan.resolve(distributed="experts", join_timeout=0, detect=lambda: "cpu")


@pytest.mark.parametrize("backend, qtype, kernels, form", [
    ("cpu", GGMLType.Q8_0, False, "float32"), ("cpu", GGMLType.Q8_0, True, "float32"),
    ("cpu", GGMLType.F16, False, "float32"), ("metal", GGMLType.Q8_0, False, "affine"),
    ("cuda", GGMLType.Q8_0, False, "affine"), ("cuda", GGMLType.Q8_0, True, "blocks"),
    ("metal", GGMLType.F16, False, "half"), ("cuda", GGMLType.F32, False, "float32"),
])
def test_dense_form_is_decided_in_one_place(backend, qtype, kernels, form):
    """``load_plan.dense_form`` decides every dense weight's form; ``DenseWeight`` and its resident
    bytes follow it."""
    from ds4_mlx.model.linear import dense_resident_nbytes

    assert load_plan.dense_form(backend, qtype, kernels) == form
    n_in = 64
    raw = {GGMLType.Q8_0: np.zeros((2, n_in // 32 * 34), np.uint8), GGMLType.F16: np.zeros((2, n_in), np.float16),
           GGMLType.F32: np.zeros((2, n_in), np.float32)}[qtype]
    w = DenseWeight("w", qtype, raw, n_in, backend=backend, use_kernels=kernels)
    assert w.form == form
    assert w.resident_nbytes() == dense_resident_nbytes(qtype, (2, n_in), backend, kernels)
    plan = load_plan.resolve(backend=backend, experts="host", detect=lambda: "cpu")
    if not kernels:
        assert plan.dense_form(qtype) == form


def test_expert_weights_built_without_the_loader_run_the_twins(monkeypatch):
    """A directly built ``ExpertWeights`` asks no machine: no kernels unless a dialect is passed
    (the loader passes its plan's ``kernels``)."""
    monkeypatch.setattr(mk, "available_dialects", lambda: ["metal", "cuda"])  # a GPU box, as far as MLX says
    raw = np.zeros((2, 4, 66), np.uint8)
    assert ExpertWeights("e", GGMLType.IQ2_XXS, raw, 256, backend="cuda").kernel_dialect is None
    assert ExpertWeights("e", GGMLType.IQ2_XXS, raw, 256, backend="cuda", use_kernels="cuda").kernel_dialect == "cuda"
    assert ExpertWeights("e", GGMLType.IQ2_XXS, raw, 256, backend="cuda", use_kernels=True).kernel_dialect == "cuda"
    assert ExpertWeights("e", GGMLType.IQ2_XXS, raw, 256, use_kernels=True).kernel_dialect == "metal"


def test_the_load_passes_the_plan_down(tiny_model_path, monkeypatch):
    """The expert LRU is sized from the plan at load (keeping an explicit budget apart from the
    default that ranks scale), every expert tensor gets the plan's group size, and a disk KV cache
    the plan's lock timeout."""
    from ds4_mlx.engine.disk_cache import DiskCache
    from ds4_mlx.model import experts as ex

    saved = (ex.EXPERT_CACHE.limit_bytes, ex.EXPERT_CACHE.default_bytes, ex.EXPERT_CACHE.explicit)
    try:
        monkeypatch.setenv(load_plan.EXPERT_CACHE_VAR, "3")
        monkeypatch.setenv(load_plan.EXPERT_GROUP_VAR, "2")
        monkeypatch.setenv(load_plan.KV_LOCK_VAR, "0.75")
        engine = ds4_mlx.load(str(tiny_model_path), experts="host")
        assert engine.load_plan.expert_cache_bytes == 3 << 20
        assert (ex.EXPERT_CACHE.limit_bytes, ex.EXPERT_CACHE.explicit) == (3 << 20, True)
        assert engine.memory_plan.weights.expert_lru <= 3 << 20
        found = _weights(engine.network)
        assert found["experts"] and all(e.group_bytes == 2 << 20 for e in found["experts"])
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            assert DiskCache(engine, d, 64, ctx=512).store.lock_timeout == 0.75
        monkeypatch.delenv(load_plan.EXPERT_CACHE_VAR)
        ds4_mlx.load(str(tiny_model_path), experts="host")  # the default does not replace the user's
        assert (ex.EXPERT_CACHE.limit_bytes, ex.EXPERT_CACHE.explicit) == (3 << 20, True)
        ex.EXPERT_CACHE.explicit = False
        ds4_mlx.load(str(tiny_model_path), experts="host")
        assert (ex.EXPERT_CACHE.limit_bytes, ex.EXPERT_CACHE.explicit) == (1024 << 20, False)
    finally:
        ex.EXPERT_CACHE.limit_bytes, ex.EXPERT_CACHE.default_bytes, ex.EXPERT_CACHE.explicit = saved


# --------------------------------------------------------------------------------------------------
# Q8_0 -> affine: exact with float32 scales; the float16 measurement


def _q8_tensors(path):
    f = GGUFFile(path)
    return f, [n for n, t in f.tensors.items() if t.ggml_type == GGMLType.Q8_0 and len(t.shape) == 2]


def test_affine_q8_0_is_exact_and_float16_scales_are_not(tiny_model_path):
    """Every Q8_0 matrix of the tiny model: MLX's affine dequantization of ``q8_0_to_affine`` equals the
    Q8_0 dequantization bit for bit. With the scales and biases in float16, MLX dequantizes in float16 and
    ``d * u`` (11 + 8 significant bits) rounds: measured here, not assumed, so the float32 choice stays
    justified by the data."""
    f, names = _q8_tensors(tiny_model_path)
    assert names
    inexact_blocks = blocks = 0
    for name in names:
        raw = np.asarray(f.tensor_array(name))
        ref = dequantize_rows(raw, GGMLType.Q8_0)
        wq, scales, biases = q8_0_to_affine(raw)
        got = np.array(mx.dequantize(wq, scales, biases, group_size=32, bits=8))
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), name
        half = np.array(mx.dequantize(wq, scales.astype(mx.float16), biases.astype(mx.float16), group_size=32,
                                      bits=8).astype(mx.float32))
        bad = ~np.all((half == ref).reshape(ref.shape[0], -1, 32), axis=-1)
        inexact_blocks += int(bad.sum())
        blocks += bad.size
    f.close()
    print(f"float16 scales: {inexact_blocks} of {blocks} Q8_0 blocks inexact")
    assert inexact_blocks > 0  # float16 is not exact for every block: float32 scales it is


# --------------------------------------------------------------------------------------------------
# the whole load on a mocked CUDA device


def _weights(obj, seen=None, out=None):
    """Every DenseWeight / ExpertWeights reachable from ``obj`` (attributes, lists, dicts)."""
    seen = set() if seen is None else seen
    out = {"dense": [], "experts": []} if out is None else out
    if id(obj) in seen or isinstance(obj, (mx.array, np.ndarray, str, bytes, int, float, type(None))):
        return out
    seen.add(id(obj))
    if isinstance(obj, DenseWeight):
        out["dense"].append(obj)
        return out
    if isinstance(obj, ExpertWeights):
        out["experts"].append(obj)
        return out
    if isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("ds4_mlx"):
        items = vars(obj).values()
    else:
        return out
    for v in items:
        _weights(v, seen, out)
    return out


@pytest.fixture
def mocked_cuda(monkeypatch):
    monkeypatch.setattr(load_plan, "detect_backend", lambda: "cuda")


def test_load_on_mocked_cuda_holds_gpu_forms(tiny_model_path, mocked_cuda):
    engine = ds4_mlx.load(str(tiny_model_path))
    plan = engine.load_plan
    model = engine.network
    assert (plan.backend, plan.experts, plan.kernels, plan.native) == ("cuda", "device", "cuda", False)
    weights = engine.memory_plan.weights  # planned with the forms the load then built
    assert weights.backend == "cuda" and weights.strategy == "device"
    found = _weights(model)
    assert found["dense"] and found["experts"]
    assert all(e.kernel_dialect == "cuda" and isinstance(e, DeviceExpertWeights) for e in found["experts"])
    rng = np.random.default_rng(0)
    kinds = set()
    for w in found["dense"]:
        assert w.backend is Backend.CUDA
        if w._parent is not None or w.qtype == GGMLType.F32:
            continue
        kinds.add(w.qtype)
        x = mx.array(rng.standard_normal((2, w.shape[1])).astype(np.float32))
        y = np.array(w(x))
        ref = np.asarray(x) @ dequantize_rows(np.asarray(w.raw), w.qtype).T
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max() + 1))
        if w.qtype == GGMLType.Q8_0:
            held = sum(int(a.nbytes) for a in w._affine)
            assert w._affine[1].dtype == mx.float32
        else:
            held = int(w._half.nbytes)
            assert w._half.dtype == mx.float16
        assert w._dense is None and w._dense_t is None  # no float32 form on a GPU
        assert held == w.resident_nbytes()
    assert kinds == {GGMLType.Q8_0, GGMLType.F16}


def _through_shim(fn):
    """``fn()`` with its kernel launches recorded, run on the strict shim and replayed: (launches, output)."""
    launches = shim.record(fn)
    result = shim.run(launches, shim.Options(seed=5, variant="plain"))
    assert result.failure is None, result.failure
    return launches, np.array(shim.replay(fn, result.outputs))


@pytest.mark.skipif(shim.gxx() is None, reason="g++ (C++20) not found: host run of kernel sources")
@pytest.mark.parametrize("cache", [None, "48"], ids=["resident", "bounded-cache"])
def test_device_experts_run_the_cuda_dialect(tiny_model_path, mocked_cuda, cache):
    """The device strategy's decode (matvec kernel) and prefill (grouped: gather_mm kernel) calls, for
    every expert quant of the model, go through ``mx.fast.cuda_kernel`` with the CUDA dialect, and equal
    the MLX-ops twins (the kernels' bound, tests/test_kernels.py)."""
    model = ds4_mlx.load(str(tiny_model_path), experts="device", experts_cache=cache).network
    experts = _weights(model)["experts"]
    cls = DeviceExpertWeights if cache is None else CachedDeviceExpertWeights
    assert experts and all(isinstance(e, cls) and e.kernel_dialect == "cuda" for e in experts)
    by_type = {}
    for e in experts:
        by_type.setdefault(e.qtype, e)
    rng = np.random.default_rng(1)
    names = {}
    for qtype, e in by_type.items():
        n_expert, out_dim, n_in = e.shape
        for T, k in ((1, 4), (8, 4)):  # 4 pairs: on the device; 32 pairs: grouped by expert
            ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)]).astype(np.int32)
            x = mx.array(rng.standard_normal((T, 1, n_in)).astype(np.float32))
            launches, y = _through_shim(lambda: e(x, mx.array(ids)))
            assert launches and all(ln.dialect == "cuda" for ln in launches)
            assert all(ln.kernel.header.startswith(mk.kernel_sources("expert_matvec", "cuda")[0][:80])
                       for ln in launches)
            for ln in launches:
                names[ln.kernel.name] = names.get(ln.kernel.name, 0) + 1
            blocks = mx.array(np.ascontiguousarray(e.raw))
            twin = np.array(expert_matvec_twin_ids(blocks, qtype, mx.broadcast_to(x, (T, k, n_in)).reshape(-1, n_in),
                                                   mx.array(ids.reshape(-1)))).reshape(T, k, out_dim)
            w = np.abs(mk_dense(e.raw, qtype))  # [n_expert, out, in]
            bound = 2e-5 * np.einsum("tkoi,ti->tko", w[ids], np.abs(np.asarray(x)[:, 0])) + 1e-30
            assert np.all(np.abs(y - twin) <= bound), (qtype.name, T, k)
    assert set(names) == {"ds4_expert_matvec", "ds4_expert_gather_mm"}, names


def mk_dense(raw, qtype):
    from ds4_mlx.model import mxfp4
    return np.array(mxfp4.expert_rows_mlx(mx.array(np.ascontiguousarray(raw)), qtype))


def test_version_names_a_bad_variable(monkeypatch):
    """``ds4-mlx --version`` prints the plan; a bad variable is named on its plan line, not a traceback."""
    from ds4_mlx.frontends.cli import version_text

    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    assert "expert LRU 1024 MiB default" in version_text().splitlines()[2]
    monkeypatch.setenv(load_plan.KV_LOCK_VAR, "soon")
    assert version_text().splitlines()[2] == ("load plan: error: DS4_MLX_KV_LOCK_TIMEOUT='soon' is not a number "
                                              "of seconds")
