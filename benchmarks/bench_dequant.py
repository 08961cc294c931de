"""Dequantization throughput: numpy vs MLX (CPU), per format and for one routed expert of DS4 Flash.

    python benchmarks/bench_dequant.py [--reps 7] [--rows 2048] [--cols 4096] [--mallopt]

Prints, per case, the best of ``--reps`` timings as GB/s of quantized input and Melem/s of float32 output.

``--mallopt`` raises glibc's mmap threshold first. MLX's CPU allocator does not cache buffers, so every
output of 32 MiB or more (one dequantized expert matrix is exactly 32 MiB) is a fresh mmap whose pages are
faulted in on first touch; on small VMs that fault cost dominates. Compare a run with and without it.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from typing import Callable

import ds4_mlx  # noqa: F401  (must precede mlx: binds MLX to a fast BLAS)

import mlx.core as mx
import numpy as np

from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType
from ds4_mlx.quants import (
    dequantize_rows,
    dequantize_rows_mlx,
    quantize_q8_0_activation,
    quantize_q8_0_activation_mlx,
    quantize_q8_k_activation,
    quantize_q8_k_activation_mlx,
)

# byte offsets of f16 scales, made finite so timings are not about NaN handling
_SCALE_OFFSETS = {"Q8_0": (0,), "Q2_K": (80, 82), "Q4_K": (0, 2), "IQ2_XXS": (0,)}


def raise_mmap_threshold() -> bool:
    """Keep large allocations on glibc's heap (mallopt M_MMAP_THRESHOLD / M_TRIM_THRESHOLD)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = libc.mallopt(-3, 1 << 30) == 1  # M_MMAP_THRESHOLD
    ok &= libc.mallopt(-1, (1 << 31) - 1) == 1  # M_TRIM_THRESHOLD
    return bool(ok)


def random_rows(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    elems, block_bytes = BLOCK_GEOMETRY[GGMLType[name]]
    raw = rng.integers(0, 256, size=(rows, cols // elems, block_bytes), dtype=np.uint8)
    for off in _SCALE_OFFSETS.get(name, ()):
        scale = rng.uniform(2.0**-10, 2.0**-6, size=raw.shape[:2]).astype(np.float16).view(np.uint16)
        raw[..., off] = scale & 0xFF
        raw[..., off + 1] = scale >> 8
    if name == "F16":
        raw = rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def best_time(fn: Callable[[], object], reps: int) -> float:
    def run() -> None:
        out = fn()
        if isinstance(out, mx.array):
            mx.eval(out)
        elif isinstance(out, tuple):
            mx.eval(*[o for o in out if isinstance(o, mx.array)])

    run()  # warm-up: traces and compiles the MLX kernels
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def report(label: str, in_bytes: int, n_elems: int, t_np: float, t_mx: float) -> None:
    def fmt(t: float) -> str:
        return f"{t * 1e3:8.2f} ms {in_bytes / t / 1e9:6.2f} GB/s {n_elems / t / 1e6:7.0f} Melem/s"

    print(f"{label:<34s} numpy {fmt(t_np)} | mlx {fmt(t_mx)} | mlx/numpy x{t_np / t_mx:4.1f}")


def bench_format(
    name: str, rows: int, cols: int, reps: int, rng: np.random.Generator, label: str = ""
) -> tuple[float, float]:
    raw = random_rows(name, rows, cols, rng)
    raw_mx = mx.array(raw)
    t_np = best_time(lambda: dequantize_rows(raw, name), reps)
    t_mx = best_time(lambda: dequantize_rows_mlx(raw_mx, name), reps)
    report(label or f"{name} {rows}x{cols}", raw.nbytes, rows * cols, t_np, t_mx)
    return t_np, t_mx


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--mallopt", action="store_true", help="raise glibc's mmap threshold before running")
    args = ap.parse_args(argv)

    if args.mallopt:
        print(f"mallopt: {'applied' if raise_mmap_threshold() else 'unavailable'}")
    print(f"mlx {mx.__version__}, device {mx.default_device()}, numpy {np.__version__}; best of {args.reps}")
    rng = np.random.default_rng(0)

    print("\n== formats ==")
    for name in ("F16", "BF16", "Q8_0", "Q2_K", "Q4_K", "IQ2_XXS", "MXFP4"):
        bench_format(name, args.rows, args.cols, args.reps, rng)

    print("\n== one routed expert (q2 model: gate/up IQ2_XXS 2048x4096, down Q2_K 4096x2048) ==")
    total_np = total_mx = 0.0
    for label, name, rows, cols in (
        ("expert gate IQ2_XXS 2048x4096", "IQ2_XXS", 2048, 4096),
        ("expert up   IQ2_XXS 2048x4096", "IQ2_XXS", 2048, 4096),
        ("expert down Q2_K    4096x2048", "Q2_K", 4096, 2048),
    ):
        t_np, t_mx = bench_format(name, rows, cols, args.reps, rng, label)
        total_np += t_np
        total_mx += t_mx
    print(f"{'whole expert (q2)':<34s} numpy {total_np * 1e3:8.2f} ms | mlx {total_mx * 1e3:8.2f} ms")

    print("\n== one routed expert (q4 model: all Q4_K) ==")
    total_np = total_mx = 0.0
    for label, rows, cols in (
        ("expert gate/up Q4_K 2048x4096", 2048, 4096),
        ("expert down Q4_K 4096x2048", 4096, 2048),
    ):
        t_np, t_mx = bench_format("Q4_K", rows, cols, args.reps, rng, label)
        mult = 2 if "gate" in label else 1
        total_np += mult * t_np
        total_mx += mult * t_mx
    print(f"{'whole expert (q4)':<34s} numpy {total_np * 1e3:8.2f} ms | mlx {total_mx * 1e3:8.2f} ms")

    print("\n== 64 gathered expert rows (CPU path dequantizes only selected rows) ==")
    bench_format("IQ2_XXS", 64, 4096, args.reps, rng, "64 rows IQ2_XXS x4096")
    bench_format("Q2_K", 64, 2048, args.reps, rng, "64 rows Q2_K x2048")

    print("\n== activation quantizers (decode: one token; prefill: 64 tokens), 4096 wide ==")
    for tokens in (1, 64):
        x = rng.standard_normal((tokens, 4096)).astype(np.float32)
        x_mx = mx.array(x)
        for label, fn_np, fn_mx in (
            ("Q8_0", quantize_q8_0_activation, quantize_q8_0_activation_mlx),
            ("Q8_K", quantize_q8_k_activation, quantize_q8_k_activation_mlx),
        ):
            t_np = best_time(lambda: fn_np(x), args.reps)
            t_mx = best_time(lambda: fn_mx(x_mx), args.reps)
            report(f"{label} activation {tokens}x4096", x.nbytes, x.size, t_np, t_mx)


if __name__ == "__main__":
    main()
