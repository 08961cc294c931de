"""Throughput of DenseWeight and ExpertWeights (both numerics) at tiny-model and real DS4 Flash shapes.

    python benchmarks/bench_experts.py            # tiny + real shapes
    python benchmarks/bench_experts.py --quick    # tiny shapes only

Weights are synthetic but valid GGUF blocks (random codes, moderate f16 or E8M0 scales), so no model
file is needed. Reported per case: milliseconds per call, GFLOP/s (2 * tokens * pairs * out * in), and for the
routed experts the weight bytes each decoded token reads (``bytes_read``: out of the mmap, through the
expert cache when it is on) next to the active-parameter bytes (GGUF bytes of the k selected experts
of gate + up + down), per layer and for the 43-layer model.
"""

from __future__ import annotations

import argparse

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np

from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.model.experts import ExpertCache
from ds4_mlx.model.experts import ExpertWeights
from ds4_mlx.model.linear import Backend, DenseWeight
from ds4_mlx.model.ops import DEFAULT_OPS, DS4_CPU_OPS

from bench_util import random_blocks, timed

N_LAYER_REAL = 43


def row(label: str, seconds: float, flops: float, extra: str = "") -> None:
    print(f"  {label:<58} {seconds * 1e3:10.2f} ms {flops / seconds / 1e9:8.2f} GFLOP/s  {extra}")


def bench_dense(rng, shapes, tokens, quick_ds4_tokens) -> None:
    print("DenseWeight  (CPU backend; DEFAULT = float32 GEMM on the cached dequantized weight)")
    for name, qtype, out_dim, n_in in shapes:
        if qtype == GGMLType.Q8_0:
            raw = random_blocks(rng, qtype, (out_dim,), n_in)
        else:
            raw = (rng.standard_normal((out_dim, n_in)) * 0.02).astype(np.float16)
        w = DenseWeight(name, qtype, raw, n_in, backend=Backend.CPU)
        for T in tokens:
            x = mx.array(rng.standard_normal((T, n_in)).astype(np.float32))
            flops = 2.0 * T * out_dim * n_in
            row(f"{name} {qtype.name} {out_dim}x{n_in} T={T} DEFAULT", timed(lambda: w(x), max_iter=50), flops)
            if T <= quick_ds4_tokens:
                row(f"{name} {qtype.name} {out_dim}x{n_in} T={T} DS4_CPU",
                    timed(lambda: w.ds4_cpu(x), 0.1, 3), flops)


def bench_experts(rng, label, n_expert, n_in, d_ff, k, gate_type, down_type, tokens, n_layer, ds4_tokens) -> None:
    gate = ExpertWeights("gate", gate_type, random_blocks(rng, gate_type, (n_expert, d_ff), n_in), n_in, Backend.CPU)
    up = ExpertWeights("up", gate_type, random_blocks(rng, gate_type, (n_expert, d_ff), n_in), n_in, Backend.CPU)
    down = ExpertWeights("down", down_type, random_blocks(rng, down_type, (n_expert, n_in), d_ff), d_ff, Backend.CPU)
    active = k * (gate.expert_nbytes + up.expert_nbytes + down.expert_nbytes)
    print(f"ExpertWeights {label}: {n_expert} experts, k={k}, gate/up {gate_type.name} {d_ff}x{n_in}, "
          f"down {down_type.name} {n_in}x{d_ff}; active-parameter bytes per token per layer {active / 1e6:.2f} MB")
    for T in tokens:
        ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)])
        x = mx.array(rng.standard_normal((T, 1, n_in)).astype(np.float32))
        mid = mx.array(rng.standard_normal((T, k, d_ff)).astype(np.float32) * 0.1)
        flops = 2.0 * T * k * 3 * d_ff * n_in

        def ffn(ops):
            return ops.experts(gate, x, ids), ops.experts(up, x, ids), ops.experts(down, mid, ids)

        for cache_mb in (0, 1024):
            for e in (gate, up, down):
                e.cache = ExpertCache(cache_mb << 20)
            dt = timed(lambda: ffn(DEFAULT_OPS), max_iter=50)
            for e in (gate, up, down):
                e.reset_counters()
            mx.eval(ffn(DEFAULT_OPS))  # one more call, counted
            read = sum(e.bytes_read for e in (gate, up, down))
            selected = sum(e.bytes_selected for e in (gate, up, down))
            extra = ""
            if T == 1:
                extra = (f"read {read / 1e6:.2f} MB/token/layer (x{n_layer} layers: {read * n_layer / 1e6:.1f} MB), "
                         f"selected {selected / 1e6:.2f} MB, active {active / 1e6:.2f} MB")
            else:
                extra = f"read {read / 1e6:.2f} MB for {T} tokens (active x T = {active * T / 1e6:.1f} MB)"
            row(f"gate+up+down T={T} DEFAULT cache={cache_mb}MB", dt, flops, extra)
        if T <= ds4_tokens:
            row(f"gate+up+down T={T} DS4_CPU", timed(lambda: ffn(DS4_CPU_OPS), 0.1, 3), flops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny-model shapes only")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"mlx {mx.__version__}, default device {mx.default_device()}, metal {mx.metal.is_available()}")

    bench_dense(rng, [("tiny attn_q_b", GGMLType.Q8_0, 4096, 384),
                      ("tiny compressor_kv", GGMLType.F16, 512, 512),
                      ("tiny hc_attn_fn", GGMLType.F16, 24, 2048)], (1, 733), 733)
    bench_experts(rng, "tiny", 16, 512, 256, 4, GGMLType.IQ2_XXS, GGMLType.Q2_K, (1, 733), 6, 733)
    if args.quick:
        return
    bench_dense(rng, [("attn_q_a", GGMLType.Q8_0, 1024, 4096),
                      ("attn_output_b", GGMLType.Q8_0, 4096, 8192),
                      ("compressor_kv", GGMLType.F16, 1024, 4096)], (1, 64), 64)
    bench_experts(rng, "real q2", 8, 4096, 2048, 6, GGMLType.IQ2_XXS, GGMLType.Q2_K, (1, 32), N_LAYER_REAL, 32)
    bench_experts(rng, "real q4", 8, 4096, 2048, 6, GGMLType.Q4_K, GGMLType.Q4_K, (1,), N_LAYER_REAL, 1)
    bench_experts(rng, "real mxfp4", 8, 4096, 2048, 6, GGMLType.MXFP4, GGMLType.MXFP4, (1,), N_LAYER_REAL, 1)


if __name__ == "__main__":
    main()
