"""The load-time plan: every variation axis of a load, resolved once from the machine and the options.

    plan = resolve(numerics="default", backend=None, experts="auto", distributed=None)
    plan.backend   # "cpu" | "metal" | "cuda": where the DEFAULT-numerics matmuls run
    plan.experts   # "device" | "host": the routed-expert strategy (``device_experts``)
    plan.kernels   # "metal" | "cuda" | None: the raw-block kernel dialect the routed experts use

The machine is read in exactly one place, ``detect_backend`` (MLX's default device and which GPU
backend MLX was built with), and only when an option is left to the machine (``backend=None`` or
``experts="auto"``); tests inject a fake one (``detect=``) to resolve the plan a CUDA or Metal box
would get. The loader resolves the plan first and passes its explicit values down, so the weights
below it (``DenseWeight``, ``ExpertWeights`` and its device variants) never detect for themselves.

Why each choice: on any GPU (Metal as CUDA) a Q8_0 dense weight is an MLX affine 8-bit group-32
matrix (``linear.q8_0_to_affine``: lossless, ~1.06x its GGUF bytes instead of float32's ~3.8x) and an
F16 one stays float16; the routed experts run the kernels of the GPU's dialect
(``metal_kernels``: one source, two dialects) rather than the MLX-ops twins. ``dense_form`` is that
decision for one weight, the one place it is made (``linear.DenseWeight`` holds the form it names).

The tunables the environment sets are read here too, once per plan, and passed down as values:
``DS4_MLX_EXPERT_CACHE_MB`` (the dequantized-expert LRU, ``experts.EXPERT_CACHE``, sized at load),
``DS4_MLX_EXPERT_GROUP_MB`` (the float32 experts a prefill chunk dequantizes at once),
``DS4_MLX_KV_LOCK_TIMEOUT`` (how long a KV cache writer waits for another process's lock; also read
by ``kv_lock_timeout`` for the ``ds4-mlx kv`` commands, which load no model) and
``DS4_MLX_DIST_TIMEOUT`` (how long a distributed load waits for the other ranks). A bad value is a
``LayoutError`` naming the variable and what it takes, at load rather than mid-run.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ds4_mlx import native as _native
from ds4_mlx.errors import LayoutError
from ds4_mlx.formats.ggml_types import GGMLType

BACKENDS = ("cpu", "metal", "cuda")
STRATEGIES = ("device", "host", "auto")
COMPILE_VAR = "DS4_MLX_COMPILE"
RESUME_PREFILL_MIN_VAR = "DS4_MLX_RESUME_PREFILL_MIN"
RESUME_PREFILL_MIN = 2  # measured crossover (``engine/session.py``): a chunk of 2 beats 2 steps
EXPERT_CACHE_VAR = "DS4_MLX_EXPERT_CACHE_MB"
EXPERT_GROUP_VAR = "DS4_MLX_EXPERT_GROUP_MB"
KV_LOCK_VAR = "DS4_MLX_KV_LOCK_TIMEOUT"
DIST_TIMEOUT_VAR = "DS4_MLX_DIST_TIMEOUT"
MIB = 1 << 20
EXPERT_CACHE_DEFAULT_MB = 1024  # the dequantized-expert LRU's default budget
EXPERT_GROUP_DEFAULT_MB = 512  # float32 experts alive at once in a prefill call
KV_LOCK_DEFAULT_S = 5.0  # a KV cache writer's wait for another process's directory lock
JOIN_DEFAULT_S = 120.0  # a distributed load's wait for the other ranks


def detect_backend() -> str:
    """The one place the machine is read: "metal" / "cuda" when MLX's default device is a GPU of
    that backend, else "cpu"."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def _switch(var: str, default: bool) -> bool:
    value = os.environ.get(var, "").strip().lower()
    if not value:
        return default
    return value not in ("0", "false", "no", "off")


def compile_switch() -> bool:
    """``DS4_MLX_COMPILE``: on unless 0 / false / no / off. The plan records it at load; the sessions
    of that load follow the plan (one opened after the variable changes does not)."""
    return _switch(COMPILE_VAR, True)


def resume_prefill_min() -> int:
    """``DS4_MLX_RESUME_PREFILL_MIN`` (ds4's ``DS4_METAL_RESUME_PREFILL_MIN``): the shortest suffix a
    session prefills as a chunk rather than decoding token by token; default 2."""
    value = os.environ.get(RESUME_PREFILL_MIN_VAR, "").strip()
    if not value:
        return RESUME_PREFILL_MIN
    try:
        n = int(value)
    except ValueError:
        raise LayoutError(f"{RESUME_PREFILL_MIN_VAR}={value!r} is not an integer") from None
    if n < 1:
        raise LayoutError(f"{RESUME_PREFILL_MIN_VAR}={value!r} must be >= 1")
    return n
def _env(var: str) -> str:
    """The variable's text, stripped ("" when unset)."""
    return os.environ.get(var, "").strip()


def _number(var: str, text: str, default: float, what: str, *, positive: bool = False) -> float:
    """``text``, variable ``var``'s value, as a finite number >= 0 (> 0 with ``positive``), else
    ``default`` when empty; anything else is a ``LayoutError`` naming the variable and what it takes."""
    if not text:
        return float(default)
    try:
        value = float(text)
    except ValueError:
        raise LayoutError(f"{var}={text!r} is not a number of {what}") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise LayoutError(f"{var}={text!r}: must be a finite number of {what} {bound}")
    return value


def launcher_rank() -> str:
    """The rank ``mlx.launch`` gave this process (``MLX_RANK``; "?" when none), for the messages a rank
    writes before it has joined its group and can ask it."""
    return _env("MLX_RANK") or "?"


def kv_lock_timeout() -> float:
    """``DS4_MLX_KV_LOCK_TIMEOUT`` (seconds, default 5): how long a KV cache writer waits for another
    process's lock on the directory. A load records it in its plan; the ``ds4-mlx kv`` commands,
    which load no model, read it here."""
    return _number(KV_LOCK_VAR, _env(KV_LOCK_VAR), KV_LOCK_DEFAULT_S, "seconds")


def join_seconds(timeout: float | None = None) -> float:
    """``timeout`` (``load(join_timeout=)``), else ``DS4_MLX_DIST_TIMEOUT``, else 120 s: how long a
    distributed load waits for the other ranks; a finite number > 0."""
    if timeout is None:
        return _number(DIST_TIMEOUT_VAR, _env(DIST_TIMEOUT_VAR), JOIN_DEFAULT_S, "seconds", positive=True)
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise LayoutError(f"join_timeout={timeout!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise LayoutError(f"join_timeout={timeout!r}: must be a finite number of seconds > 0")
    return value


def kernel_dialect(backend: str) -> str | None:
    """The raw-block kernel dialect of ``backend``: its own on a GPU ("metal" / "cuda"), None on the CPU
    (the MLX-ops twins)."""
    return backend if backend != "cpu" else None


def dense_form(backend: str, qtype: int, kernels: bool = False) -> str:
    """How a dense weight of GGML type ``qtype`` is held for DEFAULT numerics on ``backend``, the one
    place this is decided (``linear.DenseWeight`` builds and multiplies the form named):

    * "blocks": the raw Q8_0 rows through the Q8_0 kernel of the GPU's dialect (opt-in, ``kernels``);
    * "affine": a GPU's Q8_0, an MLX affine 8-bit group-32 matrix (``linear.q8_0_to_affine``, lossless);
    * "half": a GPU's F16, its float16 values (promoted exactly in the matmul);
    * "float32": everything on MLX's CPU (its one fast matmul is the float32 GEMM), and F32 anywhere.
    """
    if backend not in BACKENDS:
        raise LayoutError(f"unknown backend {backend!r}; expected one of {list(BACKENDS)}")
    qtype = GGMLType(qtype)
    if backend != "cpu" and qtype == GGMLType.Q8_0:
        return "blocks" if kernels else "affine"
    if backend != "cpu" and qtype == GGMLType.F16:
        return "half"
    return "float32"


@dataclass(frozen=True)
class LoadPlan:
    """One load's resolved variation axes (see the module docstring)."""

    numerics: str
    backend: str
    experts: str
    native: bool
    compile: bool
    distributed: str | None
    kernels: str | None
    resume_prefill_min: int = RESUME_PREFILL_MIN
    # the environment's tunables (module docstring), read once by ``resolve``
    expert_cache_bytes: int = EXPERT_CACHE_DEFAULT_MB * MIB
    expert_cache_explicit: bool = False  # set by DS4_MLX_EXPERT_CACHE_MB: kept, not scaled per rank
    expert_group_bytes: int = EXPERT_GROUP_DEFAULT_MB * MIB
    kv_lock_timeout: float = KV_LOCK_DEFAULT_S
    join_timeout: float | None = None  # seconds; None unless distributed

    @property
    def gpu(self) -> bool:
        return self.backend != "cpu"

    def device_text(self) -> str:
        """What the DEFAULT arithmetic runs on, for labels: "mlx cpu", "mlx gpu (metal)", "mlx gpu (cuda)"."""
        return {"cpu": "mlx cpu"}.get(self.backend, f"mlx gpu ({self.backend})")

    def dense_form(self, qtype: int) -> str:
        """``dense_form`` of a ``qtype`` weight on this plan's backend (no Q8_0 kernel: the loader's)."""
        return dense_form(self.backend, qtype)

    def dense_forms(self) -> str:
        """How the dense weights are held in DEFAULT numerics (``dense_form`` of Q8_0 and F16)."""
        if self.numerics != "default":
            return "dense ds4-cpu integer/float32 forms"
        named = {"affine": "Q8_0 affine-8 group 32", "half": "F16 float16"}
        forms = [named[f] for f in (self.dense_form(GGMLType.Q8_0), self.dense_form(GGMLType.F16)) if f in named]
        return "dense " + (", ".join(forms) or "float32")

    def describe(self) -> str:
        """One line, as ``inspect --plan`` and ``ds4-mlx --version`` print it."""
        onoff = lambda b: "on" if b else "off"  # noqa: E731
        dist_part = (f", distributed {self.distributed} (join within {self.join_timeout:g} s)"
                     if self.distributed else "")
        lru = f"{self.expert_cache_bytes / MIB:g} MiB" + ("" if self.expert_cache_explicit else " default")
        return (f"load plan: numerics {self.numerics}, backend {self.backend}, experts {self.experts}, "
                f"{self.dense_forms()}, kernels {self.kernels or 'none (MLX-ops twins)'}, "
                f"native {onoff(self.native)}, compile {onoff(self.compile)}, expert LRU {lru}"
                f"{dist_part}")


def resolve(numerics: str = "default", backend: str | None = None, experts: str = "auto",
            distributed: str | None = None, *, join_timeout: float | None = None,
            detect: Callable[[], str] | None = None) -> LoadPlan:
    """The plan for these options on this machine (``detect``, default ``detect_backend`` looked up at
    the call so a test can patch it, read at most once) and this environment (the module docstring's
    variables, each read once). Bad values are a ``LayoutError`` naming the value and the choices.
    ``join_timeout``: ``load``'s, else ``DS4_MLX_DIST_TIMEOUT``'s (only read for a distributed load)."""
    numerics = getattr(numerics, "value", numerics)
    if backend is not None:
        backend = getattr(backend, "value", backend)
        if backend not in BACKENDS:
            raise LayoutError(f"unknown backend {backend!r}; expected one of {list(BACKENDS)}")
    if not isinstance(experts, str) or experts not in STRATEGIES:
        raise LayoutError(f"unknown expert strategy {experts!r}; expected one of {list(STRATEGIES)}")
    machine = (detect or detect_backend)() if backend is None or experts == "auto" else None
    if backend is None:
        backend = machine
    if experts == "auto":
        # the device strategy where the arithmetic runs on a GPU; on MLX's CPU it doubles the
        # expert memory and re-dequantizes the selected experts every step (``device_experts``)
        experts = "device" if machine != "cpu" else "host"
    kernels = kernel_dialect(backend)
    native_on = backend == "cpu" and _native._setting() == "auto"  # its host products serve MLX's CPU
    cache_text = _env(EXPERT_CACHE_VAR)
    cache_mb = _number(EXPERT_CACHE_VAR, cache_text, EXPERT_CACHE_DEFAULT_MB, "MiB")
    group_mb = _number(EXPERT_GROUP_VAR, _env(EXPERT_GROUP_VAR), EXPERT_GROUP_DEFAULT_MB, "MiB", positive=True)
    return LoadPlan(numerics=str(numerics), backend=backend, experts=experts, native=native_on,
                    compile=compile_switch(), distributed=distributed, kernels=kernels,
                    resume_prefill_min=resume_prefill_min(),
                    expert_cache_bytes=int(cache_mb * MIB),
                    expert_cache_explicit=bool(cache_text),
                    expert_group_bytes=max(1, int(group_mb * MIB)), kv_lock_timeout=kv_lock_timeout(),
                    join_timeout=join_seconds(join_timeout) if distributed else None)
