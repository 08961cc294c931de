"""MLX CPU matmul throughput under the mlx[cpu] wheel's bundled reference BLAS vs the BLAS that
ds4_mlx chooses (OpenBLAS when installed), each measured in its own fresh interpreter because the
binding is fixed when mlx.core loads.

    python benchmarks/bench_blas.py                      # f32, default shapes (~30 s on 2 cores)
    python benchmarks/bench_blas.py --dtype bfloat16     # half types do not go through BLAS
    python benchmarks/bench_blas.py --shapes 1024,1x4096x4096 --min-time 0.5

A shape is ``N`` (N x N x N) or ``MxNxK``: C[M, N] = A[M, K] @ B[K, N]. Reported GFLOP/s is
2*M*N*K per call, best of ``--repeats`` rounds of at least ``--min-time`` seconds each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT_SHAPES = "512,1024,2048,1x4096x4096,32x4096x4096"


def parse_shape(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.lower().split("x")]
    if len(parts) == 1:
        return parts[0], parts[0], parts[0]
    if len(parts) == 3 and all(p > 0 for p in parts):
        return parts[0], parts[1], parts[2]
    raise argparse.ArgumentTypeError(f"shape {text!r}: expected N or MxNxK")


def worker(shapes: list[tuple[int, int, int]], dtype: str, min_time: float, repeats: int) -> None:
    import ds4_mlx.blas  # noqa: I001 - must come before mlx so the hook can act
    import mlx.core as mx

    info = ds4_mlx.blas.status()
    rows = []
    for m, n, k in shapes:
        a = mx.random.normal((m, k)).astype(getattr(mx, dtype))
        b = mx.random.normal((k, n)).astype(getattr(mx, dtype))
        mx.eval(a, b)
        mx.eval(a @ b)  # warm-up: first-call allocations and BLAS thread start-up
        best = 0.0
        for _ in range(repeats):
            calls, start = 0, time.perf_counter()
            while True:
                mx.eval(a @ b)
                calls += 1
                elapsed = time.perf_counter() - start
                if elapsed >= min_time:
                    break
            best = max(best, 2.0 * m * n * k * calls / elapsed / 1e9)
        rows.append({"shape": [m, n, k], "gflops": best})
    print(json.dumps({"status": info, "describe": ds4_mlx.blas.describe(info), "rows": rows}))


def run_worker(setting: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, DS4_MLX_BLAS=setting)
    env.pop("LD_PRELOAD", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--shapes", args.shapes, "--dtype", args.dtype,
           "--min-time", str(args.min_time), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"worker with DS4_MLX_BLAS={setting} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma-separated (default {DEFAULT_SHAPES})")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per timing round (default 0.3)")
    parser.add_argument("--repeats", type=int, default=3, help="timing rounds, best kept (default 3)")
    parser.add_argument("--chosen", default=os.environ.get("DS4_MLX_BLAS", "auto"),
                        help="DS4_MLX_BLAS for the second column (default: the environment's, else auto)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    if args.worker:
        worker(shapes, args.dtype, args.min_time, args.repeats)
        return

    base = run_worker("off", args)
    chosen = run_worker(args.chosen, args)
    print(f"bundled : {base['describe']}")
    print(f"chosen  : {chosen['describe']}")
    threads = os.environ.get("OPENBLAS_NUM_THREADS")
    print(f"dtype {args.dtype}, {os.cpu_count()} CPUs, OPENBLAS_NUM_THREADS={threads or 'unset'}; "
          f"GFLOP/s, best of {args.repeats} x {args.min_time}s")
    print(f"{'M x N x K':>16} {'bundled':>10} {'chosen':>10} {'ratio':>8}")
    for b_row, c_row in zip(base["rows"], chosen["rows"]):
        label = "x".join(str(d) for d in b_row["shape"])
        ratio = c_row["gflops"] / b_row["gflops"] if b_row["gflops"] else float("nan")
        print(f"{label:>16} {b_row['gflops']:10.1f} {c_row['gflops']:10.1f} {ratio:7.1f}x")
    if chosen["status"]["blas"] != "openblas":
        print(f"note: the chosen BLAS is {chosen['status']['blas']} ({chosen['status']['how']}); "
              "install OpenBLAS (Debian/Ubuntu: libopenblas0-pthread) to see the difference")


if __name__ == "__main__":
    main()
