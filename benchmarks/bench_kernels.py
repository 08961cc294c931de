"""The raw-block GPU kernels: an op-count model per weight, then (on a GPU) bytes, time, GB/s, % of roofline.

    python benchmarks/bench_kernels.py                 # model + whatever the machine can run
    python benchmarks/bench_kernels.py --model-only    # just the op-count model
    python benchmarks/bench_kernels.py --peak-gbs 4800 # override the device's bandwidth

1. The op-count model (always printed) writes down, per weight and per format, what the old design
   (one row per SIMD group, per-element scale, byte loads, grid in constant memory, gate and up apart,
   scalar prefill) and the new one (NR rows per SIMD group with x in registers, scale once per chunk,
   2-byte loads, tables in threadgroup memory, fused gate+up, dequantized tiles + 8x8 MMA) cost, so a
   change's expected effect is on record before it is measured.
2. On a Metal or CUDA GPU: every kernel at the real DS4 Flash expert shapes (gate/up 2048 x 4096,
   down 4096 x 2048, 6 experts for a decoded token; a 64-token prefill over 256 experts), compared with
   its MLX-ops twin, then timed: bytes moved (weights of the distinct experts + activations + outputs),
   ms per call, achieved GB/s and the share of the device's memory bandwidth.
3. On the CPU (no custom kernels can run): the strict host shim's correctness run of both dialects
   (tests/test_kernel_shim.py -k slice, every kernel against its twin), reported as pass/fail.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np

from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType
from ds4_mlx.formats.quants import dequantize_rows
from ds4_mlx.model import metal_kernels as mk

from bench_util import random_blocks, timed

FORMATS = (GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q4_K)
# memory bandwidth (GB/s) by device-name fragment, for the roofline share
PEAK_GBS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "RTX 4090": 1008, "M1 Ultra": 800,
            "M2 Ultra": 800, "M1 Max": 400, "M2 Max": 400, "M3 Max": 400, "M4 Max": 546, "M1 Pro": 200,
            "M2 Pro": 200, "M3 Pro": 150, "M4 Pro": 273, "M1": 68, "M2": 100, "M3": 100, "M4": 120}


# --------------------------------------------------------------------------------------------------
# op-count model


def op_model(nr: int = mk.MATVEC_ROWS, tp: int = mk.GATHER_TILE) -> list[tuple]:
    """Rows (kernel, format, design, weight B, x B, load instr, FMA, dequant ops), all per weight.

    "x B" counts activation bytes a SIMD group pulls from memory/L1 per weight; "load instr" counts load
    instructions issued per weight (weights + activations + tables); dequant ops are ALU operations spent
    turning codes into values (converts, shifts, masks, sign selects, scale multiplies). Decode FMAs:
    one per weight; prefill per weight *and pair*.
    """
    rows = []
    for qt in (*FORMATS, GGMLType.Q8_0):
        elems, block = BLOCK_GEOMETRY[qt]
        wb = block / elems
        # old matvec: byte loads of codes, per-element scale multiply, x re-read for every row
        old_code_loads = {GGMLType.IQ2_XXS: 4 / 32 + 8 / 32 + 2 / 32, GGMLType.Q2_K: 1.0 + 2 / 32,
                          GGMLType.Q4_K: 1.0 + 4 / 32, GGMLType.Q8_0: 1.0 + 2 / 32}[qt]
        old_deq = {GGMLType.IQ2_XXS: 3.0, GGMLType.Q2_K: 5.0, GGMLType.Q4_K: 5.0, GGMLType.Q8_0: 3.0}[qt]
        new_code_loads = {GGMLType.IQ2_XXS: 5 / 32 + 8 / 32, GGMLType.Q2_K: 0.5 + 1 / 32,
                          GGMLType.Q4_K: 0.5 + 4 / 32, GGMLType.Q8_0: 0.5 + 1 / 32}[qt]
        new_deq = {GGMLType.IQ2_XXS: 2.0 + 4 / 32, GGMLType.Q2_K: 3.0 + 6 / 32, GGMLType.Q4_K: 3.0 + 4 / 32,
                   GGMLType.Q8_0: 3.0 + 1 / 32}[qt]
        rows.append(("matvec", qt.name, "old", wb, 4.0, old_code_loads + 1.0, 1.0, old_deq))
        rows.append(("matvec", qt.name, f"new NR={nr}", wb, 4.0 / nr, new_code_loads + 1.0 / nr, 1.0 + 1 / 32,
                     new_deq))
        if qt != GGMLType.Q8_0:
            # gate + up: the old design runs two matvecs (x read twice per row pair) and a SwiGLU pass
            rows.append(("gate+up", qt.name, "old (2 calls)", wb, 4.0, old_code_loads + 1.0, 1.0, old_deq))
            rows.append(("gate+up", qt.name, f"new fused NR={nr}", wb, 2.0 / nr, new_code_loads + 0.5 / nr,
                         1.0 + 1 / 32, new_deq))
        # prefill: old = per weight one dequant per tile of 8, per pair one scattered x load + FMA;
        # new = dequant once per tile of tp into threadgroup memory, 8x8 MMA (2 tile loads per 8 FMAs)
        rows.append(("gather_mm", qt.name, "old TP=8", wb / 8, 4.0, (old_code_loads / 8 + 1.0), 1.0, old_deq / 8))
        rows.append(("gather_mm", qt.name, f"new TP={tp}", wb / tp, 4.0 / 32, new_code_loads / tp + 2 / 8, 1.0,
                     (new_deq + 1.0) / tp))
    return rows


def print_op_model() -> None:
    print("op-count model, per weight (prefill rows: per weight and pair)")
    print(f"  {'kernel':<10} {'format':<8} {'design':<18} {'weight B':>9} {'x B':>7} {'loads':>7} {'FMA':>6} "
          f"{'dequant':>8}")
    for kernel, fmt, design, wb, xb, loads, fma, deq in op_model():
        print(f"  {kernel:<10} {fmt:<8} {design:<18} {wb:9.3f} {xb:7.3f} {loads:7.3f} {fma:6.3f} {deq:8.3f}")
    by = {(r[0], r[1], r[2].split()[0]): r for r in op_model()}
    old, new = by[("matvec", "IQ2_XXS", "old")], by[("matvec", "IQ2_XXS", "new")]
    print(f"  expected (IQ2_XXS decode): x traffic {old[4] / old[3]:.0f}x the weight bytes -> {new[4] / new[3]:.0f}x "
          f"(and from L1: one chunk serves NR rows); issue slots per weight {sum(old[5:]):.2f} -> {sum(new[5:]):.2f}, "
          "so the kernel should move from issue-bound toward weight-bandwidth-bound.")


# --------------------------------------------------------------------------------------------------
# GPU runs


def device_peak(dialect: str, override: float | None) -> tuple[str, float | None]:
    if dialect == "metal":
        name = str(mx.metal.device_info().get("device_name", "Apple GPU"))
    else:
        try:
            name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                  text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            name = "NVIDIA GPU"
    if override:
        return name, override
    for frag, gbs in sorted(PEAK_GBS.items(), key=lambda kv: -len(kv[0])):
        if frag in name:
            return name, float(gbs)
    return name, None


def max_rel_error(got: np.ndarray, twin: np.ndarray, scale: np.ndarray) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - twin) / (scale + 1e-30)))


def run_gpu(dialect: str, peak_override: float | None, quick: bool) -> bool:
    name, peak = device_peak(dialect, peak_override)
    print(f"\n{dialect} on {name}: peak {peak or '?'} GB/s" + ("" if peak else " (pass --peak-gbs)"))
    rng = np.random.default_rng(0)
    ok = True
    k = 6  # experts per token
    shapes = [("gate/up", 2048, 4096), ("down", 4096, 2048)]
    cases = [("decode", 1)] + ([] if quick else [("prefill", 64)])
    print(f"  {'kernel':<18} {'fmt':<8} {'shape':<10} {'case':<8} {'MB':>8} {'ms':>8} {'GB/s':>8} {'%peak':>6} "
          f"{'rel err':>9}")
    for qt in FORMATS:
        for label, out_dim, n_in in shapes:
            for case, tokens in cases:
                u = k if tokens == 1 else 16  # prefill: 64 tokens x 6 over 16 experts (24 pairs each)
                slabs_np = random_blocks(rng, qt, (u, out_dim), n_in)
                up_np = random_blocks(rng, qt, (u, out_dim), n_in)
                slabs, up = mx.array(slabs_np), mx.array(up_np)
                x = mx.array(rng.standard_normal((tokens, n_in)).astype(np.float32))
                slot = np.arange(k) if tokens == 1 else rng.integers(0, u, tokens * k)
                rows = np.zeros(k, np.int64) if tokens == 1 else np.repeat(np.arange(tokens), k)
                wd = np.abs(dequantize_rows(slabs_np, qt)).astype(np.float64)
                xa = np.abs(np.array(x)).astype(np.float64)
                scale = np.stack([wd[s] @ xa[r] for s, r in zip(slot, rows)])
                twin = np.array(mk.expert_matmul_twin(slabs, qt, x, slot, rows)).astype(np.float64)
                used = np.unique(slot).size
                w_bytes = used * out_dim * slabs_np.shape[2]
                io_bytes = (tokens * n_in + slot.size * out_dim) * 4
                kernels = [("expert_matvec" if tokens == 1 else "expert_gather_mm",
                            mk.expert_matvec_kernel if tokens == 1 else mk.expert_gather_mm_kernel, w_bytes)]
                if tokens == 1 and label == "gate/up":
                    kernels.append(("expert_swiglu", None, 2 * w_bytes))
                for kname, fn, wbytes in kernels:
                    if fn is None:
                        c = float(np.median(np.abs(twin))) + 1e-3
                        call = lambda: mk.expert_swiglu_kernel(slabs, up, qt, x, slot, rows, c,  # noqa: E731
                                                               dialect=dialect)
                        want = np.array(mk.expert_swiglu_twin(slabs, up, qt, x, slot, rows, c)).astype(np.float64)
                        err = float(np.max(np.abs(np.array(call()) - want) / (np.abs(want) + 1e-3 * c)))
                        err_ok = err < 1e-3
                    else:
                        call = lambda: fn(slabs, qt, x, slot, rows, dialect=dialect)  # noqa: E731
                        err = max_rel_error(np.array(call()), twin, scale)
                        err_ok = err < 1e-4
                    ok &= err_ok
                    sec = timed(call)
                    moved = wbytes + io_bytes
                    gbs = moved / sec / 1e9
                    pct = f"{100 * gbs / peak:5.1f}%" if peak else "    ?"
                    print(f"  {kname:<18} {qt.name:<8} {out_dim}x{n_in:<5} {case:<8} {moved / 1e6:8.2f} "
                          f"{sec * 1e3:8.3f} {gbs:8.1f} {pct:>6} {err:9.2e}{'' if err_ok else '  MISMATCH'}")
    # dense Q8_0 (attention / shared-expert projections): few rows -> matvec, many -> tiled
    w_np = random_blocks(rng, GGMLType.Q8_0, (4096,), 4096)
    w = mx.array(w_np)
    wd = dequantize_rows(w_np, GGMLType.Q8_0).astype(np.float64)
    for R in (1, 4, 64):
        x_np = rng.standard_normal((R, 4096)).astype(np.float32)
        x = mx.array(x_np)
        scale = np.abs(x_np).astype(np.float64) @ np.abs(wd).T
        err = max_rel_error(np.array(mk.q8_0_matvec_kernel(w, x, dialect=dialect)),
                            x_np.astype(np.float64) @ wd.T, scale)
        ok &= err < 1e-4
        sec = timed(lambda: mk.q8_0_matvec_kernel(w, x, dialect=dialect))
        moved = w_np.nbytes + R * 4096 * 8
        gbs = moved / sec / 1e9
        pct = f"{100 * gbs / peak:5.1f}%" if peak else "    ?"
        print(f"  {'q8_0_matvec':<18} {'Q8_0':<8} {'4096x4096':<10} {'R=' + str(R):<8} {moved / 1e6:8.2f} "
              f"{sec * 1e3:8.3f} {gbs:8.1f} {pct:>6} {err:9.2e}{'' if err < 1e-4 else '  MISMATCH'}")
    return ok


def run_host_shim() -> bool:
    print("\nno Metal or CUDA GPU: custom kernels cannot run here; host-shim correctness of both dialects:")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", os.path.join(root, "tests", "test_kernel_shim.py"),
                           "-k", "slice"], cwd=root, capture_output=True, text=True)
    print("  " + (proc.stdout.strip().splitlines() or ["(no output)"])[-1])
    return proc.returncode == 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-only", action="store_true", help="print the op-count model and stop")
    ap.add_argument("--quick", action="store_true", help="decode shapes only")
    ap.add_argument("--peak-gbs", type=float, default=None, help="device memory bandwidth in GB/s")
    args = ap.parse_args(argv)
    if args.peak_gbs is not None and not args.peak_gbs > 0:
        ap.error("--peak-gbs must be a positive number")
    print_op_model()
    if args.model_only:
        return 0
    dialects = mk.available_dialects()
    if not dialects:
        return 0 if run_host_shim() else 1
    ok = all([run_gpu(d, args.peak_gbs, args.quick) for d in dialects])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
