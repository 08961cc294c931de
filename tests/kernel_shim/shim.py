"""Run ds4-mlx's GPU kernels on the host, strictly, in both dialects (test infrastructure; see
metal_shim.h and cuda_shim.h).

1. **Record**: ``record(fn)`` calls ``fn`` with ``mx.fast.metal_kernel`` and ``mx.fast.cuda_kernel``
   replaced by recorders, so every launch the package's wrappers make (dialect, inputs, template arguments,
   grid, threadgroup, outputs) is captured exactly as the wrapper computed it.
2. **Generate**: ``generated_source`` gets the exact text MLX's Metal backend would compile, from MLX itself:
   ``mx.fast.metal_kernel(..., verbose=True)`` prints it, and since MLX 0.32 it runs without a Metal
   back-end while ``mx.export_function`` traces (``mlx/backend/common/metal_kernel.cpp``:
   ``resolve_metal_kernel_stream`` allows export tracing; ``write_signature`` makes inputs with fewer than
   ``max_constant_array_size = 8`` elements ``const constant T*``, 0-d inputs references, appends the
   ``[[thread_position_in_grid]]``-style attributes the body mentions, and instantiates the template with
   ``[[host_name]]``). Nothing is re-derived here.
   CUDA: MLX's CPU install cannot build a ``cuda_kernel`` at all ("No CUDA back-end"), so its text is
   assembled here by the rules of ``build_kernel`` in ``mlx/backend/cuda/custom_kernel.cpp`` (MLX 846d176,
   the 0.32 line): the default header (device utils + cooperative groups), the user header, then
   ``namespace mlx::core::cu { namespace cg = cooperative_groups; __global__ void
   custom_kernel_<name><template hash>(const T* in, [shape/strides/ndim if the body names them], T* out) {
   constexpr int N = v; ... body }}``, types by ``dtype_to_cuda_type`` (``mlx/backend/cuda/utils.cpp``).
   Every input is ``const T*`` whatever its size (no ``constant`` space), and the launch is
   ceil(grid / threadgroup) blocks of min(threadgroup, grid) threads (``CustomKernel::eval_gpu``).
3. **Compile**: the generated text is rewritten only where C++ needs it (address-space keywords become the
   ``shim::asp<space, T>`` types, attributes dropped, ``threadgroup`` / ``__shared__`` arrays become
   group-shared poisoned storage; object-like macros that stand for an address space, like the kernels'
   ``DS4_TG``, are expanded first),
   all instantiations of one header go in one translation unit, built with g++ (ASan + UBSan, warnings on),
   cached by content hash in the temp directory (so each variant compiles once per machine, not per test).
4. **Run**: one process runs all launches of a batch (job file); each threadgroup's threads are fibers in a
   seeded random order, threadgroups spread over host threads. Outputs come back as numpy arrays, and
   ``replay(fn, outputs)`` re-runs ``fn`` with the kernels returning them, so wrapper post-processing
   (reordering, etc.) is exercised as on a GPU.

The dialect is a parameter (``DIALECTS``): one harness, one runtime; only the name layer differs.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
DIALECTS = ("metal", "cuda")

# MLX's get_type_string names -> numpy dtypes (what the recorder sees)
_MX_TO_NP = {
    mx.float32: np.float32, mx.float16: np.float16, mx.int32: np.int32, mx.uint32: np.uint32,
    mx.uint8: np.uint8, mx.int8: np.int8, mx.int16: np.int16, mx.uint16: np.uint16,
    mx.int64: np.int64, mx.uint64: np.uint64, mx.bool_: np.bool_,
}


def gxx() -> str | None:
    return shutil.which("g++")


# --------------------------------------------------------------------------------------------------
# 1. record


@dataclass(frozen=True)
class KernelDef:
    """The arguments of one ``mx.fast.metal_kernel(...)`` (or ``cuda_kernel``) construction."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = ""
    ensure_row_contiguous: bool = True
    atomic_outputs: bool = False
    dialect: str = "metal"
    shared_memory: int = 0

    def patched(self, old: str, new: str, where: str = "source", count: int = 1) -> "KernelDef":
        """A copy with ``old`` replaced by ``new`` in the body or header (planted faults); ``old`` must occur."""
        text = getattr(self, where)
        if text.count(old) < count:
            raise AssertionError(f"patch target not found in {where} of {self.name}: {old!r}")
        return replace(self, **{where: text.replace(old, new, count)})


@dataclass
class Launch:
    """One call of a kernel object: what the wrapper passed."""

    kernel: KernelDef
    inputs: list[np.ndarray]
    template: list[tuple[str, object]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[object]
    init_value: float | None = None
    label: str = ""

    @property
    def dialect(self) -> str:
        return self.kernel.dialect


class _Recorder:
    def __init__(self, defn: KernelDef, sink):
        self.defn, self.sink = defn, sink

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None):
        return self.sink(Launch(self.defn, [np.array(a) for a in inputs], list(template or []), tuple(grid),
                                tuple(threadgroup), [tuple(s) for s in output_shapes], list(output_dtypes),
                                init_value))


@contextmanager
def _kernels_replaced(sink):
    """``mx.fast.metal_kernel`` / ``cuda_kernel`` build recorders; cached kernel objects in ds4_mlx are dropped
    around it."""
    import ds4_mlx.model.metal_kernels as mk

    def clear():
        for v in vars(mk).values():
            if callable(getattr(v, "cache_clear", None)) and getattr(v, "__module__", "") == mk.__name__:
                v.cache_clear()

    real_metal, real_cuda = mx.fast.metal_kernel, mx.fast.cuda_kernel

    def fake_metal(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                   atomic_outputs=False, compile_options=None):
        return _Recorder(KernelDef(name, tuple(input_names), tuple(output_names), source, header,
                                   ensure_row_contiguous, atomic_outputs), sink)

    def fake_cuda(name, input_names, output_names, source, header="", ensure_row_contiguous=True, shared_memory=0):
        return _Recorder(KernelDef(name, tuple(input_names), tuple(output_names), source, header,
                                   ensure_row_contiguous, False, "cuda", shared_memory), sink)

    clear()
    mx.fast.metal_kernel, mx.fast.cuda_kernel = fake_metal, fake_cuda
    try:
        yield
    finally:
        mx.fast.metal_kernel, mx.fast.cuda_kernel = real_metal, real_cuda
        clear()


def record(fn, *args, **kwargs) -> list[Launch]:
    """The kernel launches ``fn(*args, **kwargs)`` makes (their outputs are zeros meanwhile)."""
    launches: list[Launch] = []

    def sink(launch: Launch):
        launches.append(launch)
        return [mx.zeros(s, dtype=d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]

    with _kernels_replaced(sink):
        fn(*args, **kwargs)
    return launches


def replay(fn, outputs: list[list[np.ndarray]], *args, **kwargs):
    """``fn(*args, **kwargs)`` with its kernel launches, in order, returning ``outputs``."""
    it = iter(outputs)

    def sink(launch: Launch):
        return [mx.array(o) for o in next(it)]

    with _kernels_replaced(sink):
        return fn(*args, **kwargs)


# --------------------------------------------------------------------------------------------------
# 2. the source MLX would compile


@contextmanager
def _stdout_to(path: Path):
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.dup2(fd, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(fd)
        os.close(saved)


_source_cache: dict[tuple, str] = {}


def _source_key(launch: Launch) -> tuple:
    shapes = tuple((a.dtype.str, a.ndim == 0, a.size < 8) for a in launch.inputs)
    return (launch.kernel, tuple((n, repr(v)) for n, v in launch.template), shapes,
            tuple(str(d) for d in launch.output_dtypes))


def generated_source(launch: Launch) -> str:
    """Exactly what MLX hands to the Metal compiler for this launch (minus MLX's own utils header), or to
    NVRTC for a CUDA launch."""
    key = _source_key(launch)
    if key in _source_cache:
        return _source_cache[key]
    if launch.dialect == "cuda":
        _source_cache[key] = _cuda_source(launch)
        return _source_cache[key]
    k = launch.kernel
    real = mx.fast.metal_kernel(name=k.name, input_names=list(k.input_names), output_names=list(k.output_names),
                                source=k.source, header=k.header, ensure_row_contiguous=k.ensure_row_contiguous,
                                atomic_outputs=k.atomic_outputs)

    def traced(*ins):
        return real(inputs=list(ins), template=launch.template, grid=launch.grid, threadgroup=launch.threadgroup,
                    output_shapes=launch.output_shapes, output_dtypes=launch.output_dtypes,
                    init_value=launch.init_value, verbose=True)

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "stdout"
        with _stdout_to(log):
            mx.export_function(str(Path(tmp) / "k.mlxfn"), traced, *[mx.array(a) for a in launch.inputs])
        text = log.read_text()
    m = re.search(r"Generated source code for `[^`]*`:\n```\n(.*)\n```", text, re.S)
    if not m:
        raise RuntimeError(f"MLX did not print the generated source of {k.name}: {text[:500]!r}")
    _source_cache[key] = m.group(1)
    return m.group(1)


# mlx/backend/cuda/custom_kernel.cpp, default_header and build_kernel (MLX 846d176)
CUDA_DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

"""
# mlx/backend/cuda/utils.cpp, dtype_to_cuda_type
_CUDA_TYPES = {
    np.dtype(np.bool_): "bool", np.dtype(np.int8): "int8_t", np.dtype(np.int16): "int16_t",
    np.dtype(np.int32): "int32_t", np.dtype(np.int64): "int64_t", np.dtype(np.uint8): "uint8_t",
    np.dtype(np.uint16): "uint16_t", np.dtype(np.uint32): "uint32_t", np.dtype(np.uint64): "uint64_t",
    np.dtype(np.float16): "__half", np.dtype(np.float32): "float", np.dtype(np.float64): "double",
}


def _cuda_template_hash(template) -> str:
    out = ""
    for _, v in template:
        if isinstance(v, bool):
            out += "_t" if v else "_f"
        elif isinstance(v, int):
            out += f"_{v}"
        else:
            raise NotImplementedError(f"dtype template arguments are not modelled for CUDA: {v!r}")
    return out


def _cuda_source(launch: Launch) -> str:
    k = launch.kernel
    for name in k.input_names:
        if any(f"{name}_{s}" in k.source for s in ("shape", "strides", "ndim")):
            raise NotImplementedError(f"{k.name}: shape/strides/ndim parameters are not modelled for CUDA")
    params = [f"    const {_CUDA_TYPES[a.dtype]}* {n},\n" for n, a in zip(k.input_names, launch.inputs)]
    outs = [f"    {_CUDA_TYPES[np.dtype(_MX_TO_NP[d])]}* {n}" for n, d in zip(k.output_names, launch.output_dtypes)]
    consts = ""
    for n, v in launch.template:
        consts += f"  constexpr bool {n} = {'true' if v else 'false'};\n" if isinstance(v, bool) \
            else f"  constexpr int {n} = {v};\n"
    if consts:
        consts += "\n"
    func = f"custom_kernel_{k.name}{_cuda_template_hash(launch.template)}"
    return (CUDA_DEFAULT_HEADER + k.header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void {func}(\n" + "".join(params) + ",\n".join(outs) + ") {\n" + consts + k.source
            + "\n}\n\n} // namespace mlx::core::cu\n")


def header_of(launch: Launch) -> str:
    """The part of the generated source before the kernel (shared by a header's instantiations)."""
    return CUDA_DEFAULT_HEADER + launch.kernel.header if launch.dialect == "cuda" else launch.kernel.header


# --------------------------------------------------------------------------------------------------
# 3. C++ translation unit

_TYPE = r"[A-Za-z_]\w*(?:\s*<[^<>;{}()]*>)?"
_SPACES = {"device": 1, "constant": 2, "threadgroup": 3}


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


_ASP_WORDS = r"device|constant|threadgroup|thread|__shared__|__device__(?:[ \t]+const)?"
_ASP_MACRO = re.compile(rf"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)(?:[ \t]+({_ASP_WORDS}))?[ \t]*$", re.M)


def _expand_space_macros(text: str, macros: dict[str, str]) -> str:
    """Object-like macros whose whole value is an address-space word (or nothing), like the kernels'
    ``#define DS4_TG threadgroup``, expanded in place (their #define lines blanked), so the rewrite below
    sees the keyword where it is used. Other macros are left to the compiler."""
    def collect(m):
        macros[m.group(1)] = m.group(2) or ""
        return ""

    text = _ASP_MACRO.sub(collect, text)
    for name, value in macros.items():
        text = re.sub(rf"\b{name}\b", value, text)
    return text


def to_cpp(text: str, unit: str, dialect: str = "metal", macros: dict[str, str] | None = None) -> str:
    """Kernel text -> C++ for metal_shim.h / cuda_shim.h: same lines; Metal address spaces as types, CUDA
    ``__shared__`` arrays as group-shared storage. ``macros`` carries address-space macros from a header
    to the kernels that follow it."""
    text = _strip_comments(text)
    text = _expand_space_macros(text, {} if macros is None else macros)
    if dialect == "cuda":
        def shared_decl(m):
            typ, name, ext = m.group(1), m.group(2), m.group(3)
            alias = f"shim_tg_type_{name}"
            return (f"using {alias} = {typ}{ext}; {alias}& {name} = *static_cast<{alias}*>("
                    f"::shim::tg_alloc(\"{unit}:{name}@\" SHIM_STR(__LINE__), sizeof({alias}), alignof({alias})));")

        text = re.sub(rf"\b__shared__\s+({_TYPE})\s+(\w+)\s*((?:\[[^\]]+\])+)\s*;", shared_decl, text)
        if re.search(r"\b__shared__\b", text):
            raise NotImplementedError(f"{unit}: a __shared__ declaration the shim does not model (scalars, extern)")
        return re.sub(r"\b__device__\s+const\b", "static const", text)
    text = re.sub(r"\[\[[^\[\]]*\]\]", "", text)

    def tg_decl(m):
        typ, name, ext = m.group(1), m.group(2), m.group(3)
        alias = f"shim_tg_type_{name}"
        return (f"using {alias} = shim::asp<3, {typ}>{ext}; {alias}& {name} = *static_cast<{alias}*>("
                f"::shim::tg_alloc(\"{unit}:{name}@\" SHIM_STR(__LINE__), sizeof({alias}), alignof({alias})));")

    text = re.sub(rf"\bthreadgroup\s+({_TYPE})\s+(\w+)\s*((?:\[[^\]]+\])+)\s*;", tg_decl, text)
    # scalar program-scope constants are plain values; arrays keep their constant-space element type
    text = re.sub(rf"\bconstant\s+({_TYPE})\s+(\w+)\s*=", r"static const \1 \2 =", text)
    text = re.sub(rf"\b(device|constant|threadgroup)\s+((?:const\s+|volatile\s+)*)({_TYPE})",
                  lambda m: f"{m.group(2)}shim::asp<{_SPACES[m.group(1)]}, {m.group(3)}>", text)
    return re.sub(r"\bthread\s+(?=(?:const\s+)?[A-Za-z_])", "", text)


@dataclass
class Signature:
    func: str
    call: str  # func<args> or func
    buffers: list[tuple[str, str, bool]]  # (param name, C++ pointer type, by reference)
    attributes: list[str]


def parse_signature(body_text: str, dialect: str = "metal") -> Signature:
    if dialect == "cuda":
        m = re.search(r"__global__ void (\w+)\(\n(.*?)\) \{\n", body_text, re.S)
        if not m:
            raise RuntimeError("no __global__ signature in the generated CUDA source")
        buffers = []
        for line in m.group(2).split("\n"):
            line = line.strip().rstrip(",")
            pm = re.fullmatch(r"((?:const )?[\w:]+\*) (\w+)", line)
            if not pm:
                raise RuntimeError(f"unexpected parameter in the generated CUDA signature: {line!r}")
            buffers.append((pm.group(2), pm.group(1), False))
        return Signature(m.group(1), f"::mlx::core::cu::{m.group(1)}", buffers, [])
    m = re.search(r"\[\[kernel\]\] void (\w+)\(\n(.*?)\) \{\n", body_text, re.S)
    if not m:
        raise RuntimeError("no [[kernel]] signature in the generated source")
    func, params = m.group(1), m.group(2)
    buffers, attrs = [], []
    for line in params.split("\n"):
        line = line.strip().rstrip(",")
        if not line:
            continue
        pm = re.fullmatch(r"(.*?)\s*(\w+)\s*\[\[(\w+)(?:\((\d+)\))?\]\]", line)
        if not pm:
            raise RuntimeError(f"unexpected parameter in the generated signature: {line!r}")
        decl, name, attr = pm.group(1), pm.group(2), pm.group(3)
        if attr == "buffer":
            assert int(pm.group(4)) == len(buffers), line
            ref = decl.endswith("&")
            ptr = to_cpp(decl[:-1] if ref else decl[:-1], func).strip() + "*"
            buffers.append((name, ptr, ref))
        else:
            attrs.append(name)
    inst = re.search(r"decltype\((\w+<.*?>)\)", body_text)
    call = inst.group(1) if inst else func
    return Signature(func, call, buffers, attrs)


def _thunk(idx: int, sig: Signature) -> str:
    args = [f"{'*' if ref else ''}({ptr})b[{i}]" for i, (_, ptr, ref) in enumerate(sig.buffers)]
    args += [f"ids.{a}" for a in sig.attributes]
    return (f"static void shim_thunk_{idx}(void* const* b, const shim::ThreadIds& ids) {{\n"
            f"    {sig.call}({', '.join(args)});\n}}\n")


FLAGS = {
    # the default: sanitizers stop at the first report, warnings shown
    "asan": ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"],
    "plain": ["-O2", "-g"],
    # shim checks only (address spaces, alignment, barriers, SIMD rendezvous, poison): quickest to build
    "check": ["-O0"],
}
# CUDA pointers are generic, so alignment is not in the types: UBSan's alignment check (cheap) stays on
# in every CUDA build, stopping at the first misaligned typed access
CUDA_FLAGS = ["-fsanitize=alignment", "-fno-sanitize-recover=all", f"-I{HERE / 'cuda_include'}"]
WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-unused-variable", "-Wno-unused-function",
            "-Werror=uninitialized", "-Werror=maybe-uninitialized", "-Werror=return-type", "-Werror=array-bounds"]


class CompileError(AssertionError):
    pass


@dataclass
class Program:
    exe: Path
    thunks: dict[str, int]  # generated source -> thunk index
    warnings: str = ""


def _cache_dir() -> Path:
    d = Path(tempfile.gettempdir()) / f"ds4_kernel_shim_{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def build(sources: list[tuple[str, str]], variant: str = "asan", dialect: str = "metal") -> Program:
    """One executable for generated sources [(header, full generated text)] sharing headers, one dialect."""
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r}")
    headers: list[str] = []
    units: list[str] = []
    thunks: dict[str, int] = {}
    macros: dict[str, dict[str, str]] = {}
    parts = [f'#include "{"cuda_shim.h" if dialect == "cuda" else "metal_shim.h"}"\n']
    for header, text in sources:
        if text in thunks:
            continue
        if not text.startswith(header):
            raise RuntimeError("generated source does not start with its header")
        ext = "cu" if dialect == "cuda" else "metal"
        if header not in headers:
            headers.append(header)
            macros[header] = {}
            parts.append(f'#line 1 "header{len(headers) - 1}.{ext}"\n{to_cpp(header, "h", dialect, macros[header])}\n')
        rest = text[len(header):]
        sig = parse_signature(rest, dialect)
        idx = len(units)
        parts.append(f'#line 1 "{sig.func}.{ext}"\n{to_cpp(rest, sig.func, dialect, dict(macros[header]))}\n')
        units.append(_thunk(idx, sig))
        thunks[text] = idx
    parts.append('#line 1 "shim_thunks.cpp"\n' + "".join(units))
    parts.append("namespace shim { Thunk shim_thunks[] = {" + ", ".join(f"shim_thunk_{i}" for i in range(len(units)))
                 + "}; }\n#include \"metal_shim_runtime.h\"\n")
    tu = "".join(parts)
    flags = ["-std=c++20", "-pthread", "-ffp-contract=off", *FLAGS[variant], *WARNINGS, f"-I{HERE}"]
    flags += CUDA_FLAGS if dialect == "cuda" else [f"-I{HERE / 'metal_include'}"]
    deps = "".join(f.read_text() for f in sorted(HERE.rglob("*")) if f.is_file() and f.suffix in ("", ".h", ".cuh"))
    digest = hashlib.sha256((tu + "\0".join(flags) + deps).encode()).hexdigest()[:24]
    cache = _cache_dir()
    exe = cache / f"k_{digest}"
    warn = cache / f"k_{digest}.warnings"
    if not exe.exists():
        src = cache / f"k_{digest}.cpp"
        src.write_text(tu)
        tmp_exe = cache / f"k_{digest}.{os.getpid()}.tmp"
        proc = subprocess.run(["g++", *flags, str(src), "-o", str(tmp_exe)], capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            raise CompileError(f"g++ rejected the kernel source ({src}):\n{_first_errors(proc.stderr)}")
        warn.write_text(proc.stderr)
        os.replace(tmp_exe, exe)
    return Program(exe, thunks, warn.read_text() if warn.exists() else "")


def _first_errors(stderr: str, n: int = 12) -> str:
    lines = [ln for ln in stderr.splitlines() if "error" in ln]
    return "\n".join(lines[:n]) or stderr[-3000:]


# --------------------------------------------------------------------------------------------------
# 4. run


@dataclass
class Options:
    variant: str = "asan"
    seed: int = 0
    poison: int = 0xFF  # NaN for float32/float16, all-ones for integers
    offsets: dict[str, int] = field(default_factory=dict)  # input name -> bytes the buffer starts past alignment
    workers: int = 2
    timeout: int = 120  # per launch, seconds: hangs fail instead of blocking the suite
    yield_tg: int = 2  # switch threads at 1 in N threadgroup-memory accesses
    yield_dev: int = 8  # ... and at 1 in N device stores


@dataclass
class Result:
    outputs: list[list[np.ndarray] | None]
    failure: str | None  # first SHIM-FAIL line, sanitizer report or compiler error
    failed_label: str | None = None
    warnings: str = ""


def _buffers(launch: Launch) -> list[tuple[str, np.ndarray | None, int, object]]:
    """(name, input array or None for outputs, nbytes, out dtype) in [[buffer(i)]] order."""
    src = launch.kernel.source
    bufs = []
    for name, a in zip(launch.kernel.input_names, launch.inputs):
        bufs.append((name, np.ascontiguousarray(a), a.nbytes, None))
        if a.ndim > 0:
            if f"{name}_shape" in src:
                bufs.append((name + "_shape", np.array(a.shape, dtype=np.int32), 4 * a.ndim, None))
            if f"{name}_strides" in src:
                st = np.array([s // a.itemsize for s in np.ascontiguousarray(a).strides], dtype=np.int64)
                bufs.append((name + "_strides", st, 8 * a.ndim, None))
            if f"{name}_ndim" in src:
                bufs.append((name + "_ndim", np.array(a.ndim, dtype=np.int32), 4, None))
    for name, shape, dtype in zip(launch.kernel.output_names, launch.output_shapes, launch.output_dtypes):
        npd = np.dtype(_MX_TO_NP[dtype])
        bufs.append((name, None, int(np.prod(shape, dtype=np.int64)) * npd.itemsize, (npd, shape)))
    return bufs


def run(launches: list[Launch], opts: Options | None = None) -> Result:
    """Run launches in one process; outputs per launch (None from the failing one on)."""
    opts = opts or Options()
    if gxx() is None:
        raise RuntimeError("g++ not found")
    dialects = {ln.dialect for ln in launches}
    if len(dialects) > 1:
        raise ValueError(f"one dialect per run, got {sorted(dialects)}")
    dialect = dialects.pop() if dialects else "metal"
    texts = [generated_source(ln) for ln in launches]
    try:
        prog = build([(header_of(ln), t) for ln, t in zip(launches, texts)], opts.variant, dialect)
    except CompileError as e:
        return Result([None] * len(launches), str(e))
    with tempfile.TemporaryDirectory(prefix="ds4_shim_run_") as tmp:
        tmp = Path(tmp)
        job = []
        outs = []
        for i, (ln, text) in enumerate(zip(launches, texts)):
            label = ln.label or f"{ln.kernel.name}#{i}"
            label = re.sub(r"\s+", "_", label)
            bufs = _buffers(ln)
            job.append(f"launch {label} {prog.thunks[text]} {' '.join(map(str, ln.grid))} "
                       f"{' '.join(map(str, ln.threadgroup))} {opts.seed + i} {opts.poison} {opts.workers} "
                       f"{opts.timeout} {opts.yield_tg} {opts.yield_dev} {dialect} {len(bufs)}")
            mine = []
            for j, (name, arr, nbytes, out) in enumerate(bufs):
                path = tmp / f"l{i}_b{j}.bin"
                if arr is not None:
                    arr.tofile(path)
                    kind = "in"
                elif ln.init_value is not None:
                    np.full(out[1], ln.init_value, dtype=out[0]).tofile(path)
                    kind = "init"
                else:
                    kind = "out"
                if out is not None:
                    mine.append((path, out))
                job.append(f"buf {kind} {int(opts.offsets.get(name, 0))} {nbytes} {path}")
            outs.append(mine)
        (tmp / "job").write_text("\n".join(job) + "\n")
        env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:detect_stack_use_after_return=0",
                   UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
        try:
            proc = subprocess.run([str(prog.exe), str(tmp / "job")], capture_output=True, text=True, env=env,
                                  timeout=opts.timeout * max(1, len(launches)) + 60)
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout, stderr, rc = (e.stdout or b"").decode(), "SHIM-FAIL timeout (whole batch)", 124
        done = set(re.findall(r"^SHIM-OK (\S+)$", stdout, re.M))
        results: list[list[np.ndarray] | None] = []
        failed = None
        for i, (ln, mine) in enumerate(zip(launches, outs)):
            label = re.sub(r"\s+", "_", ln.label or f"{ln.kernel.name}#{i}")
            if label in done:
                results.append([np.fromfile(p, dtype=d).reshape(s) for p, (d, s) in mine])
            else:
                results.append(None)
                failed = failed or label
        failure = None
        if rc != 0 or failed:
            failure = _summarise(stderr) or f"exit status {rc}"
        return Result(results, failure, failed if failure else None, prog.warnings)


def _summarise(stderr: str) -> str:
    for pat in (r"^SHIM-FAIL.*$", r"^.*runtime error:.*$", r"^SUMMARY: .*$", r"^==\d+==ERROR: .*$"):
        m = re.search(pat, stderr, re.M)
        if m:
            return m.group(0)
    return stderr[-2000:]
