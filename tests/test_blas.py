"""The BLAS hook: MLX must bind to OpenBLAS when one is installed, and stay correct either way.

Which library ``libmlx.so`` really calls is checked two independent ways: through
``ds4_mlx.blas.status()`` (reads libmlx.so's relocation slot) and through the dynamic linker's own
``LD_DEBUG=bindings`` trace. Each scenario runs in a fresh interpreter, since the binding is fixed
once ``mlx.core`` is loaded.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ds4_mlx import blas

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="BLAS preloading is Linux-only (macOS MLX uses Accelerate)"
)

REPO = Path(__file__).resolve().parents[1]
OPENBLAS, _REJECTED = blas.select(blas.Setting("auto"), blas.candidate_paths())
needs_openblas = pytest.mark.skipif(
    OPENBLAS is None,
    reason=f"no unprefixed OpenBLAS on this machine (Debian/Ubuntu: apt-get install {blas.APT_PACKAGE})",
)


def _mlx_libs_dir() -> Path:
    import mlx

    return Path(mlx.__path__[0]).parent / "mlx_cpu.libs"


def _libmlx() -> Path:
    import mlx

    return Path(mlx.__path__[0]) / "lib" / "libmlx.so"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DS4_MLX_BLAS", "LD_PRELOAD", "LD_DEBUG")}
    env.update(extra)
    return env


STATUS_SCRIPT = """
import json, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    {imports}
import ds4_mlx.blas as b
mine = [str(w.message) for w in caught if issubclass(w.category, b.BlasWarning)]
print(json.dumps({{"status": b.status(), "warnings": mine}}))
"""


def _status(imports: str = "import ds4_mlx; import mlx.core", ld_debug: Path | None = None, **env: str) -> dict:
    extra = dict(env)
    if ld_debug is not None:
        extra.update(LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(ld_debug))
    code = STATUS_SCRIPT.format(imports=imports)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(**extra), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _linker_binding(trace_prefix: Path, symbol: str = "cblas_sgemm") -> str:
    """The file the dynamic linker bound libmlx.so's ``symbol`` to, from an LD_DEBUG trace."""
    pattern = re.compile(rf"binding file \S*/libmlx\.so \[\d+\] to (\S+) \[\d+\]: normal symbol `{symbol}'")
    hits = []
    for name in glob.glob(f"{trace_prefix}.*"):
        hits += pattern.findall(Path(name).read_text(errors="replace"))
    assert len(set(hits)) == 1, f"expected one binding for {symbol}, got {hits}"
    return os.path.realpath(hits[0])


# --- unit: the pieces of the decision -------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "mode", "path"),
    [
        (None, "auto", None),
        ("", "auto", None),
        (" AUTO ", "auto", None),
        ("off", "off", None),
        ("OFF", "off", None),
        ("/opt/lib/libopenblas.so.0", "path", "/opt/lib/libopenblas.so.0"),
        ("libopenblas.so.0", "path", "libopenblas.so.0"),
    ],
)
def test_parse_setting(value, mode, path):
    setting = blas.parse_setting(value)
    assert (setting.mode, setting.path) == (mode, path)


def test_candidates_include_env_prefix(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert blas.candidate_paths() == list(blas.SONAMES)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libopenblas.so.0").write_bytes(b"")
    assert blas.candidate_paths() == [*blas.SONAMES, str(tmp_path / "lib" / "libopenblas.so.0")]


def test_missing_library_rejected(tmp_path):
    lib, reason = blas.check_library(str(tmp_path / "libopenblas.so.0"))
    assert lib is None and "cannot be opened" in reason


def test_prefixed_openblas_rejected():
    import numpy

    found = glob.glob(os.path.join(os.path.dirname(numpy.__file__) + ".libs", "libscipy_openblas*.so"))
    if not found:
        pytest.skip("this numpy does not bundle scipy-openblas")
    assert b"scipy_cblas_sgemm" in Path(found[0]).read_bytes()  # it is the prefixed kind
    lib, reason = blas.check_library(found[0])
    assert lib is None and "unprefixed cblas_sgemm" in reason


def test_select_off_and_bad_path(tmp_path):
    assert blas.select(blas.Setting("off"), ["libopenblas.so.0"]) == (None, [])
    missing = str(tmp_path / "nope.so")
    path, rejected = blas.select(blas.Setting("path", missing), ["libopenblas.so.0"])
    assert path is None and len(rejected) == 1 and rejected[0].startswith(missing)


@needs_openblas
def test_select_skips_unusable_candidates(tmp_path):
    path, rejected = blas.select(blas.Setting("auto"), [str(tmp_path / "nope.so"), OPENBLAS])
    assert path == OPENBLAS and len(rejected) == 1


def test_classify():
    netlib = glob.glob(str(_mlx_libs_dir() / "libblas*.so*"))
    assert netlib, "mlx[cpu] wheel without its bundled libblas?"
    assert blas.classify(netlib[0]) == "netlib"
    assert blas.classify(None) == "unknown"
    assert blas.classify("/nowhere/libsomething.so") == "other"
    if OPENBLAS:
        assert blas.classify(OPENBLAS) == "openblas"


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not installed")
@pytest.mark.parametrize("symbol", ["cblas_sgemm", "sgetrf_"])
def test_got_slots_match_readelf(symbol):
    slots, first_vaddr = blas.got_slots(str(_libmlx()), symbol)
    out = subprocess.run(["readelf", "-r", "-W", str(_libmlx())], capture_output=True, text=True, check=True).stdout
    expected = sorted(int(line.split()[0], 16) for line in out.splitlines() if re.search(rf"\s{symbol} \+", line))
    assert expected and sorted(slots) == expected
    assert first_vaddr == 0


def test_got_slots_rejects_non_elf(tmp_path):
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not an elf file at all" * 10)
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        blas.got_slots(str(junk), "cblas_sgemm")
    truncated = tmp_path / "truncated.so"
    truncated.write_bytes(_libmlx().read_bytes()[:4096])  # headers point past the end
    with pytest.raises(ValueError, match="truncated or malformed"):
        blas.got_slots(str(truncated), "cblas_sgemm")


def test_not_found_warns_once():
    # A standalone copy of the module (not the package, whose import already ran the hook) with
    # nothing to find: the state and the one-time warning must say so.
    code = textwrap.dedent(
        f"""
        import importlib.util, json, sys, warnings
        spec = importlib.util.spec_from_file_location("blas_alone", {str(REPO / "ds4_mlx" / "blas.py")!r})
        mod = sys.modules["blas_alone"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.candidate_paths = lambda: ["/nonexistent/libopenblas.so.0"]
        mod.global_provider = lambda symbol="cblas_sgemm": None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mod.preload(); mod.preload()
        print(json.dumps({{"how": mod._STATE.how, "warnings": [str(w.message) for w in caught]}}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["how"] == "not-found"
    assert len(result["warnings"]) == 1 and blas.APT_PACKAGE in result["warnings"][0]


# --- subprocess: what libmlx.so really binds to ---------------------------------------------


@needs_openblas
def test_default_binds_openblas(tmp_path):
    result = _status(ld_debug=tmp_path / "ld")
    st = result["status"]
    assert (st["blas"], st["how"], st["path"]) == ("openblas", "preloaded", OPENBLAS)
    assert result["warnings"] == []
    assert _linker_binding(tmp_path / "ld") == OPENBLAS
    # LAPACK entry points follow: mlx.core.linalg runs on OpenBLAS's LAPACK too.
    assert _linker_binding(tmp_path / "ld", "sgetrf_") == OPENBLAS


def test_off_keeps_bundled_blas(tmp_path):
    result = _status(ld_debug=tmp_path / "ld", DS4_MLX_BLAS="off")
    st = result["status"]
    assert (st["blas"], st["how"]) == ("netlib", "disabled")
    assert result["warnings"] == []
    bound = _linker_binding(tmp_path / "ld")
    assert Path(bound).parent == _mlx_libs_dir().resolve() and st["path"] == bound


def test_mlx_imported_first_warns():
    result = _status(imports="import mlx.core; import ds4_mlx")
    st = result["status"]
    assert (st["blas"], st["how"]) == ("netlib", "mlx-imported-first")
    assert len(result["warnings"]) == 1 and "Import ds4_mlx before mlx" in result["warnings"][0]
    if OPENBLAS:
        assert f"LD_PRELOAD={OPENBLAS}" in result["warnings"][0]


@needs_openblas
def test_ld_preload_counts_even_if_mlx_first():
    result = _status(imports="import mlx.core; import ds4_mlx", LD_PRELOAD=OPENBLAS)
    st = result["status"]
    assert (st["blas"], st["how"], st["path"]) == ("openblas", "preexisting", OPENBLAS)
    assert result["warnings"] == []


@needs_openblas
def test_explicit_path():
    result = _status(DS4_MLX_BLAS=OPENBLAS)
    st = result["status"]
    assert (st["blas"], st["how"], st["path"], st["setting"]) == ("openblas", "env-path", OPENBLAS, OPENBLAS)


def test_unusable_explicit_path_warns(tmp_path):
    missing = str(tmp_path / "libopenblas.so.0")
    result = _status(DS4_MLX_BLAS=missing)
    st = result["status"]
    assert (st["blas"], st["how"]) == ("netlib", "load-failed")
    assert len(result["warnings"]) == 1 and missing in result["warnings"][0]


# --- correctness through MLX under each BLAS ------------------------------------------------

GEMM_SCRIPT = """
import json
import ds4_mlx, ds4_mlx.blas as b
import mlx.core as mx
import numpy as np

rng = np.random.default_rng(7)
worst = 0.0
# Odd sizes hit kernel edge cases; the transposed views exercise the trans flags MLX passes; M=1 is a GEMV.
for m, n, k in [(1, 257, 513), (33, 65, 129), (257, 129, 513), (128, 128, 1024)]:
    for ta, tb in [(False, False), (True, False), (False, True)]:
        a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
        c = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
        A, C = (a.T if ta else a), (c.T if tb else c)
        xa, xc = mx.array(a), mx.array(c)
        got = np.array((xa.T if ta else xa) @ (xc.T if tb else xc))
        ref = A.astype(np.float64) @ C.astype(np.float64)
        # Standard forward-error bound of a length-k float32 dot product: k * eps * (|A| @ |C|).
        bound = k * np.finfo(np.float32).eps * (np.abs(A).astype(np.float64) @ np.abs(C).astype(np.float64))
        worst = max(worst, float(np.max(np.abs(got - ref) / bound)))
x = rng.standard_normal((64, 64)) + 64 * np.eye(64)
inv = np.array(mx.linalg.inv(mx.array(x.astype(np.float32)), stream=mx.cpu))
inv_err = float(np.max(np.abs(x @ inv - np.eye(64))))
print(json.dumps({"blas": b.status()["blas"], "worst": worst, "inv_err": inv_err}))
"""


@pytest.mark.parametrize(
    ("setting", "kind"),
    [pytest.param("auto", "openblas", marks=needs_openblas), pytest.param("off", "netlib")],
)
def test_gemm_matches_numpy(setting, kind):
    proc = subprocess.run(
        [sys.executable, "-c", GEMM_SCRIPT], env=_env(DS4_MLX_BLAS=setting), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["blas"] == kind
    assert result["worst"] <= 1.0, result
    assert result["inv_err"] < 1e-4, result
