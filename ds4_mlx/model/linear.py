"""How every GGUF matrix of the model is held and multiplied, in two numerics modes.

Interface (the architecture code uses only this):

    w = DenseWeight.from_gguf(gguf_file, name)        # 2-D (out, in): Q8_0, F16 or F32
    w = DenseWeight.from_gguf(gguf_file, name, rows=range(a, b))  # only those output rows, read and held
    y = w(x)  /  w.ds4_cpu(x)                          # x [..., in] float32 -> [..., out] float32
    w.rows(start, stop)                                # a DenseWeight over a slice of output rows
    e = experts.ExpertWeights.from_gguf(gguf_file, name)  # 3-D (n_expert, out, in): IQ2_XXS/Q2_K/Q4_K/MXFP4
    y = e(x, ids)  /  e.ds4_cpu(x, ids)                # x [T, k|1, in], ids [T, k] int -> [T, k, out]

``w(x)`` is the DEFAULT arithmetic, ``w.ds4_cpu(x)`` the DS4_CPU one. The architecture code calls
neither: it calls ``ops.linear(w, x)`` / ``ops.experts(e, x, ids)`` on the ``Ops`` object bound at load
(``ops.py``), which picks one; nothing here takes or tests a mode.

Additions to that contract (all optional): ``backend=`` on both constructors (below); ``use_kernels=``
(DenseWeight: opt-in raw-block Q8_0 kernel on a GPU; ExpertWeights: the kernel dialect, default none);
``w.shape``/``w.qtype``/``w.nbytes``; ``e.shape``/``e.expert_nbytes`` and the counters ``e.bytes_read``,
``e.bytes_selected``, ``e.calls``, ``e.pairs``, ``e.reset_counters()``; ``experts.EXPERT_CACHE``.

``backend`` (``Backend.CPU`` / ``METAL`` / ``CUDA``; the loader passes its ``load_plan``'s; default
CPU: nothing here detects the device, and the CPU forms are right on any device) decides how weights
are kept for the DEFAULT mode, through ``load_plan.dense_form`` (the one place that decides; a weight
holds the ``form`` it names and multiplies by it):

* CPU: every dense weight is dequantized to float32 once, lazily, and cached, transposed (``dense_t``). MLX's CPU backend has
  exactly one fast matmul, the BLAS float32 GEMM; ``mx.quantized_matmul`` there is ~2x slower for one
  token and ~35x slower for a 64-token batch (Q8_0 1024x4096, measured on a 2-core x86 box).
* a GPU (METAL or CUDA, the same forms): Q8_0 weights become MLX affine 8-bit group-32 matrices (lossless,
  see ``q8_0_to_affine``) multiplied with ``mx.quantized_matmul``; F16 weights stay float16 (``half``,
  promoted exactly inside the matmul); F32 weights are cached as float32.

``ds4_cpu`` (the DS4_CPU numerics) reproduces the arithmetic of ds4.c's CPU reference (its portable, non-NEON branch,
which is what a strict x86 build runs), so per-layer comparison with the oracle can be tight:

* Q8_0 [dot_q8_0_row]: the activation row is quantized per 32 (``quantize_q8_0_activation``); per block b
  the integer sum ``isum_b`` is exact; then, in float32 and in this order,
  ``acc = 0.0f; acc += (f16(w.d_b) * x.d_b) * (float)isum_b`` for b = 0, 1, ...
* F16 [dot_f16_row]: ``acc = 0.0f; acc += f16_to_f32(w_i) * x_i`` for i = 0, 1, ... (float32 product
  rounded, then the float32 add rounded: the strict build contracts nothing into an FMA).
* F32 [matvec_f32_worker]: ``acc = 0.0; acc += (double)w_i * x_i`` in float64, then ``(float)acc``.

The DS4_CPU arithmetic always runs on the CPU stream and is never passed through ``mx.compile``: a fused
kernel may contract ``a * b + c`` into an FMA and change the last bit. Sequential sums are written as
Python loops of whole-array MLX adds (one add per block or per input element, each over all tokens and
rows) or, for small outputs, as a ``cumsum`` scan, starting from ``+0.0`` like ds4's accumulators, so every
rounding is ds4's.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import mlx.core as mx
import numpy as np

from ds4_mlx import allocator, native
from ds4_mlx.errors import InferenceError, LayoutError
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.quants import dequantize_rows
from ds4_mlx.formats.quants_mlx import quantize_q8_0_activation_mlx
from ds4_mlx.model import load_plan, metal_kernels
from ds4_mlx.model.numerics import sequential_outer_sum
from ds4_mlx.model.ops import DS4_CHUNK_ELEMENTS, chunks

__all__ = [
    "Backend",
    "DenseWeight",
    "dense_resident_nbytes",
    "dense_ds4_cpu_resident_nbytes",
    "q8_0_to_affine",
    "resolve_backend",
]

QK8_0 = 32

class Backend(str, Enum):
    """Where the DEFAULT fast path runs, which decides how weights are stored."""

    CPU = "cpu"
    METAL = "metal"
    CUDA = "cuda"

    @property
    def gpu(self) -> bool:
        """Metal and CUDA hold the same GPU forms (affine Q8_0, float16 F16)."""
        return self is not Backend.CPU


def resolve_backend(backend: "Backend | str | None") -> Backend:
    """A name or member -> that member (ValueError if unknown); ``None`` -> ``Backend.CPU``: a weight
    built without the loader's plan takes the CPU forms (nothing below the loader reads the device)."""
    return Backend(backend or "cpu")


# --------------------------------------------------------------------------------------------------
# float32 caches built in place


def _mlx_buffer(shape: tuple[int, ...], dtype: mx.Dtype = mx.float32) -> tuple[mx.array, np.ndarray]:
    """A new MLX array (float32 unless told) and a writable numpy view of its memory.

    The dense float32 caches are filled through the view, a slab of rows at a time, because
    ``mx.array(numpy)`` copies: building the whole matrix in numpy first held it twice at the peak
    (the real model's 129280x4096 output head: 2 GiB more, +2.5 GiB VmHWM on the 4-layer real-dims
    model). MLX documents that ``np.array(a, copy=False)`` shares the array's memory.
    """
    a = mx.zeros(shape, dtype=dtype)
    mx.eval(a)
    view = np.array(a, copy=False)
    if not (view.flags.writeable and view.flags.c_contiguous and view.shape == tuple(shape)):
        raise RuntimeError(f"MLX did not give a writable contiguous view of a {shape} {dtype} array")
    return a, view


def _row_slabs(out_dim: int, n_in: int):
    """[r0, r1) row ranges of ~16 MiB of float32 (at least one row each)."""
    step = max(1, (1 << 22) // n_in)
    for r0 in range(0, out_dim, step):
        yield r0, min(out_dim, r0 + step)


# A weight of at least this many GGUF bytes drops the mapping's pages it has read every this many
# bytes while its cached form is built (``DenseWeight._build_slabs``).
RELEASE_READ_BYTES = 64 << 20


# --------------------------------------------------------------------------------------------------
# Q8_0 -> MLX affine 8-bit


def q8_0_to_affine(raw: np.ndarray) -> tuple[mx.array, mx.array, mx.array]:
    """Q8_0 rows uint8 (out, in/32*34) -> (w uint32 (out, in/4), scales f32 (out, in/32), biases f32).

    MLX's affine dequantization is ``scale * u + bias`` with ``u`` an unsigned 8-bit code, evaluated in the
    scales' dtype. With ``u = q + 128``, ``scale = d`` and ``bias = -128 d`` in float32 this is ``d * q``
    exactly: ``d`` is an f16 (11 significant bits) and ``u`` has 8, so ``d * u`` is exact in float32 (19
    bits), ``-128 d`` is exact (a power of two times an f16), and ``d u - 128 d = d q`` is exact because
    both terms are multiples of the same power of two and the result has at most 19 significant bits (an
    FMA gives the same). f16 scales would not do: MLX would then dequantize to f16 and round ``d * q``.
    Element j of a uint32 word is its byte j (little-endian), which is MLX's 8-bit packing order.
    """
    rows = np.ascontiguousarray(raw)
    out_dim, row_bytes = rows.shape
    nb = row_bytes // 34
    blocks = rows.reshape(out_dim, nb, 34)
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view("<f2").reshape(out_dim, nb).astype(np.float32)
    codes = (blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    packed = np.ascontiguousarray(codes.reshape(out_dim, nb * QK8_0)).view("<u4")
    return mx.array(packed), mx.array(d), mx.array(d * np.float32(-128))


def dense_resident_nbytes(qtype: GGMLType | int, shape: tuple[int, int], backend: "Backend | str | None",
                          use_kernels: bool = False) -> int:
    """Bytes of MLX memory a root ``DenseWeight`` of this type and (out, in) shape holds once it has
    multiplied (``w(x)``) on ``backend`` (its cached form; the GGUF bytes stay in the mapping).
    ``dense_ds4_cpu_resident_nbytes`` is the same for ``w.ds4_cpu(x)``: two functions, like the two
    arithmetics, so the numerics stay bound in one place (the loader picks).

    One branch per form the multiplication paths build (``_fast_matmul``), so a pipeline split by
    these bytes sees what a rank will hold: on the CPU backend a Q8_0 weight is ~3.8x its GGUF bytes
    (float32), an F16 one 2x. ``tests/test_pipeline_split.py`` builds every form and compares its
    ``nbytes`` with this figure, so the two cannot drift apart silently.
    """
    out_dim, n_in = (int(shape[0]), int(shape[1]))
    elems = out_dim * n_in
    nb = n_in // QK8_0
    form = load_plan.dense_form(resolve_backend(backend).value, qtype, use_kernels)
    return {"blocks": nb * 34 * out_dim,  # the raw GGUF rows
            "affine": elems + 2 * 4 * nb * out_dim,  # 8-bit codes, float32 scales and biases
            "half": 2 * elems,  # the GGUF's float16 values
            "float32": 4 * elems}[form]  # ``dense_t`` (or ``dense`` for a weight used by row slices)


def dense_ds4_cpu_resident_nbytes(qtype: GGMLType | int, shape: tuple[int, int]) -> int:
    """``dense_resident_nbytes`` for ds4-cpu's arithmetic (``_ds4_matmul``'s cached forms)."""
    qtype = GGMLType(qtype)
    out_dim, n_in = (int(shape[0]), int(shape[1]))
    elems = out_dim * n_in
    if qtype == GGMLType.Q8_0:  # ``_ds4_q8_0``: int8 codes as float32 + the block scales as float32
        return 4 * elems + 4 * (n_in // QK8_0) * out_dim
    return (8 if qtype == GGMLType.F32 else 4) * elems  # ``_ds4_columns``: float64 for F32, else float32


class DenseWeight:
    """A 2-D GGUF weight (out, in) of type Q8_0, F16 or F32, kept as a zero-copy view of the mmap.

    Derived forms (float32 matrix, MLX affine matrix, the DS4_CPU integer decomposition) are built on
    first use and cached. A row slice (``rows``) shares its parent's caches.
    """

    SUPPORTED_TYPES = (GGMLType.Q8_0, GGMLType.F16, GGMLType.F32)

    def __init__(
        self,
        name: str,
        qtype: GGMLType,
        raw: np.ndarray,
        n_in: int,
        backend: "Backend | str | None" = None,
        *,
        use_kernels: bool = False,
        _parent: "DenseWeight | None" = None,
        _row0: int = 0,
    ):
        qtype = GGMLType(qtype)
        if qtype not in self.SUPPORTED_TYPES:
            raise LayoutError(f"tensor {name!r}: type {qtype.name} is not a dense matmul type (Q8_0, F16, F32)")
        if raw.ndim != 2:
            raise LayoutError(f"tensor {name!r}: expected a 2-D weight, got shape {raw.shape}")
        if qtype == GGMLType.Q8_0 and (n_in % QK8_0 or raw.shape[1] != n_in // QK8_0 * 34):
            raise LayoutError(f"tensor {name!r}: Q8_0 rows of {raw.shape[1]} bytes do not hold {n_in} values")
        if qtype != GGMLType.Q8_0 and raw.shape[1] != n_in:
            raise LayoutError(f"tensor {name!r}: rows of {raw.shape[1]} values, expected {n_in}")
        self.name = name
        self.qtype = qtype
        self.raw = raw
        self.shape = (int(raw.shape[0]), int(n_in))
        self.backend = resolve_backend(backend) if _parent is None else _parent.backend
        # opt-in: on a GPU, multiply Q8_0 with the raw-block kernel instead of mx.quantized_matmul
        self.use_kernels = bool(use_kernels) if _parent is None else _parent.use_kernels
        # the cached form DEFAULT numerics build and multiply, decided by the plan's rule
        self.form = (load_plan.dense_form(self.backend.value, qtype, self.use_kernels) if _parent is None
                     else _parent.form)
        self._parent = _parent
        self._row0 = _row0
        self._dense: mx.array | None = None
        self._dense_t: mx.array | None = None
        self._affine: tuple[mx.array, mx.array, mx.array] | None = None
        self._half: mx.array | None = None
        self._blocks: mx.array | None = None
        self._ds4: Any = None
        self._groups: list[DenseWeight] | None = None

    @classmethod
    def from_gguf(cls, gguf_file, name: str, backend: "Backend | str | None" = None, *,
                  use_kernels: bool = False, rows: range | None = None) -> "DenseWeight":
        """The GGUF weight ``name``, or with ``rows`` a weight of its own over those output rows
        only: a view of just their bytes in the mapping, so its cached forms are built from, and
        hold, those rows alone (a pipeline rank's share of the output head). Unlike ``rows()``,
        which slices a parent's caches, nothing of the other rows is ever read or built."""
        info = gguf_file.tensor(name)
        if len(info.shape) != 2:
            raise LayoutError(f"tensor {name!r}: expected a 2-D weight, got shape {info.shape}")
        raw = gguf_file.tensor_array(name)
        if rows is not None:
            if rows.step != 1 or not 0 <= rows.start < rows.stop <= raw.shape[0]:
                raise LayoutError(f"tensor {name!r}: row range {rows} is not a non-empty range within "
                                  f"0..{raw.shape[0]}")
            if len(rows) != raw.shape[0]:
                raw, name = raw[rows.start:rows.stop], f"{name}[{rows.start}:{rows.stop}]"
        return cls(name, info.ggml_type, raw, info.shape[1], backend, use_kernels=use_kernels)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as stored in the GGUF."""
        return int(self.raw.nbytes)

    def resident_nbytes(self) -> int:
        """``dense_resident_nbytes`` of this weight: what its cached form for ``w(x)`` holds."""
        return dense_resident_nbytes(self.qtype, self.shape, self.backend, self.use_kernels)

    def ds4_cpu_resident_nbytes(self) -> int:
        """The same for ``w.ds4_cpu(x)``."""
        return dense_ds4_cpu_resident_nbytes(self.qtype, self.shape)

    def rows(self, start: int, stop: int) -> "DenseWeight":
        """The weight restricted to output rows [start, stop); shares this weight's caches."""
        if not 0 <= start < stop <= self.shape[0]:
            raise LayoutError(f"tensor {self.name!r}: row range [{start}, {stop}) outside 0..{self.shape[0]}")
        root = self if self._parent is None else self._parent
        row0 = self._row0 + start
        return DenseWeight(f"{root.name}[{row0}:{row0 + stop - start}]", self.qtype, self.raw[start:stop],
                           self.shape[1], _parent=root, _row0=row0)

    # -- cached forms ------------------------------------------------------------------------------

    def _slice(self, full: mx.array, axis: int) -> mx.array:
        n = self.shape[0]
        index = [slice(None)] * full.ndim
        index[axis] = slice(self._row0, self._row0 + n)
        return full[tuple(index)]

    def _build_slabs(self):
        """``_row_slabs`` of the root weight for building a cached form from ``raw``. A big weight
        (the real model's output head: 536 MiB of Q8_0) drops the GGUF mapping's resident pages
        every ``RELEASE_READ_BYTES`` it reads and at the end (``allocator.release_file_pages``:
        clean pages of a read-only mapping, faulted back with the same bytes). Without it the pages
        read stayed in the process's RSS next to the float32 form built from them: +536 MiB at the
        peak of the pipeline rank that holds the head."""
        out_dim, n_in = self.shape
        release = self.raw.nbytes >= RELEASE_READ_BYTES
        row_bytes = self.raw.nbytes // max(out_dim, 1)
        read = 0
        for r0, r1 in _row_slabs(out_dim, n_in):
            yield r0, r1
            read += (r1 - r0) * row_bytes
            if release and (read >= RELEASE_READ_BYTES or r1 == out_dim):
                allocator.release_file_pages(self.raw)
                read = 0

    def dense(self) -> mx.array:
        """The weight as float32 (out, in), bit-identical to the numpy dequantization."""
        if self._parent is not None:
            return self._slice(self._parent.dense(), 0)
        if self._dense is None:
            out_dim, n_in = self.shape
            self._dense, w = _mlx_buffer((out_dim, n_in))
            for r0, r1 in self._build_slabs():
                w[r0:r1] = self._float_rows(r0, r1)
        return self._dense

    def dense_t(self) -> mx.array:
        """The weight transposed, float32 [in, out] and contiguous: the CPU backend's GEMM operand.

        With W row-major, ``x @ W.T`` makes MLX call ``cblas_sgemm(NoTrans, Trans)``; OpenBLAS (0.3.21,
        which has no GEMM-to-GEMV forwarding) runs that up to twice as slow for one token as
        ``sgemm(NoTrans, NoTrans)`` on the transposed copy (the 129280x512 output head: 93 vs 50 ms on a
        loaded 2-core box, the latter on par with ``cblas_sgemv``), and never faster for a chunk. The
        two forms are the same sums in an order OpenBLAS picks per form, kernel family and thread
        split: bit-identical with its Haswell kernels, not on every machine, so nothing relies on it
        (``test_linear`` holds them to the float32 summation bound).
        Built a slab of rows at a time straight into the MLX buffer (``_mlx_buffer``).
        Row slices do not use it: a column slice of the transposed root is not contiguous, and MLX
        would copy it on every call; they multiply the shared ``dense()`` as before.
        """
        if self._dense_t is None:
            out_dim, n_in = self.shape
            self._dense_t, wt = _mlx_buffer((n_in, out_dim))
            for r0, r1 in self._build_slabs():
                wt[:, r0:r1] = self._float_rows(r0, r1).T
        return self._dense_t

    def _float_rows(self, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of the root weight as float32 numpy (the numpy dequantization)."""
        if self.qtype == GGMLType.Q8_0:
            return dequantize_rows(self.raw[r0:r1], GGMLType.Q8_0)
        return np.asarray(self.raw[r0:r1], dtype=np.float32)

    def half(self) -> mx.array:
        """The F16 weight as MLX float16 (out, in): the GGUF's values, the GPU backends' form."""
        if self.qtype != GGMLType.F16:
            raise LayoutError(f"tensor {self.name!r}: the float16 form is for F16 weights, not {self.qtype.name}")
        if self._parent is not None:
            return self._slice(self._parent.half(), 0)
        if self._half is None:
            self._half = mx.array(np.ascontiguousarray(self.raw))
        return self._half

    def affine(self) -> tuple[mx.array, mx.array, mx.array]:
        """The Q8_0 weight in MLX's affine 8-bit group-32 form (see ``q8_0_to_affine``)."""
        if self.qtype != GGMLType.Q8_0:
            raise LayoutError(f"tensor {self.name!r}: only Q8_0 weights have an affine 8-bit form")
        if self._parent is not None:
            return tuple(self._slice(a, 0) for a in self._parent.affine())  # type: ignore[return-value]
        if self._affine is None:
            self._affine = q8_0_to_affine(self.raw)
        return self._affine

    def blocks(self) -> mx.array:
        """The Q8_0 weight as its raw GGUF blocks, uint8 (out, row_bytes), for the Metal matvec kernel."""
        if self._parent is not None:
            return self._slice(self._parent.blocks(), 0)
        if self._blocks is None:
            self._blocks = mx.array(np.ascontiguousarray(self.raw))
        return self._blocks

    def _ds4_q8_0(self) -> tuple[mx.array, mx.array]:
        """(wq float32 [nb, 32, out] holding the int8 codes, wd float32 [nb, out] the block scales)."""
        if self._parent is not None:
            wq, wd = self._parent._ds4_q8_0()
            return self._slice(wq, 2), self._slice(wd, 1)
        if self._ds4 is None:
            out_dim, n_in = self.shape
            nb = n_in // QK8_0
            # filled a slab of rows at a time straight into the MLX buffers (``_mlx_buffer``: no
            # staging copies of the whole matrix, which peaked at 3x the real head's float32 size)
            wq_arr, wq = _mlx_buffer((nb, QK8_0, out_dim))
            wd_arr, wd = _mlx_buffer((nb, out_dim))
            for r0, r1 in self._build_slabs():
                blocks = np.ascontiguousarray(self.raw[r0:r1]).reshape(r1 - r0, nb, 34)
                wd[:, r0:r1] = np.ascontiguousarray(blocks[:, :, 0:2]).view("<f2").reshape(r1 - r0, nb).T
                wq[:, :, r0:r1] = blocks[:, :, 2:].view(np.int8).transpose(1, 2, 0)  # exact int8 -> float32
            self._ds4 = (wq_arr, wd_arr)
        return self._ds4

    def _ds4_columns(self, dtype: mx.Dtype) -> mx.array:
        """The F16/F32 weight transposed, contiguous [in, out], as float32 (F16) or float64 (F32)."""
        if self._parent is not None:
            return self._slice(self._parent._ds4_columns(dtype), 1)
        if self._ds4 is None:
            out_dim, n_in = self.shape
            self._ds4, cols = _mlx_buffer((n_in, out_dim), mx.float64 if dtype == mx.float64 else mx.float32)
            for r0, r1 in self._build_slabs():
                cols[:, r0:r1] = np.asarray(self.raw[r0:r1]).T  # exact f16/f32 -> float32/float64
        return self._ds4

    # -- multiplication ---------------------------------------------------------------------------

    def __call__(self, x: mx.array) -> mx.array:
        """x [..., in] -> [..., out] in DEFAULT numerics (the backend's fast matmul)."""
        return self._apply(x, self._fast_matmul)

    def ds4_cpu(self, x: mx.array) -> mx.array:
        """x [..., in] -> [..., out] with ds4.c's CPU arithmetic (module docstring), on the CPU stream."""
        with mx.stream(mx.cpu):
            return self._apply(x, self._ds4_matmul)

    def groups(self, n: int) -> list["DenseWeight"]:
        """The rows in ``n`` equal consecutive groups (row slices sharing this weight's caches)."""
        out_dim = self.shape[0]
        if n < 1 or out_dim % n:
            raise LayoutError(f"tensor {self.name!r}: {out_dim} rows do not split into {n} groups")
        if self._groups is None or len(self._groups) != n:
            step = out_dim // n
            self._groups = [self.rows(g * step, (g + 1) * step) for g in range(n)]
        return self._groups

    def grouped(self, x: mx.array) -> mx.array:
        """x [L, G, in] -> [L, out]: group g of the rows (``groups(G)``) times x[:, g], in DEFAULT
        numerics. On the CPU backend one batched matmul over the float32 form viewed as [G, in, out/G]
        (each group the same GEMM as its row slice alone, so the same bits), one graph node instead of
        a slice, a matmul and a concatenation per group; elsewhere group by group."""
        L, G, n_in = x.shape
        if n_in != self.shape[1] or self.shape[0] % G:
            raise LayoutError(f"tensor {self.name!r}: grouped input of shape {tuple(x.shape)} does not fit "
                              f"{self.shape[0]} rows of {self.shape[1]}")
        if self.form != "float32" or self._parent is not None:
            return mx.concatenate([g(x[:, i]) for i, g in enumerate(self.groups(G))], axis=-1)
        rows = self.shape[0] // G
        w3 = self.dense().reshape(G, rows, n_in).transpose(0, 2, 1)  # a view: [G, in, rows]
        xg = x.astype(mx.float32).transpose(1, 0, 2)  # [G, L, in]
        return mx.matmul(xg, w3).transpose(1, 0, 2).reshape(L, G * rows)

    def host_product(self, x: np.ndarray) -> np.ndarray:
        """x float32 [T, in] (numpy) -> [T, out]: DEFAULT numerics' product computed on the host by
        the native library straight from the Q8_0 blocks in the mapping (``native.q8_0_rows``), so no
        cached form is built or held. Equal to ``w(x)`` up to the order of its float32 sums. For one
        token on the CPU it reads a quarter of the float32 form's bytes (the output head: 3.0 vs
        13.2 ms on the tiny model, 2 cores); the caller makes sure it runs outside any ``mx.compile``."""
        lib = native.library()
        if lib is None or self.qtype != GGMLType.Q8_0:
            why = "it is not Q8_0" if self.qtype != GGMLType.Q8_0 else native.status()["reason"]
            raise InferenceError(f"tensor {self.name!r}: no native host product ({why})")
        out_dim, n_in = self.shape
        if x.ndim != 2 or x.shape[1] != n_in:
            raise LayoutError(f"tensor {self.name!r}: input has shape {tuple(x.shape)}, expected [T, {n_in}]")
        return native.q8_0_rows(lib, self.raw, n_in, x)

    def _apply(self, x: mx.array, matmul) -> mx.array:
        out_dim, n_in = self.shape
        if x.shape[-1:] != (n_in,):
            raise LayoutError(f"tensor {self.name!r}: input has shape {tuple(x.shape)}, last axis must be {n_in}")
        lead = tuple(x.shape[:-1])
        x2 = x.reshape(-1, n_in)
        if x2.dtype != mx.float32:
            x2 = x2.astype(mx.float32)
        return matmul(x2).reshape(*lead, out_dim)

    def _fast_matmul(self, x2: mx.array) -> mx.array:
        if self.form == "blocks":
            return metal_kernels.q8_0_matvec_kernel(self.blocks(), x2, dialect=self.backend.value)
        if self.form == "half":
            # float32 x float16 promotes the weight to float32 exactly (f16 -> f32 is exact): the
            # float32 form's bits, from half its resident bytes
            return mx.matmul(x2, self.half().T)
        if self.form == "affine":
            wq, scales, biases = self.affine()
            return mx.quantized_matmul(x2, wq, scales, biases, transpose=True, group_size=QK8_0, bits=8)
        if self._parent is not None:
            return mx.matmul(x2, self.dense().T)
        return mx.matmul(x2, self.dense_t())

    def _ds4_matmul(self, x2: mx.array) -> mx.array:
        if self.qtype == GGMLType.Q8_0:
            return self._ds4_matmul_q8_0(x2)
        if self.qtype == GGMLType.F16:
            return self._ds4_matmul_f16(x2)
        return self._ds4_matmul_f32(x2)

    def _ds4_matmul_q8_0(self, x2: mx.array) -> mx.array:
        out_dim, n_in = self.shape
        nb = n_in // QK8_0
        wq, wd = self._ds4_q8_0()
        xq, xd = quantize_q8_0_activation_mlx(x2)  # int8 [T, in], float32 [T, nb]
        T = x2.shape[0]
        xq3 = xq.astype(mx.float32).reshape(T, nb, QK8_0).transpose(1, 0, 2)  # [nb, T, 32]
        # tokens per chunk so the block sums [nb, t, out] stay below the temporary bound
        t_step = max(1, DS4_CHUNK_ELEMENTS // (nb * out_dim))
        pieces = []
        for t0, t1 in chunks(T, t_step):
            # integer block sums: |partial sums| <= 32 * 128 * 128 = 2**19 < 2**24, exact in any order
            isum = mx.matmul(xq3[:, t0:t1], wq)  # [nb, t, out]
            xs = xd[t0:t1]
            acc = mx.zeros((t1 - t0, out_dim), dtype=mx.float32)
            for b in range(nb):
                acc = acc + (wd[b][None, :] * xs[:, b:b + 1]) * isum[b]
            pieces.append(acc)
            if t_step < T:
                mx.eval(acc)
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)

    def _ds4_matmul_f16(self, x2: mx.array) -> mx.array:
        # f16 -> f32 is exact (ds4's f16_to_f32); products and adds are separate float32 roundings
        return sequential_outer_sum(self._ds4_columns(mx.float32), x2)

    def _ds4_matmul_f32(self, x2: mx.array) -> mx.array:
        # float*float is exact in float64 (48 significant bits), so only the order of the adds matters
        return sequential_outer_sum(self._ds4_columns(mx.float64), x2.astype(mx.float64)).astype(mx.float32)

    def __repr__(self) -> str:
        return f"DenseWeight({self.name!r}, {self.qtype.name}, shape={self.shape}, backend={self.backend.value})"
