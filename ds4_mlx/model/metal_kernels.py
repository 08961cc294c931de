"""GPU kernels that multiply raw GGUF blocks (``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel``), and
their MLX-ops twins.

One design, two dialects. The block decoders and dot products (``kernels/quant_common.h``) and the kernel
bodies (``kernels/*.body``) are written once against a few ``DS4_*`` names; ``kernels/dialect_metal.h``
and ``kernels/dialect_cuda.cuh`` give those names their Metal or CUDA meaning (address spaces, barrier,
SIMD-group sum, f16 bits), and a two-line prologue per dialect names the thread and group indices. Only
the prefill multiply differs by more than spelling (``#if DS4_METAL``: 8x8 simdgroup matrices on Metal,
register-blocked FMAs on CUDA, which has no fp32-input tensor-core MMA). A shared source was chosen over
generating two files from a template because the logic worth sharing is the quant decoding, where a
divergence between dialects would be a silent numerics bug; both compilers take the one file.

Each kernel has a twin with the same signature built from MLX ops (``quants_mlx`` dequantization +
matmul); the twin is the kernel's reference, and the CPU backend runs the same computation
(``expert_matmul_dense`` on dequantized experts, which ``ExpertWeights`` caches).

* ``expert_matvec`` (decode, and Q8_0 for a few rows): NR rows per SIMD group, the 32-float activation
  chunk in registers for all of them, IQ2 grid and sign tables staged in threadgroup memory, the block
  scale applied once per chunk and the K-quant minimum folded as ``dmin * m * sum(x)``.
* ``expert_swiglu`` (decode): gate and up of the same pairs in one pass over x, writing ds4's clamped
  SwiGLU ``silu(min(g, c)) * clip(u, -c, c)``.
* ``expert_gather_mm`` (prefill, and Q8_0 for many rows): pairs sorted by expert in tiles of
  ``GATHER_TILE``; 32x32 weight tiles dequantized into threadgroup memory and multiplied as 8x8
  simdgroup matrices.

Numerical contract (tests/test_kernels.py): the prefill tiles hold exactly the twin's dequantized weights,
so ``expert_gather_mm`` differs from the twin only by summation order (|diff| <= 2e-6 * sum|w||x| per
output); the decode kernels reassociate the per-block scale and minimum, bound 1e-5 * sum(|w| + |m|)|x|
(``m`` the K-quant minimum term) per output; ``expert_swiglu`` inherits the gate/up bound through the
SwiGLU (Lipschitz, plus exp's few ulps).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import LayoutError
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType
from ds4_mlx.formats.iq2xxs_tables import IQ2XXS_GRID
from ds4_mlx.formats.quants_mlx import dequantize_rows_mlx
from ds4_mlx.model import mxfp4
from ds4_mlx.model.ops import DEFAULT_OPS

# decode kernels: SIMD groups per threadgroup, output rows per SIMD group
MATVEC_SIMDGROUPS = 4
MATVEC_ROWS = 4
# prefill: output rows per threadgroup (fixed by the body: 4 SIMD groups x 8 rows) and pairs per tile
GATHER_ROWS = 32
GATHER_THREADS = 128
GATHER_TILE = 16
# up to this many pairs a call uses the matvec kernel (decode: k experts of one token)
MATVEC_MAX_PAIRS = 16
# Q8_0 (dense weights): the matvec up to this many input rows; beyond, the tiled kernel reuses each
# dequantized weight tile across GATHER_TILE rows instead of re-reading the weights per row
Q8_MATVEC_MAX_ROWS = 4

DIALECTS = ("metal", "cuda")
_PRELUDES = {"metal": "dialect_metal.h", "cuda": "dialect_cuda.cuh"}
_PROLOGUES = {
    "metal": ("const uint ds4_tid = thread_index_in_threadgroup;\n"
              "const uint ds4_gx = threadgroup_position_in_grid.x;\n"
              "const uint ds4_gy = threadgroup_position_in_grid.y;\n"),
    "cuda": ("const uint ds4_tid = threadIdx.x;\n"
             "const uint ds4_gx = blockIdx.x;\n"
             "const uint ds4_gy = blockIdx.y;\n"),
}


@dataclass(frozen=True)
class KernelSpec:
    """What ``mx.fast.metal_kernel`` / ``cuda_kernel`` is built from."""

    name: str
    body_file: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    template_names: tuple[str, ...]


KERNELS: dict[str, KernelSpec] = {
    "expert_matvec": KernelSpec("ds4_expert_matvec", "expert_matvec.body", ("w", "x", "pair_slot", "pair_row"),
                                ("y",), ("QT", "N_IN", "N_OUT", "ROW_BYTES", "NSG", "NR")),
    "expert_swiglu": KernelSpec("ds4_expert_swiglu", "expert_swiglu.body",
                                ("wg", "wu", "x", "pair_slot", "pair_row", "clamp"), ("y",),
                                ("QT", "N_IN", "N_OUT", "ROW_BYTES", "NSG", "NR")),
    "expert_gather_mm": KernelSpec("ds4_expert_gather_mm", "expert_gather_mm.body",
                                   ("w", "x", "tile_slot", "tile_start", "tile_count", "rows"), ("y",),
                                   ("QT", "N_IN", "N_OUT", "ROW_BYTES", "TP")),
}


def available() -> bool:
    """Whether custom Metal kernels can run here."""
    return bool(mx.metal.is_available())


def available_dialects() -> list[str]:
    """The dialects whose kernels can run here: "metal" with a Metal device, "cuda" with MLX's CUDA
    backend (``mx.fast.cuda_kernel``)."""
    cuda = getattr(mx, "cuda", None)
    return [d for d, ok in (("metal", available()), ("cuda", cuda is not None and cuda.is_available())) if ok]


def _read_kernel_file(name: str) -> str:
    return resources.files("ds4_mlx").joinpath("kernels", name).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def kernel_sources(key: str, dialect: str = "metal") -> tuple[str, str]:
    """(header, body) of kernel ``key`` as handed to ``mx.fast.metal_kernel`` (or ``cuda_kernel``)."""
    if dialect not in DIALECTS:
        raise ValueError(f"unknown kernel dialect {dialect!r} (expected one of {DIALECTS})")
    spec = KERNELS[key]
    grid = ", ".join(f"0x{v:016x}UL" for v in IQ2XXS_GRID)
    common = _read_kernel_file("quant_common.h").replace("@IQ2XXS_GRID@", grid)
    header = _read_kernel_file(_PRELUDES[dialect]) + "\n" + common
    return header, _PROLOGUES[dialect] + _read_kernel_file(spec.body_file)


@lru_cache(maxsize=None)
def _kernel(key: str, dialect: str = "metal"):
    spec = KERNELS[key]
    header, body = kernel_sources(key, dialect)
    make = mx.fast.metal_kernel if dialect == "metal" else mx.fast.cuda_kernel
    return make(name=spec.name, input_names=list(spec.input_names), output_names=list(spec.output_names),
                source=body, header=header)


def _geometry(qtype: GGMLType, row_bytes: int) -> int:
    elems, block_bytes = BLOCK_GEOMETRY[qtype]
    if row_bytes % block_bytes:
        raise LayoutError(f"{qtype.name}: row of {row_bytes} bytes is not a whole number of blocks")
    return row_bytes // block_bytes * elems


def _check_x(x: mx.array, n_in: int, what: str) -> None:
    if x.ndim != 2 or x.shape[1] != n_in:
        raise LayoutError(f"{what}: input rows must be [R, {n_in}], got {tuple(x.shape)}")


def matvec_launch(out_dim: int, n_pairs: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) of the decode kernels: always whole threadgroups (no partial groups)."""
    per_group = MATVEC_SIMDGROUPS * MATVEC_ROWS
    threads = 32 * MATVEC_SIMDGROUPS
    return ((out_dim + per_group - 1) // per_group * threads, n_pairs, 1), (threads, 1, 1)


def gather_launch(out_dim: int, n_tiles: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) of the prefill kernel."""
    return ((out_dim + GATHER_ROWS - 1) // GATHER_ROWS * GATHER_THREADS, n_tiles, 1), (GATHER_THREADS, 1, 1)


# --------------------------------------------------------------------------------------------------
# Q8_0 matrix-vector


def q8_0_matvec_twin(w_raw: mx.array, x: mx.array) -> mx.array:
    """MLX-ops twin: Q8_0 rows uint8 [out, row_bytes] x float32 [R, in] -> [R, out]."""
    n_in = _geometry(GGMLType.Q8_0, w_raw.shape[1])
    _check_x(x, n_in, "q8_0_matvec")
    return mx.matmul(x.astype(mx.float32), dequantize_rows_mlx(w_raw, GGMLType.Q8_0).T)


def q8_0_matvec_kernel(w_raw: mx.array, x: mx.array, dialect: str = "metal") -> mx.array:
    """GPU kernel, same contract as ``q8_0_matvec_twin``: the matvec kernel for up to
    ``Q8_MATVEC_MAX_ROWS`` rows, the tiled kernel (weights read once per tile of rows) beyond."""
    if w_raw.ndim != 2:
        raise LayoutError(f"q8_0_matvec: weights must be [out, row_bytes], got {tuple(w_raw.shape)}")
    n_in = _geometry(GGMLType.Q8_0, w_raw.shape[1])
    _check_x(x, n_in, "q8_0_matvec")
    R = x.shape[0]
    slot = np.zeros(R, dtype=np.int64)
    rows = np.arange(R, dtype=np.int64)
    fn = expert_matvec_kernel if R <= Q8_MATVEC_MAX_ROWS else expert_gather_mm_kernel
    return fn(w_raw[None], GGMLType.Q8_0, x, slot, rows, dialect=dialect)


# --------------------------------------------------------------------------------------------------
# routed experts


def pair_order(slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order: pairs sorted by slot, stable; bounds: slot s owns order[bounds[s]:bounds[s+1]]; inverse)."""
    order = np.argsort(slot, kind="stable")
    bounds = np.searchsorted(slot[order], np.arange(int(slot.max()) + 2 if slot.size else 1))
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return order, bounds, inverse


def _check_pairs(slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows, what: str):
    if slabs.ndim != 3:
        raise LayoutError(f"{what}: expert slabs must be [u, out, row_bytes], got {tuple(slabs.shape)}")
    n_in = _geometry(qtype, slabs.shape[2])
    _check_x(x, n_in, what)
    slot = np.asarray(slot, dtype=np.int64).reshape(-1)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if slot.shape != rows.shape:
        raise LayoutError(f"{what}: {slot.size} expert slots but {rows.size} input rows")
    if slot.size and (slot.min() < 0 or slot.max() >= slabs.shape[0] or rows.min() < 0 or rows.max() >= x.shape[0]):
        raise LayoutError(f"{what}: pair indices out of range ({slabs.shape[0]} slabs, {x.shape[0]} rows)")
    return n_in, slot, rows


def expert_matmul_dense(weights: list[mx.array], x: mx.array, slot, rows) -> mx.array:
    """Pairs p -> y[p] = weights[slot[p]] @ x[rows[p]] with float32 matrices [out, in]; returns [P, out].

    Pairs are grouped by expert so each expert is one GEMM over its tokens (one matvec per pair at decode).
    """
    slot = np.asarray(slot, dtype=np.int64).reshape(-1)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    out_dim = weights[0].shape[0]
    if slot.size == 0:
        return mx.zeros((0, out_dim), dtype=mx.float32)
    order, bounds, inverse = pair_order(slot)
    x = x.astype(mx.float32)
    pieces = []
    for s in range(len(bounds) - 1):
        sel = order[bounds[s]:bounds[s + 1]]
        if sel.size:
            xs = x[int(rows[sel[0]])][None] if sel.size == 1 else mx.take(x, mx.array(rows[sel]), axis=0)
            pieces.append(mx.matmul(xs, weights[s].T))
    y = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)
    sorted_already = bool(np.all(order[1:] > order[:-1]))  # identity permutation
    return y if sorted_already else mx.take(y, mx.array(inverse), axis=0)


def expert_matmul_twin(slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows) -> mx.array:
    """MLX-ops twin: pairs p -> y[p] = dequant(slabs[slot[p]]) @ x[rows[p]]; returns float32 [P, out]."""
    qtype = GGMLType(qtype)
    _, slot, rows = _check_pairs(slabs, qtype, x, slot, rows, "expert_matmul")
    if slot.size == 0:
        return mx.zeros((0, slabs.shape[1]), dtype=mx.float32)
    w = mxfp4.expert_rows_mlx(slabs, qtype)  # [u, out, in] (MXFP4: ds4's values)
    return expert_matmul_dense([w[s] for s in range(w.shape[0])], x, slot, rows)


def _i32(v) -> mx.array:
    return mx.array(np.asarray(v).astype(np.int32))


def expert_matvec_kernel(slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows,
                         dialect: str = "metal") -> mx.array:
    """Decode kernel (NR rows per SIMD group): same contract as ``expert_matmul_twin``."""
    qtype = GGMLType(qtype)
    n_in, slot, rows = _check_pairs(slabs, qtype, x, slot, rows, "expert_matvec")
    _, out_dim, row_bytes = slabs.shape
    P = slot.size
    if P == 0:
        return mx.zeros((0, out_dim), dtype=mx.float32)
    grid, group = matvec_launch(out_dim, P)
    (y,) = _kernel("expert_matvec", dialect)(
        inputs=[slabs, x.astype(mx.float32), _i32(slot), _i32(rows)],
        template=[("QT", int(qtype)), ("N_IN", n_in), ("N_OUT", out_dim), ("ROW_BYTES", row_bytes),
                  ("NSG", MATVEC_SIMDGROUPS), ("NR", MATVEC_ROWS)],
        grid=grid, threadgroup=group, output_shapes=[(P, out_dim)], output_dtypes=[mx.float32],
    )
    return y


def expert_matvec_kernel_ids(slabs: mx.array, qtype: GGMLType, x: mx.array, slot: mx.array, rows: mx.array,
                             dialect: str = "metal") -> mx.array:
    """``expert_matvec_kernel`` with the pair indices as MLX int32 arrays, never read on the host (the
    device expert strategy's decode step); the caller guarantees they are in range."""
    qtype = GGMLType(qtype)
    n_in = _geometry(qtype, slabs.shape[2])
    _check_x(x, n_in, "expert_matvec")
    _, out_dim, row_bytes = slabs.shape
    P = int(slot.size)
    grid, group = matvec_launch(out_dim, P)
    (y,) = _kernel("expert_matvec", dialect)(
        inputs=[slabs, x.astype(mx.float32), slot.astype(mx.int32), rows.astype(mx.int32)],
        template=[("QT", int(qtype)), ("N_IN", n_in), ("N_OUT", out_dim), ("ROW_BYTES", row_bytes),
                  ("NSG", MATVEC_SIMDGROUPS), ("NR", MATVEC_ROWS)],
        grid=grid, threadgroup=group, output_shapes=[(P, out_dim)], output_dtypes=[mx.float32],
    )
    return y


def swiglu_twin(gate: mx.array, up: mx.array, clamp: float) -> mx.array:
    """ds4's clamped SwiGLU, as ``ds4_mlx.model.moe`` applies it (DEFAULT numerics)."""
    c = float(clamp)
    return DEFAULT_OPS.silu(mx.minimum(gate, c)) * mx.clip(up, -c, c)


def _check_swiglu(gate_slabs: mx.array, up_slabs: mx.array, clamp) -> float:
    """The clamp as a float, after checking it and that gate and up slabs match."""
    c = float(clamp)
    if not np.isfinite(c) or c <= 0.0:
        raise LayoutError(f"expert_swiglu: the SwiGLU clamp must be a positive finite number, got {clamp!r}")
    if tuple(gate_slabs.shape) != tuple(up_slabs.shape):
        raise LayoutError(f"expert_swiglu: gate slabs {tuple(gate_slabs.shape)} and up slabs "
                          f"{tuple(up_slabs.shape)} differ")
    return c


def expert_swiglu_twin(gate_slabs: mx.array, up_slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows,
                       clamp: float) -> mx.array:
    """MLX-ops twin of the fused kernel: swiglu(gate pairs, up pairs) -> float32 [P, out]."""
    c = _check_swiglu(gate_slabs, up_slabs, clamp)
    g = expert_matmul_twin(gate_slabs, qtype, x, slot, rows)
    u = expert_matmul_twin(up_slabs, qtype, x, slot, rows)
    return swiglu_twin(g, u, c)


def expert_swiglu_kernel(gate_slabs: mx.array, up_slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows,
                         clamp: float, dialect: str = "metal") -> mx.array:
    """Fused decode kernel (gate and up in one pass over x): same contract as ``expert_swiglu_twin``."""
    qtype = GGMLType(qtype)
    c = _check_swiglu(gate_slabs, up_slabs, clamp)
    n_in, slot, rows = _check_pairs(gate_slabs, qtype, x, slot, rows, "expert_swiglu")
    _, out_dim, row_bytes = gate_slabs.shape
    P = slot.size
    if P == 0:
        return mx.zeros((0, out_dim), dtype=mx.float32)
    grid, group = matvec_launch(out_dim, P)
    (y,) = _kernel("expert_swiglu", dialect)(
        inputs=[gate_slabs, up_slabs, x.astype(mx.float32), _i32(slot), _i32(rows),
                mx.array([c], dtype=mx.float32)],
        template=[("QT", int(qtype)), ("N_IN", n_in), ("N_OUT", out_dim), ("ROW_BYTES", row_bytes),
                  ("NSG", MATVEC_SIMDGROUPS), ("NR", MATVEC_ROWS)],
        grid=grid, threadgroup=group, output_shapes=[(P, out_dim)], output_dtypes=[mx.float32],
    )
    return y


def gather_tiles(slot: np.ndarray, tile: int = GATHER_TILE):
    """Cut pairs sorted by expert into tiles of at most ``tile`` pairs of one expert.

    Returns (order, inverse, tile_slot, tile_start, tile_count): sorted pair i is original pair order[i];
    tile t covers sorted pairs [tile_start[t], tile_start[t] + tile_count[t]) of slab tile_slot[t].
    """
    order, bounds, inverse = pair_order(slot)
    starts, counts, slots = [], [], []
    for s in range(len(bounds) - 1):
        for a in range(int(bounds[s]), int(bounds[s + 1]), tile):
            starts.append(a)
            counts.append(min(tile, int(bounds[s + 1]) - a))
            slots.append(s)
    as_i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
    return order, inverse, as_i32(slots), as_i32(starts), as_i32(counts)


def expert_gather_mm_kernel(slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows,
                            dialect: str = "metal") -> mx.array:
    """Prefill kernel, pairs grouped by expert in tiles: same contract as ``expert_matmul_twin``."""
    qtype = GGMLType(qtype)
    n_in, slot, rows = _check_pairs(slabs, qtype, x, slot, rows, "expert_gather_mm")
    _, out_dim, row_bytes = slabs.shape
    if slot.size == 0:
        return mx.zeros((0, out_dim), dtype=mx.float32)
    order, inverse, t_slot, t_start, t_count = gather_tiles(slot)
    grid, group = gather_launch(out_dim, t_slot.size)
    (y,) = _kernel("expert_gather_mm", dialect)(
        inputs=[slabs, x.astype(mx.float32), mx.array(t_slot), mx.array(t_start), mx.array(t_count),
                _i32(rows[order])],
        template=[("QT", int(qtype)), ("N_IN", n_in), ("N_OUT", out_dim), ("ROW_BYTES", row_bytes),
                  ("TP", GATHER_TILE)],
        grid=grid, threadgroup=group, output_shapes=[(slot.size, out_dim)], output_dtypes=[mx.float32],
    )
    sorted_already = bool(np.all(order[1:] > order[:-1]))
    return y if sorted_already else mx.take(y, mx.array(inverse), axis=0)


def expert_matmul_kernel(slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows,
                         dialect: str = "metal") -> mx.array:
    """GPU path of ``expert_matmul``: matvec kernel for a few pairs, gathered matmul kernel beyond."""
    if np.asarray(slot).size <= MATVEC_MAX_PAIRS:
        return expert_matvec_kernel(slabs, qtype, x, slot, rows, dialect=dialect)
    return expert_gather_mm_kernel(slabs, qtype, x, slot, rows, dialect=dialect)
