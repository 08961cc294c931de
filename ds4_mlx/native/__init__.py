"""Native products on the host, read in place from the mmapped GGUF blocks: build at first use, load
with ctypes.

``experts.c`` (shipped as package data) computes token-expert pairs straight from the quantized blocks
of the mmapped GGUF tensor; ``ds4_mlx.model.experts.ExpertWeights`` calls it instead of copying the
selected slabs out and dequantizing them with MLX ops (see experts.c for the arithmetic). ``dense.c``
multiplies a Q8_0 matrix the same way: the output head of the host strategy in DEFAULT numerics
(``Model.head_logits``), which MLX's CPU backend would otherwise hold and read as float32. ``hc.c``
balances a hyper-connection mixer's 4x4 combine matrix (its Sinkhorn iterations) for the compiled
decode step, which reads the mixer's logits to the host instead of running ~100 tiny graph nodes
(``host_step.HostMixer``). The MLX-ops paths stay as the reference twins and the fallback.

Built on first use, not at import: the source is compiled with ``$CC`` (else ``cc``) into
``$XDG_CACHE_HOME/ds4-mlx/native/<hash>/`` (``~/.cache`` when unset), the hash covering the sources,
the flags, the compiler's version line and the machine (so a cache shared between hosts never hands
one CPU a library built for another). The build writes a temporary name and renames it into place,
so concurrent first uses never load a half-written file.

``DS4_MLX_NATIVE``: ``on`` (the default: build and use it) or ``off`` (the MLX path). Without a
compiler, or when the build fails, a one-line ``NativeWarning`` is issued once and the MLX path
runs; ``status()`` says why. (It was opt-in for a while because of two hangs seen only with it on;
neither was in this code: numpy's ``np.array`` hid a failed evaluation, see ``model.host``, and
MLX's one-time compiler probe ignores SIGINT, see ``compiled_decode.probe_compiler``; with it on
the timing just made them likelier.) ``DS4_MLX_NATIVE_THREADS``: threads per call (default: the CPUs this
process may use, at most 8); results do not depend on it.

Flags: ``-O3 -ffp-contract=off`` and never ``-ffast-math``, because contracting ``a*b+c`` into one
fused multiply-add or reassociating a sum changes bits (ds4-cpu numerics are bit-exact).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np

from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType

ENV_VAR = "DS4_MLX_NATIVE"
THREADS_VAR = "DS4_MLX_NATIVE_THREADS"
SOURCES = tuple(Path(__file__).with_name(n) for n in ("experts.c", "dense.c", "hc.c"))
HEADERS = (Path(__file__).with_name("half.h"),)  # included by the sources: part of the build's hash
LIBRARY = "libds4_native.so"
ABI = 2
BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math")
TUNE_FLAGS = ("-march=native",)  # tried first; dropped if the compiler refuses it
BUILD_TIMEOUT_S = 120


class NativeWarning(RuntimeWarning):
    """The native library could not be built or loaded; the MLX paths run instead."""


_lock = threading.Lock()
_state: dict[str, object] = {"enabled": False, "reason": "not attempted", "path": None}
_lib: list[ctypes.CDLL] = []


_OFF = ("off", "0", "no", "false")
_AUTO = ("", "auto", "on", "1", "yes", "true")


def _setting() -> str:
    """``auto`` (on: unset, the default) or ``off``. Any other value is taken as ``off`` (the reference
    path) and said once: a typo must not silently pick a path."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in _AUTO:
        return "auto"
    if value not in _OFF:
        _warn_once(f"{ENV_VAR}={os.environ.get(ENV_VAR)!r} is neither on nor off: the MLX path runs")
    return "off"


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, NativeWarning, stacklevel=3)


def threads() -> int:
    """Threads per native call: ``DS4_MLX_NATIVE_THREADS`` or the usable CPUs (at most 8)."""
    text = os.environ.get(THREADS_VAR, "").strip()
    if text:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n >= 1:
            return min(n, 64)
        _warn_once(f"{THREADS_VAR}={text!r} is not a whole number >= 1: using the default")
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "").strip() or "cc")


def _machine_id() -> str:
    """What the -march=native code depends on: the architecture and, on Linux, the CPU's model and flags."""
    parts = [platform.system(), platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU implementer", "CPU part"):
                    parts.append(line.strip())
                if line.strip() == "":
                    break  # the first processor is enough
    except OSError:
        pass
    return "\n".join(parts)


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "ds4-mlx" / "native"


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0][:200] if lines else "(no message)"


def _build() -> tuple[ctypes.CDLL | None, str, str | None]:
    """(library, reason, path): compile (or reuse) and load; never raises."""
    cc = _compiler()
    try:
        version = _run([*cc, "--version"])
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"no C compiler ({shlex.join(cc)}: {exc})", None
    if version.returncode != 0:
        return None, f"C compiler {shlex.join(cc)} does not run: {_first_line(version.stderr + version.stdout)}", None
    try:
        sources = b"\0".join(src.read_bytes() for src in SOURCES + HEADERS)
    except OSError as exc:
        return None, f"cannot read the native sources: {exc}", None
    compiler_id = _first_line(version.stdout + version.stderr)
    last_error = "no flags tried"
    for flags in (BASE_FLAGS + TUNE_FLAGS, BASE_FLAGS):
        key = hashlib.sha256(b"\0".join([sources, " ".join(cc).encode(), " ".join(flags).encode(),
                                         compiler_id.encode(), _machine_id().encode()])).hexdigest()[:20]
        out_dir = _cache_root() / key
        path = out_dir / LIBRARY
        if not path.exists():
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                return None, f"cannot write the build cache {out_dir}: {exc}", None
            error = compile_library(path, flags)
            if error is not None:
                last_error = error
                continue
        try:
            lib = load_library(path)
        except OSError as exc:
            return None, str(exc), None
        return lib, f"built with {compiler_id} ({' '.join(flags)})", str(path)
    return None, last_error, None


def compile_library(path: Path, flags: tuple[str, ...]) -> str | None:
    """Compile ``SOURCES`` with ``flags`` into ``path`` (a temporary name renamed into place, so a
    concurrent first use never loads a half-written file). None, or what went wrong in one line."""
    cc = _compiler()
    try:
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=path.parent)
        os.close(fd)
    except OSError as exc:
        return f"cannot write the build cache {path.parent}: {exc}"
    try:
        res = _run([*cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"])
        if res.returncode != 0:
            return f"{shlex.join(cc)} failed: {_first_line(res.stderr + res.stdout)}"
        os.replace(tmp, path)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{shlex.join(cc)} failed: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(path: Path | str) -> ctypes.CDLL:
    """Load a built library and declare its functions; OSError naming what is wrong."""
    try:
        lib = ctypes.CDLL(str(path))
        abi = lib.ds4n_abi()
    except (OSError, AttributeError) as exc:
        raise OSError(f"cannot load {path}: {exc}") from None
    if abi != ABI:
        raise OSError(f"{path}: ABI {abi} is not {ABI}")
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    common = [i32, p, i64, i64, i32, i32, i64, p, p, p, p]
    lib.ds4n_f32_pairs.argtypes = [*common, p, p, p, i32]
    lib.ds4n_f32_pairs.restype = i32
    lib.ds4n_ds4_pairs.argtypes = [*common, i64, p, p, p, p, i32]
    lib.ds4n_ds4_pairs.restype = i32
    lib.ds4n_ds4_f32_pairs.argtypes = [*common, i64, p, p, i32]
    lib.ds4n_ds4_f32_pairs.restype = i32
    lib.ds4n_q8_0_rows.argtypes = [p, i64, i64, i32, i32, p, p, i32]
    lib.ds4n_q8_0_rows.restype = i32
    lib.ds4n_hc_sinkhorn.argtypes = [p, i64, i32, p, p, i32, ctypes.c_float, p]
    lib.ds4n_hc_sinkhorn.restype = i32


def library() -> ctypes.CDLL | None:
    """The loaded library, building it on the first call; None when off or unavailable (then
    ``status()['reason']`` says why and a ``NativeWarning`` was issued once)."""
    with _lock:
        if _lib:
            return _lib[0]
        if _setting() == "off":
            return None  # not an attempt: switched on later in the process, it builds then
        if _state["reason"] != "not attempted":
            return None  # a failed build is not retried in this process
        lib, reason, path = _build()
        _state.update(enabled=lib is not None, reason=reason, path=path)
        if lib is None:
            warnings.warn(f"ds4-mlx native products unavailable ({reason}); using the MLX paths",
                          NativeWarning, stacklevel=3)
            return None
        _lib.append(lib)
        return lib


def available() -> bool:
    return library() is not None


def status(probe: bool = False) -> dict[str, object]:
    """``enabled``, ``reason``, ``path`` (the cached library), ``threads``; with ``probe`` the build
    is attempted first (``ds4-mlx inspect``), else the state so far is reported."""
    if probe:
        library()
    if _setting() == "off" and not _lib:
        return {"enabled": False, "reason": f"disabled by {ENV_VAR}={os.environ.get(ENV_VAR)}", "path": None,
                "threads": threads()}
    return {**_state, "threads": threads()}


def _reset_for_tests() -> None:
    """Forget the loaded library and the outcome (tests of the fallback paths)."""
    with _lock:
        _lib.clear()
        _state.update(enabled=False, reason="not attempted", path=None)


# -- the calls ---------------------------------------------------------------------------------------

def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _check_call(qtype: int, raw: np.ndarray, n_in: int, uniq: np.ndarray, bounds: np.ndarray, order: np.ndarray,
                rows: np.ndarray, x: np.ndarray) -> None:
    """The C code trusts its indices: every one is checked here (a few small arrays), so no call can
    read outside the blocks or the activations whatever its caller passes."""
    if raw.dtype != np.uint8 or raw.ndim != 3 or raw.strides[2] != 1:
        raise ValueError(f"native experts need uint8 [n_expert, out, row_bytes] blocks with contiguous rows, "
                         f"got {raw.dtype} {raw.shape} strides {raw.strides}")
    elems, block_bytes = BLOCK_GEOMETRY[GGMLType(qtype)]
    if x.ndim != 2 or x.shape[1] != n_in or n_in % elems or raw.shape[2] < n_in // elems * block_bytes:
        raise ValueError(f"native experts: {n_in} inputs do not fit blocks of {raw.shape[2]} bytes a row "
                         f"and activations of shape {x.shape}")
    n_rows = x.shape[0]
    P = rows.size
    if (bounds.size != uniq.size + 1 or (bounds.size and (bounds[0] != 0 or bounds[-1] != order.size))
            or np.any(np.diff(bounds) < 0) or order.size != P):
        raise ValueError(f"native experts: groups {bounds.tolist()} do not cover {P} pairs")
    if uniq.size and (uniq.min() < 0 or uniq.max() >= raw.shape[0]):
        raise ValueError(f"native experts: expert ids must be in [0, {raw.shape[0]})")
    if P and (order.min() < 0 or order.max() >= P or rows.min() < 0 or rows.max() >= n_rows):
        raise ValueError(f"native experts: pair or row index out of range ({P} pairs, {n_rows} rows)")


def pairs_f32(lib: ctypes.CDLL, qtype: int, raw: np.ndarray, n_in: int, uniq: np.ndarray, bounds: np.ndarray,
              order: np.ndarray, rows: np.ndarray, x: np.ndarray, signed_grid: np.ndarray) -> np.ndarray:
    """Default numerics: y[p] = dequant(raw[e]) @ x[rows[p]] for the pairs of group g (expert uniq[g]):
    order[bounds[g]:bounds[g+1]]. x float32 [R, n_in] -> float32 [P, out]."""
    uniq, bounds, order, rows = _i64(uniq), _i64(bounds), _i64(order), _i64(rows)
    x = np.ascontiguousarray(x, dtype=np.float32)
    _check_call(qtype, raw, n_in, uniq, bounds, order, rows, x)
    y = np.empty((rows.size, raw.shape[1]), dtype=np.float32)
    rc = lib.ds4n_f32_pairs(int(qtype), _ptr(raw), raw.strides[0], raw.strides[1], raw.shape[1], n_in,
                            uniq.size, _ptr(uniq), _ptr(bounds), _ptr(order), _ptr(rows), _ptr(x),
                            _ptr(signed_grid), _ptr(y), threads())
    if rc:
        raise MemoryError(f"native expert product failed (code {rc})")
    return y


def pairs_ds4(lib: ctypes.CDLL, qtype: int, raw: np.ndarray, n_in: int, uniq: np.ndarray, bounds: np.ndarray,
              order: np.ndarray, rows: np.ndarray, xq: np.ndarray, xd: np.ndarray,
              signed_grid: np.ndarray) -> np.ndarray:
    """ds4-cpu numerics: the same pairs with the Q8_K activation xq int8 [R, n_in], xd float32 [R, n_in/256]."""
    uniq, bounds, order, rows = _i64(uniq), _i64(bounds), _i64(order), _i64(rows)
    xq = np.ascontiguousarray(xq, dtype=np.int8)
    xd = np.ascontiguousarray(xd, dtype=np.float32)
    _check_call(qtype, raw, n_in, uniq, bounds, order, rows, xq)
    y = np.empty((rows.size, raw.shape[1]), dtype=np.float32)
    rc = lib.ds4n_ds4_pairs(int(qtype), _ptr(raw), raw.strides[0], raw.strides[1], raw.shape[1], n_in,
                            uniq.size, _ptr(uniq), _ptr(bounds), _ptr(order), _ptr(rows), xq.shape[0], _ptr(xq),
                            _ptr(xd), _ptr(signed_grid), _ptr(y), threads())
    if rc == -2:
        raise ValueError(f"native experts: no Q8_K ds4 product for GGML type {qtype} (MXFP4: pairs_ds4_f32)")
    if rc:
        raise MemoryError(f"native expert product failed (code {rc})")
    return y


def pairs_ds4_f32(lib: ctypes.CDLL, qtype: int, raw: np.ndarray, n_in: int, uniq: np.ndarray, bounds: np.ndarray,
                  order: np.ndarray, rows: np.ndarray, x: np.ndarray) -> np.ndarray:
    """ds4-cpu numerics of a type whose ds4 dot takes float activations (MXFP4: ds4_vec_dot_mxfp4_f32):
    the same pairs with x float32 [R, n_in]."""
    uniq, bounds, order, rows = _i64(uniq), _i64(bounds), _i64(order), _i64(rows)
    x = np.ascontiguousarray(x, dtype=np.float32)
    _check_call(qtype, raw, n_in, uniq, bounds, order, rows, x)
    y = np.empty((rows.size, raw.shape[1]), dtype=np.float32)
    rc = lib.ds4n_ds4_f32_pairs(int(qtype), _ptr(raw), raw.strides[0], raw.strides[1], raw.shape[1], n_in,
                                uniq.size, _ptr(uniq), _ptr(bounds), _ptr(order), _ptr(rows), x.shape[0], _ptr(x),
                                _ptr(y), threads())
    if rc == -2:
        raise ValueError(f"native experts: no float-activation ds4 product for GGML type {qtype}")
    if rc:
        raise MemoryError(f"native expert product failed (code {rc})")
    return y


def q8_0_rows(lib: ctypes.CDLL, raw: np.ndarray, n_in: int, x: np.ndarray) -> np.ndarray:
    """Default numerics' product of a Q8_0 matrix read in place: ``raw`` uint8 [rows, n_in/32*34]
    (rows contiguous; a row slice of the mapping is fine), x float32 [T, n_in] -> float32 [T, rows]
    (dense.c: the dequantized weight times x, summed in one fixed order)."""
    elems, block_bytes = BLOCK_GEOMETRY[GGMLType.Q8_0]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.strides[1] != 1 or n_in % elems or n_in < elems \
            or raw.shape[1] < n_in // elems * block_bytes:
        raise ValueError(f"native Q8_0 product: {n_in} inputs do not fit blocks of shape {raw.shape} "
                         f"({raw.dtype}, strides {raw.strides})")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != n_in:
        raise ValueError(f"native Q8_0 product: activations of shape {x.shape}, expected [T, {n_in}]")
    y = np.empty((x.shape[0], raw.shape[0]), dtype=np.float32)
    rc = lib.ds4n_q8_0_rows(_ptr(raw), raw.strides[0], raw.shape[0], n_in, x.shape[0], _ptr(x), _ptr(y), threads())
    if rc:
        raise ValueError(f"native Q8_0 product refused its arguments (code {rc})")
    return y


def hc_sinkhorn(lib: ctypes.CDLL, mix: np.ndarray, n: int, scale: np.ndarray, base: np.ndarray, iters: int,
                eps: float) -> np.ndarray:
    """A hyper-connection mixer's combine matrices from its logits (hc.c): mix float32 [T, 2n + n*n],
    scale [3], base [2n + n*n] -> float32 [T, n, n]."""
    width = 2 * n + n * n
    mix = np.ascontiguousarray(mix, dtype=np.float32)
    scale = np.ascontiguousarray(scale, dtype=np.float32).reshape(-1)
    base = np.ascontiguousarray(base, dtype=np.float32).reshape(-1)
    if mix.ndim != 2 or mix.shape[1] != width or scale.size != 3 or base.size != width or not 1 <= n <= 16 \
            or iters < 1:
        raise ValueError(f"native Sinkhorn: mix {mix.shape}, scale {scale.shape}, base {base.shape} do not fit "
                         f"{n} streams ({width} logits), {iters} iterations")
    out = np.empty((mix.shape[0], n, n), dtype=np.float32)
    rc = lib.ds4n_hc_sinkhorn(_ptr(mix), mix.shape[0], n, _ptr(scale), _ptr(base), iters, float(eps), _ptr(out))
    if rc:
        raise ValueError(f"native Sinkhorn refused its arguments (code {rc})")
    return out
