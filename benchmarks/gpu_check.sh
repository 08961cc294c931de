#!/usr/bin/env bash
# One-shot check of the CUDA kernels on an NVIDIA machine (under 10 minutes):
#   1. makes sure MLX's CUDA backend is importable (installs mlx[cuda12] into the current Python if not);
#   2. runs the GPU kernel tests (each CUDA kernel against float64 references, shapes out_dim 1/5/61,
#      n_in 256..4096, P 1..40) and the nvcc compile check;
#   3. runs benchmarks/bench_kernels.py --quick at the real DS4 Flash shapes (4096x2048 / 2048x4096,
#      6 experts): each kernel against its MLX-ops twin, then GB/s and the share of the device's
#      bandwidth (H200: ~4800 GB/s; pass PEAK_GBS=... to override).
# Usage: benchmarks/gpu_check.sh   (from anywhere; PYTHON=... to choose the interpreter)
set -u -o pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

has_cuda() {
    timeout 120 "$PY" -c 'import sys, mlx.core as mx; sys.exit(0 if mx.cuda.is_available() else 1)' 2>/dev/null
}

echo "== GPU"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if ! has_cuda; then
    echo "== installing mlx[cuda12] (MLX's CUDA backend is not importable here)"
    timeout 300 "$PY" -m pip install -q "mlx[cuda12]" numpy pytest || { echo "pip install failed"; exit 2; }
    has_cuda || { echo "MLX still has no CUDA device: stop"; exit 2; }
fi
"$PY" -c 'import mlx.core as mx; print("mlx", mx.__version__, "default device", mx.default_device())'

echo "== kernel tests (GPU + nvcc compile)"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "gpu or nvcc or twin" || status=1

echo "== bench_kernels (real shapes)"
timeout 240 "$PY" benchmarks/bench_kernels.py ${PEAK_GBS:+--peak-gbs "$PEAK_GBS"} || status=1

echo "== gpu_check: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
