"""Which BLAS MLX's CPU backend calls, and making it a fast one on Linux.

The ``mlx[cpu]`` wheel for Linux links ``libmlx.so`` against a reference (netlib) BLAS that it
bundles in ``mlx_cpu.libs``; its f32 GEMM is one to two orders of magnitude slower than OpenBLAS.
``libmlx.so`` leaves ``cblas_sgemm`` and the LAPACK entry points undefined, and the dynamic
linker resolves them through the process's global scope before the library's own dependencies.
So an OpenBLAS that exports the standard (unprefixed) names, opened with ``RTLD_GLOBAL`` before
``mlx.core`` is imported, is the one every MLX matmul and ``mlx.core.linalg`` call binds to.
``ds4_mlx/__init__.py`` runs :func:`preload` for that reason, before anything imports MLX.

Python extensions are opened with ``RTLD_NOW``, so once ``mlx.core`` is loaded its bindings are
final: if MLX was imported before ds4_mlx nothing can be changed in-process, and :func:`preload`
only warns (``LD_PRELOAD`` or importing ds4_mlx first are the fixes).

``DS4_MLX_BLAS`` selects the behaviour: ``auto`` (default: find an OpenBLAS), ``off`` (leave
MLX's bundled BLAS), or a path to a BLAS library with unprefixed CBLAS symbols. OpenBLAS reads
its own thread settings (``OPENBLAS_NUM_THREADS``, ``OPENBLAS_CORETYPE``); nothing here changes
them. macOS needs nothing: MLX uses Accelerate there.

This module imports only the standard library: it must run before MLX or NumPy are imported.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import sys
import warnings
from dataclasses import dataclass
from typing import Literal

ENV_VAR = "DS4_MLX_BLAS"
APT_PACKAGE = "libopenblas0-pthread"

# Names tried through the dynamic linker's normal search, most common first: Debian/Ubuntu and
# Arch use libopenblas.so.0 (on Debian an alternatives link to the pthread/openmp/serial build);
# Fedora names its threaded variants libopenblasp / libopenblaso.
SONAMES: tuple[str, ...] = ("libopenblas.so.0", "libopenblasp.so.0", "libopenblaso.so.0", "libopenblas.so")

_PROBE_SYMBOL = "cblas_sgemm"

BlasKind = Literal["openblas", "netlib", "blis", "mkl", "accelerate", "other", "unknown"]


class BlasWarning(RuntimeWarning):
    """MLX will run on (or already runs on) its slow reference BLAS, or DS4_MLX_BLAS is unusable."""


@dataclass(frozen=True)
class Setting:
    """The parsed value of ``DS4_MLX_BLAS``."""

    mode: Literal["auto", "off", "path"]
    path: str | None = None

    def __str__(self) -> str:
        return self.path if self.mode == "path" and self.path is not None else self.mode


def parse_setting(value: str | None) -> Setting:
    """Interpret a ``DS4_MLX_BLAS`` value; unset or empty means ``auto``; anything else is a path."""
    text = (value or "").strip()
    if text == "" or text.lower() == "auto":
        return Setting("auto")
    if text.lower() == "off":
        return Setting("off")
    return Setting("path", os.path.expanduser(text))


# --- dynamic-linker helpers -------------------------------------------------------------------


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _libdl() -> ctypes.CDLL:
    # glibc >= 2.34 and musl have dladdr in libc; older glibc keeps it in libdl.so.2.
    for name in (None, "libdl.so.2"):
        try:
            lib = ctypes.CDLL(name)
            lib.dladdr  # noqa: B018 - probe for the symbol
        except (OSError, AttributeError):
            continue
        lib.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        lib.dladdr.restype = ctypes.c_int
        return lib
    raise OSError("dladdr is not available")


def _file_of_address(address: int) -> str | None:
    """The path of the loaded object that contains ``address`` (``dladdr``), or None."""
    info = _DlInfo()
    try:
        found = _libdl().dladdr(ctypes.c_void_p(address), ctypes.byref(info))
    except OSError:
        return None
    if not found or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def global_provider(symbol: str = _PROBE_SYMBOL) -> str | None:
    """Path of the library that defines ``symbol`` in the global scope (LD_PRELOAD, RTLD_GLOBAL)."""
    try:
        fn = getattr(ctypes.CDLL(None), symbol)
    except (OSError, AttributeError):
        return None
    address = ctypes.cast(fn, ctypes.c_void_p).value
    return _file_of_address(address) if address else None


def _mapped_object(basename_prefix: str) -> tuple[str, list[tuple[int, int]]] | None:
    """(path, its mapped address ranges) of the first loaded file whose name has the prefix."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            lines = fh.readlines()
    except OSError:
        return None
    found: str | None = None
    ranges: list[tuple[int, int]] = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if found is None and os.path.basename(path).startswith(basename_prefix):
            found = path
        if path == found:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return (found, ranges) if found is not None else None


# --- ELF: where libmlx.so keeps the resolved address of a symbol ------------------------------

_SHT_RELA = 4
_PT_LOAD = 1


def got_slots(path: str, symbol: str) -> tuple[list[int], int]:
    """Relocation targets (link-time addresses) that receive ``symbol``'s address, and the lowest
    PT_LOAD address, read from a 64-bit little-endian ELF shared object's RELA sections.

    Raises ValueError for a file that is not such an ELF object.
    """
    try:
        return _got_slots(path, symbol)
    except (struct.error, IndexError) as exc:
        raise ValueError(f"{path}: truncated or malformed ELF ({exc})") from exc


def _got_slots(path: str, symbol: str) -> tuple[list[int], int]:
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as elf:
        if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
            raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
        e_phoff, e_shoff = struct.unpack_from("<QQ", elf, 0x20)
        e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", elf, 0x36)
        loads = []
        for i in range(e_phnum):
            p_type, _flags, _off, p_vaddr = struct.unpack_from("<IIQQ", elf, e_phoff + i * e_phentsize)
            if p_type == _PT_LOAD:
                loads.append(p_vaddr)
        if not loads:
            raise ValueError(f"{path}: no PT_LOAD segment")
        sections = []
        for i in range(e_shnum):
            sh = struct.unpack_from("<IIQQQQIIQQ", elf, e_shoff + i * e_shentsize)
            sections.append(sh)  # name, type, flags, addr, offset, size, link, info, align, entsize
        slots: list[int] = []
        for _name, sh_type, _fl, _addr, offset, size, link, _info, _al, entsize in sections:
            if sh_type != _SHT_RELA or entsize != 24 or link >= len(sections):
                continue
            symtab = sections[link]
            strtab = sections[symtab[6]]
            for r_offset, r_info, _addend in struct.iter_unpack("<QQq", elf[offset : offset + size]):
                index = r_info >> 32
                if index == 0:
                    continue
                st_name = struct.unpack_from("<I", elf, symtab[4] + index * symtab[9])[0]
                start = strtab[4] + st_name
                end = elf.find(b"\0", start)
                if elf[start:end] == symbol.encode():
                    slots.append(r_offset)
        return slots, min(loads) & ~(mmap.PAGESIZE - 1)


def bound_provider(symbol: str = _PROBE_SYMBOL) -> str | None:
    """Path of the library whose ``symbol`` the loaded ``libmlx.so`` actually calls.

    Reads the address the dynamic linker stored in libmlx.so's relocation slot and asks the linker
    which object contains it. None when libmlx.so is not loaded or the slot is not yet resolved.
    """
    mapped = _mapped_object("libmlx.so")
    if mapped is None:
        return None
    path, ranges = mapped
    try:
        slots, first_vaddr = got_slots(path, symbol)
    except (OSError, ValueError):
        return None
    bias = min(lo for lo, _ in ranges) - first_vaddr
    for slot in slots:
        where = bias + slot
        # Read only inside libmlx.so's own mappings (guards against a file replaced on disk).
        if not any(lo <= where and where + 8 <= hi for lo, hi in ranges):
            continue
        target = ctypes.c_uint64.from_address(where).value
        owner = _file_of_address(target) if target else None
        # A lazy, unresolved PLT slot points back into libmlx.so itself.
        if owner is not None and os.path.basename(owner) != os.path.basename(path):
            return owner
    return None


# --- which library is which -------------------------------------------------------------------


def _open_existing(path: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
    except OSError:
        return None


def classify(path: str | None) -> BlasKind:
    """Name the BLAS implementation in ``path`` (a library that is already loaded)."""
    if path is None:
        return "unknown"
    lib = _open_existing(path)

    def exports(symbol: str) -> bool:  # dlsym on a handle also searches the library's dependencies
        return lib is not None and hasattr(lib, symbol)

    base = os.path.basename(path).lower()
    if exports("openblas_get_config") or "openblas" in base:
        return "openblas"
    if exports("bli_info_get_version_str") or "blis" in base:
        return "blis"
    if exports("mkl_get_version") or "mkl" in base:
        return "mkl"
    if base.startswith(("libblas", "librefblas")) or os.path.basename(os.path.dirname(path)) == "mlx_cpu.libs":
        return "netlib"
    return "other"


def _openblas_info(path: str | None) -> tuple[str | None, int | None]:
    lib = _open_existing(path) if path else None
    if lib is None:
        return None, None
    config = threads = None
    if hasattr(lib, "openblas_get_config"):
        lib.openblas_get_config.restype = ctypes.c_char_p
        raw = lib.openblas_get_config()
        config = raw.decode(errors="replace").strip() if raw else None
    if hasattr(lib, "openblas_get_num_threads"):
        lib.openblas_get_num_threads.restype = ctypes.c_int
        threads = int(lib.openblas_get_num_threads())
    return config, threads


def candidate_paths() -> list[str]:
    """Where ``auto`` looks for OpenBLAS: the linker-search names, then a conda-style prefix's lib/.

    PyPI wheels with unprefixed OpenBLAS exist (cmeel-openblas, ngsolve-openblas) but neither
    bundles libgfortran, and cmeel's is built for AVX-512 only, so none is searched for here;
    ``DS4_MLX_BLAS=<path>`` can still point at one.
    """
    found: list[str] = list(SONAMES)
    path = os.path.join(sys.prefix, "lib", "libopenblas.so.0")
    if os.path.exists(path):
        found.append(path)
    return found


def check_library(path: str) -> tuple[ctypes.CDLL | None, str | None]:
    """Open ``path`` privately and say whether MLX could use it: (library, None) or (None, reason)."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
    except OSError as exc:
        return None, f"cannot be opened ({exc})"
    if not hasattr(lib, _PROBE_SYMBOL):
        return None, f"does not export an unprefixed {_PROBE_SYMBOL} (a symbol-prefixed build such as scipy-openblas?)"
    if hasattr(lib, "openblas_get_config"):
        lib.openblas_get_config.restype = ctypes.c_char_p
        config = (lib.openblas_get_config() or b"").decode(errors="replace")
        # MLX passes 32-bit ints; a 64-bit-integer OpenBLAS would read garbage dimensions.
        if "USE64BITINT" in config:
            return None, "is a 64-bit-integer (ILP64) build; MLX needs LP64"
    return lib, None


def select(setting: Setting, candidates: list[str]) -> tuple[str | None, list[str]]:
    """Pick the library to preload: (its resolved file path or None, one line per rejected one)."""
    if setting.mode == "off":
        return None, []
    tried = [setting.path] if setting.mode == "path" and setting.path else candidates
    rejected: list[str] = []
    for path in tried:
        lib, reason = check_library(path)
        if lib is not None:
            # A bare soname was found by the linker's search; report the file it actually opened.
            address = ctypes.cast(getattr(lib, _PROBE_SYMBOL), ctypes.c_void_p).value
            found = _file_of_address(address) if address else None
            return os.path.realpath(found or path), rejected
        rejected.append(f"{path}: {reason}")
    return None, rejected


# --- the hook and its report ------------------------------------------------------------------


@dataclass
class _State:
    how: str = "not-run"
    setting: str = "auto"
    loaded: str | None = None
    detail: str | None = None
    handle: ctypes.CDLL | None = None  # keeps the preloaded library open for the process's life


_STATE = _State()
_warned = False


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(message, BlasWarning, stacklevel=3)


def _mlx_loaded() -> bool:
    return "mlx.core" in sys.modules or _mapped_object("libmlx.so") is not None


def preload() -> None:
    """Make MLX bind to OpenBLAS on Linux (idempotent; see the module docstring)."""
    if _STATE.how != "not-run":
        return
    setting = parse_setting(os.environ.get(ENV_VAR))
    _STATE.setting = str(setting)
    if not sys.platform.startswith("linux"):
        _STATE.how = "platform"
        return
    if setting.mode == "off":
        _STATE.how = "disabled"
        return
    existing = global_provider()
    if existing is not None:
        _STATE.how, _STATE.loaded = "preexisting", existing
        return
    if _mlx_loaded():
        _STATE.how = "mlx-imported-first"
        provider = bound_provider()
        if classify(provider) != "openblas":
            path, _ = select(setting, candidate_paths())
            fix = f"LD_PRELOAD={path} " if path else f"install {APT_PACKAGE} and "
            _warn_once(
                "mlx was imported before ds4_mlx, so MLX is bound to "
                f"{os.path.realpath(provider) if provider else 'its bundled BLAS'} (a slow reference BLAS). "
                f"Import ds4_mlx before mlx, or run with {fix.strip()} set. "
                f"Set {ENV_VAR}=off to silence this."
            )
        return
    path, rejected = select(setting, candidate_paths())
    if path is None:
        _STATE.how = "load-failed" if setting.mode == "path" else "not-found"
        _STATE.detail = "; ".join(rejected) or None
        if setting.mode == "path":
            _warn_once(f"{ENV_VAR}={setting.path} is not usable: {_STATE.detail}. MLX keeps its slow reference BLAS.")
        else:
            _warn_once(
                "No OpenBLAS found: MLX's float32 CPU matmuls will use its bundled reference BLAS, 10-30x "
                f"slower. Install it (Debian/Ubuntu: apt-get install {APT_PACKAGE}; Fedora: "
                f"openblas-threads; Arch: openblas) or set {ENV_VAR}=/path/to/libopenblas.so.0; "
                f"{ENV_VAR}=off silences this."
            )
        return
    try:
        # Re-opening an already-open library with RTLD_GLOBAL promotes it into the global scope.
        _STATE.handle = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    except OSError as exc:
        _STATE.how, _STATE.detail = "load-failed", str(exc)
        _warn_once(f"Could not load {path} globally ({exc}); MLX keeps its slow reference BLAS.")
        return
    _STATE.how = "preloaded" if setting.mode == "auto" else "env-path"
    _STATE.loaded = global_provider() or path


def status() -> dict[str, object]:
    """Which BLAS MLX's CPU backend uses, and why. Imports mlx.core (after :func:`preload`).

    Keys: ``blas`` (openblas | netlib | blis | mkl | accelerate | other | unknown), ``how``
    (preloaded | env-path | preexisting | disabled | not-found | load-failed | mlx-imported-first
    | platform | not-run), ``path`` (library whose cblas_sgemm libmlx.so calls), ``setting``
    (DS4_MLX_BLAS as parsed), ``threads`` and ``config`` (OpenBLAS only), ``detail``.
    """
    if _STATE.how == "platform":
        kind: BlasKind = "accelerate" if sys.platform == "darwin" else "unknown"
        return {"blas": kind, "how": "platform", "path": None, "setting": _STATE.setting,
                "threads": None, "config": None, "detail": None}
    import mlx.core  # noqa: F401 - binds libmlx.so's BLAS symbols so they can be read back

    path = bound_provider()
    path = os.path.realpath(path) if path else None
    config, threads = _openblas_info(path)
    return {
        "blas": classify(path),
        "how": _STATE.how,
        "path": path,
        "setting": _STATE.setting,
        "threads": threads,
        "config": config,
        "detail": _STATE.detail,
    }


def describe(info: dict[str, object] | None = None) -> str:
    """One line for ``inspect``/benchmarks, e.g. ``BLAS: openblas (preloaded, 2 threads) /usr/...``."""
    info = status() if info is None else info
    extra = [str(info["how"])]
    if info.get("threads"):
        extra.append(f"{info['threads']} threads")
    where = f" {info['path']}" if info.get("path") else ""
    return f"BLAS: {info['blas']} ({', '.join(extra)}){where}"

