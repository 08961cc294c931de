"""Metal kernels that multiply raw GGUF blocks (``mx.fast.metal_kernel``), and their MLX-ops twins.

Each kernel has a twin with the same signature built from MLX ops (``quants_mlx`` dequantization + matmul);
the twin is the kernel's reference, and the CPU backend runs the same computation (``expert_matmul_dense``
on dequantized experts, which ``ExpertWeights`` caches). The block decoders in
``kernels/quant_common.metal`` repeat the float operations of ``ds4_mlx.formats.quants`` in the same order
(bit-exact in the host compile of the tests; the Metal compiler may still fuse a multiply-subtract), so
kernel and twin differ essentially by the order of the dot-product sums.

* ``q8_0_matvec``: ``y[r] = W x[r]`` for a Q8_0 matrix kept as its raw 34-byte blocks.
* ``expert_matmul``: pairs ``p`` multiply expert slab ``slot[p]`` (of the gathered raw slabs
  ``[u, out, row_bytes]``) by input row ``rows[p]``; the kernel path uses ``expert_matvec`` (one
  simdgroup per pair and output row) for a few pairs and ``expert_gather_mm`` (pairs sorted by expert,
  tiles of ``GATHER_TILE`` pairs sharing each dequantized chunk) for prefill batches.

The kernel sources live in ``ds4_mlx/kernels/*.metal``; ``kernel_sources`` returns exactly the header and
body handed to ``mx.fast.metal_kernel`` (tests also compile them on the host through a C++ shim).
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

# simdgroups (output rows) per threadgroup, and pairs per tile of the gathered matmul
ROWS_PER_THREADGROUP = 4
GATHER_TILE = 8
# up to this many pairs a call uses the matvec kernel (decode: k experts of one token)
MATVEC_MAX_PAIRS = 16

_HEADER_FILE = "quant_common.metal"


@dataclass(frozen=True)
class KernelSpec:
    """What ``mx.fast.metal_kernel`` is built from."""

    name: str
    body_file: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    template_names: tuple[str, ...]


KERNELS: dict[str, KernelSpec] = {
    "q8_0_matvec": KernelSpec("ds4_q8_0_matvec", "q8_0_matvec.metal", ("w", "x"), ("y",),
                              ("N_IN", "N_OUT", "ROW_BYTES")),
    "expert_matvec": KernelSpec("ds4_expert_matvec", "expert_matvec.metal", ("w", "x", "pair_slot", "pair_row"),
                                ("y",), ("QT", "N_IN", "N_OUT", "ROW_BYTES")),
    "expert_gather_mm": KernelSpec("ds4_expert_gather_mm", "expert_gather_mm.metal",
                                   ("w", "x", "tile_slot", "tile_start", "tile_count", "rows"), ("y",),
                                   ("QT", "N_IN", "N_OUT", "ROW_BYTES", "TP")),
}


def available() -> bool:
    """Whether custom Metal kernels can run here."""
    return bool(mx.metal.is_available())


def _read_kernel_file(name: str) -> str:
    return resources.files("ds4_mlx").joinpath("kernels", name).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def kernel_sources(key: str) -> tuple[str, str]:
    """(header, body) of kernel ``key`` as handed to ``mx.fast.metal_kernel``."""
    spec = KERNELS[key]
    grid = ", ".join(f"0x{v:016x}UL" for v in IQ2XXS_GRID)
    header = _read_kernel_file(_HEADER_FILE).replace("@IQ2XXS_GRID@", grid)
    return header, _read_kernel_file(spec.body_file)


@lru_cache(maxsize=None)
def _kernel(key: str):
    spec = KERNELS[key]
    header, body = kernel_sources(key)
    return mx.fast.metal_kernel(name=spec.name, input_names=list(spec.input_names),
                                output_names=list(spec.output_names), source=body, header=header)


def _geometry(qtype: GGMLType, row_bytes: int) -> int:
    elems, block_bytes = BLOCK_GEOMETRY[qtype]
    if row_bytes % block_bytes:
        raise LayoutError(f"{qtype.name}: row of {row_bytes} bytes is not a whole number of blocks")
    return row_bytes // block_bytes * elems


def _check_x(x: mx.array, n_in: int, what: str) -> None:
    if x.ndim != 2 or x.shape[1] != n_in:
        raise LayoutError(f"{what}: input rows must be [R, {n_in}], got {tuple(x.shape)}")


# --------------------------------------------------------------------------------------------------
# Q8_0 matrix-vector


def q8_0_matvec_twin(w_raw: mx.array, x: mx.array) -> mx.array:
    """MLX-ops twin: Q8_0 rows uint8 [out, row_bytes] x float32 [R, in] -> [R, out]."""
    n_in = _geometry(GGMLType.Q8_0, w_raw.shape[1])
    _check_x(x, n_in, "q8_0_matvec")
    return mx.matmul(x.astype(mx.float32), dequantize_rows_mlx(w_raw, GGMLType.Q8_0).T)


def q8_0_matvec_kernel(w_raw: mx.array, x: mx.array) -> mx.array:
    """Metal kernel: same contract as ``q8_0_matvec_twin``."""
    out_dim, row_bytes = w_raw.shape
    n_in = _geometry(GGMLType.Q8_0, row_bytes)
    _check_x(x, n_in, "q8_0_matvec")
    R = x.shape[0]
    (y,) = _kernel("q8_0_matvec")(
        inputs=[w_raw, x.astype(mx.float32)],
        template=[("N_IN", n_in), ("N_OUT", out_dim), ("ROW_BYTES", row_bytes)],
        grid=(32, out_dim, R), threadgroup=(32, ROWS_PER_THREADGROUP, 1),
        output_shapes=[(R, out_dim)], output_dtypes=[mx.float32],
    )
    return y


# --------------------------------------------------------------------------------------------------
# routed experts


def _pair_order(slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
    order, bounds, inverse = _pair_order(slot)
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
    w = dequantize_rows_mlx(slabs, qtype)  # [u, out, in]
    return expert_matmul_dense([w[s] for s in range(w.shape[0])], x, slot, rows)


def expert_matvec_kernel(slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows) -> mx.array:
    """Metal kernel, one simdgroup per (pair, output row): same contract as ``expert_matmul_twin``."""
    qtype = GGMLType(qtype)
    n_in, slot, rows = _check_pairs(slabs, qtype, x, slot, rows, "expert_matvec")
    _, out_dim, row_bytes = slabs.shape
    P = slot.size
    if P == 0:
        return mx.zeros((0, out_dim), dtype=mx.float32)
    (y,) = _kernel("expert_matvec")(
        inputs=[slabs, x.astype(mx.float32), mx.array(slot.astype(np.int32)), mx.array(rows.astype(np.int32))],
        template=[("QT", int(qtype)), ("N_IN", n_in), ("N_OUT", out_dim), ("ROW_BYTES", row_bytes)],
        grid=(32, out_dim, P), threadgroup=(32, ROWS_PER_THREADGROUP, 1),
        output_shapes=[(P, out_dim)], output_dtypes=[mx.float32],
    )
    return y


def gather_tiles(slot: np.ndarray, tile: int = GATHER_TILE):
    """Cut pairs sorted by expert into tiles of at most ``tile`` pairs of one expert.

    Returns (order, inverse, tile_slot, tile_start, tile_count): sorted pair i is original pair order[i];
    tile t covers sorted pairs [tile_start[t], tile_start[t] + tile_count[t]) of slab tile_slot[t].
    """
    order, bounds, inverse = _pair_order(slot)
    starts, counts, slots = [], [], []
    for s in range(len(bounds) - 1):
        for a in range(int(bounds[s]), int(bounds[s + 1]), tile):
            starts.append(a)
            counts.append(min(tile, int(bounds[s + 1]) - a))
            slots.append(s)
    as_i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
    return order, inverse, as_i32(slots), as_i32(starts), as_i32(counts)


def expert_gather_mm_kernel(slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows) -> mx.array:
    """Metal kernel, pairs grouped by expert in tiles: same contract as ``expert_matmul_twin``."""
    qtype = GGMLType(qtype)
    n_in, slot, rows = _check_pairs(slabs, qtype, x, slot, rows, "expert_gather_mm")
    _, out_dim, row_bytes = slabs.shape
    if slot.size == 0:
        return mx.zeros((0, out_dim), dtype=mx.float32)
    order, inverse, t_slot, t_start, t_count = gather_tiles(slot)
    (y,) = _kernel("expert_gather_mm")(
        inputs=[slabs, x.astype(mx.float32), mx.array(t_slot), mx.array(t_start), mx.array(t_count),
                mx.array(rows[order].astype(np.int32))],
        template=[("QT", int(qtype)), ("N_IN", n_in), ("N_OUT", out_dim), ("ROW_BYTES", row_bytes),
                  ("TP", GATHER_TILE)],
        grid=(32, out_dim, t_slot.size), threadgroup=(32, ROWS_PER_THREADGROUP, 1),
        output_shapes=[(slot.size, out_dim)], output_dtypes=[mx.float32],
    )
    return mx.take(y, mx.array(inverse), axis=0)


def expert_matmul_kernel(slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows) -> mx.array:
    """Metal path of ``expert_matmul``: matvec kernel for a few pairs, gathered matmul kernel beyond."""
    if np.asarray(slot).size <= MATVEC_MAX_PAIRS:
        return expert_matvec_kernel(slabs, qtype, x, slot, rows)
    return expert_gather_mm_kernel(slabs, qtype, x, slot, rows)
