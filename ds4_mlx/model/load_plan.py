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
(``metal_kernels``: one source, two dialects) rather than the MLX-ops twins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ds4_mlx import native as _native
from ds4_mlx.errors import LayoutError

BACKENDS = ("cpu", "metal", "cuda")
STRATEGIES = ("device", "host", "auto")
COMPILE_VAR = "DS4_MLX_COMPILE"
RESUME_PREFILL_MIN_VAR = "DS4_MLX_RESUME_PREFILL_MIN"
RESUME_PREFILL_MIN = 2  # measured crossover (``engine/session.py``): a chunk of 2 beats 2 steps


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

    @property
    def gpu(self) -> bool:
        return self.backend != "cpu"

    def dense_forms(self) -> str:
        """How the dense weights are held in DEFAULT numerics."""
        if self.numerics != "default":
            return "dense ds4-cpu integer/float32 forms"
        if self.gpu:
            return "dense Q8_0 affine-8 group 32, F16 float16"
        return "dense float32"

    def describe(self) -> str:
        """One line, as ``inspect --plan`` and ``ds4-mlx --version`` print it."""
        onoff = lambda b: "on" if b else "off"  # noqa: E731
        dist_part = f", distributed {self.distributed}" if self.distributed else ""
        return (f"load plan: numerics {self.numerics}, backend {self.backend}, experts {self.experts}, "
                f"{self.dense_forms()}, kernels {self.kernels or 'none (MLX-ops twins)'}, "
                f"native {onoff(self.native)}, compile {onoff(self.compile)}{dist_part}")


def resolve(numerics: str = "default", backend: str | None = None, experts: str = "auto",
            distributed: str | None = None, *, detect: Callable[[], str] | None = None) -> LoadPlan:
    """The plan for these options on this machine (``detect``, default ``detect_backend`` looked up at
    the call so a test can patch it, read at most once). Bad values are a
    ``LayoutError`` naming the value and the choices."""
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
    kernels = backend if backend != "cpu" else None
    native_on = backend == "cpu" and _native._setting() == "auto"  # its host products serve MLX's CPU
    return LoadPlan(numerics=str(numerics), backend=backend, experts=experts, native=native_on,
                    compile=compile_switch(), distributed=distributed, kernels=kernels,
                    resume_prefill_min=resume_prefill_min())
