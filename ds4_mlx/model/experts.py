"""Routed-expert weights (IQ2_XXS, Q2_K, Q4_K, MXFP4): read and multiply only the experts a call selects.

A 3-D GGUF expert tensor is ``(n_expert, out, in)`` with expert ``e`` one contiguous slab of ``out`` rows
[tensor_expert_bytes]. Each tensor has its own type, so a file may mix them across layers (ds4f-q2-q4:
Q4_K experts in layers 37-42, IQ2_XXS/Q2_K elsewhere) or within one (down differing from gate/up). A call gathers the unique expert ids, copies just their slabs out of the mmap
(``np.take``) and multiplies token-expert pairs grouped by expert: one GEMM per active expert for a
prefill batch, k matrix-vector products for a decoded token. Counters: ``bytes_read`` (bytes of the
mmap the call read: slabs copied out, or read in place by the native code) and ``bytes_selected`` (GGUF
bytes of the distinct experts selected, i.e. what a kernel streams), ``calls``, ``pairs``.

NATIVE (``ds4_mlx.native``, the default on the host when a C compiler is there): both numerics below are
computed by C code reading the selected experts' blocks in place from the mmap: no copy, no float32
expert matrices, no cache. Its ds4-cpu results are the MLX-ops path's bit for bit; its default results
use its own (fixed, batch-independent) summation order, so they differ from the MLX path's in the last
bits. The MLX-ops paths below stay as the reference twins and the fallback (``DS4_MLX_NATIVE=off``, no
compiler, a subclass that reads its slabs from somewhere else than ``raw``).

DEFAULT numerics: float activations x dequantized weights (MXFP4: ds4's values, ``mxfp4``). With a kernel
dialect (``use_kernels``: "metal" / "cuda", the load plan's ``kernels``; default none) the custom kernels of
``metal_kernels`` read the raw blocks; otherwise the selected experts are dequantized with the MLX-ops
dequantizers (``quants_mlx``, the kernels' twins) and kept in ``EXPERT_CACHE``, a byte-bounded LRU shared
by all expert tensors, because on the CPU backend dequantization costs far more than the matmuls.

DS4_CPU numerics reproduce ds4.c's CPU expert arithmetic (portable branch). Each input row is quantized to
Q8_K [ds4_quantize_row_q8_K] (so the SwiGLU mid vector fed to the down projection is re-quantized, as ds4
does), and per 256-element super-block i, with integer sums exact:

* IQ2_XXS [ds4_vec_dot_iq2_xxs_q8_K]: ``bsum_i = sum_g (2 * (w_g >> 28) + 1) * sum_32(signed_grid * q8)``
  (int32; it can exceed 2**24, so it is summed in int32 and rounded once by the int->float conversion);
  ``sumf += (f16(x.d) * y.d) * (float)bsum_i`` from ``sumf = 0.0f``; result ``0.125f * sumf``.
* Q2_K [ds4_vec_dot_q2_K_q8_K]: ``isum_i = sum_j (sc_j & 15) * sum_16(q2 * q8)``,
  ``summs_i = sum_j bsums_j * (sc_j >> 4)``; ``dall = y.d * f16(x.d)``, ``dmin = y.d * f16(x.dmin)``,
  ``sumf += dall * (float)isum_i - dmin * (float)summs_i`` (two products, a difference, an add; no FMA).
* Q4_K [ds4_vec_dot_q4_K_q8_K]: ``isum_i = sum_j sc_j * sum_32(nibble * q8)`` (int32),
  ``summs_i = sum_j m_j * sum_32(q8)``, then the Q2_K combination with Q4_K's ``d`` and ``dmin``. (ds4's
  May tree had no CPU Q4_K dot and this was our definition; its later one, b0309611, has one:
  ``sumf += (y.d * f16(x.d)) * (float)isum + (-y.d * f16(x.dmin)) * (float)summs``, the same bits,
  since ``a + (-b)`` is ``a - b`` and ``(-y) * m`` is ``-(y * m)`` in IEEE arithmetic.)
* MXFP4 [ds4_vec_dot_mxfp4_f32]: no Q8_K here; float activations, ``sumf += (d * v) * y`` element by
  element from ``sumf = 0.0f`` in ds4's order (``mxfp4``'s docstring; ds4 runs it for GLM's experts and
  refuses MXFP4 on its DeepSeek CPU path, so for DeepSeek it is our choice).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

import numpy as np
import mlx.core as mx

from ds4_mlx.errors import InferenceError, LayoutError
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType
from ds4_mlx.formats.iq2xxs_tables import grid_bytes, sign_bits
from ds4_mlx.formats.quants import SIGNED_GRID_WORDS
from ds4_mlx.formats.quants_mlx import quantize_q8_k_activation_mlx
from ds4_mlx import native
from ds4_mlx.model import load_plan, metal_kernels, mxfp4
from ds4_mlx.model.host import to_host
from ds4_mlx.model.linear import Backend, resolve_backend
from ds4_mlx.model.ops import DS4_CHUNK_ELEMENTS, chunks

QK_K = 256

# The signed IQ2_XXS grid as float32 [256 * 128, 8]: row ``grid_index * 128 + sign_index`` (ds4's
# iq2xxs_signed_grid, the integers ±8, ±25, ±43).
_IQ2_SIGNED = mx.array(
    (grid_bytes().astype(np.float32)[:, None, :]
     * np.where(sign_bits() == 1, np.float32(-1), np.float32(1))[None, :, :]).reshape(256 * 128, 8)
)


def _f16_pair(b: mx.array, lo: int) -> mx.array:
    """The little-endian f16 stored at byte ``lo`` of each block (last axis), as float32."""
    bits = b[..., lo].astype(mx.uint16) | (b[..., lo + 1].astype(mx.uint16) << 8)
    return bits.view(mx.float16).astype(mx.float32)


def _iq2_xxs_parts(slabs: mx.array, n_in: int):
    """IQ2_XXS blocks uint8 [u, out, row_bytes] -> (signed grid float32 [u, out, nb*8, 32],
    ls = 2*(w>>28)+1 int32 [u, out, nb, 8], d float32 [u, out, nb])."""
    u, out_dim, _ = slabs.shape
    nb = n_in // QK_K
    b = slabs.reshape(u, out_dim, nb, 66)
    d = _f16_pair(b, 0)
    g = b[..., 2:].reshape(u, out_dim, nb, 8, 8)
    gidx = g[..., 0:4].astype(mx.uint32)  # [u, out, nb, 8, 4]
    w = (g[..., 4].astype(mx.uint32) | (g[..., 5].astype(mx.uint32) << 8)
         | (g[..., 6].astype(mx.uint32) << 16) | (g[..., 7].astype(mx.uint32) << 24))  # [u, out, nb, 8]
    sidx = (w[..., None] >> mx.array([0, 7, 14, 21], dtype=mx.uint32)) & 127
    rows = (gidx << 7) | sidx
    vals = mx.take(_IQ2_SIGNED, rows.reshape(-1), axis=0).reshape(u, out_dim, nb * 8, 32)
    ls = ((w >> 28) * 2 + 1).astype(mx.int32)
    return vals, ls, d


def _q2_k_parts(slabs: mx.array, n_in: int):
    """Q2_K blocks -> (w = (sc & 15) * q float32 [u, out, nb, 256], m = sc >> 4 float32 [u, out, nb, 16],
    d, dmin float32 [u, out, nb])."""
    u, out_dim, _ = slabs.shape
    nb = n_in // QK_K
    b = slabs.reshape(u, out_dim, nb, 84)
    sc = b[..., 0:16]
    qs = b[..., 16:80].reshape(u, out_dim, nb, 2, 1, 32)
    q = (qs >> mx.array([0, 2, 4, 6], dtype=mx.uint8).reshape(4, 1)) & 3  # [u, out, nb, 2, 4, 32]
    # element 128h + 32j + l has sub-block scale index 8h + 2j + l // 16
    q = q.reshape(u, out_dim, nb, 16, 16)
    w = (q * (sc & 15)[..., None]).astype(mx.float32).reshape(u, out_dim, nb, QK_K)
    m = (sc >> 4).astype(mx.float32)
    return w, m, _f16_pair(b, 80), _f16_pair(b, 82)


def _q4_k_parts(slabs: mx.array, n_in: int):
    """Q4_K blocks -> (nibbles float32 [u, out, nb*8, 32], sc int32 [u, out, nb, 8], m float32 [u, out, nb, 8],
    d, dmin float32 [u, out, nb])."""
    u, out_dim, _ = slabs.shape
    nb = n_in // QK_K
    b = slabs.reshape(u, out_dim, nb, 144)
    s = b[..., 4:16].astype(mx.uint32)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = mx.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1).astype(mx.int32)
    m = mx.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1).astype(mx.float32)
    qs = b[..., 16:144].reshape(u, out_dim, nb, 4, 1, 32)
    nib = (qs >> mx.array([0, 4], dtype=mx.uint8).reshape(2, 1)) & 15  # [u, out, nb, 4, 2, 32]
    nib = nib.astype(mx.float32).reshape(u, out_dim, nb * 8, 32)
    return nib, sc, m, _f16_pair(b, 0), _f16_pair(b, 2)


class ExpertCache:
    """LRU of dequantized float32 experts shared by every ``ExpertWeights`` of the process.

    Only the DEFAULT MLX-ops path uses it (the Metal kernels read raw blocks, DS4_CPU re-reads them): on the
    CPU backend, dequantizing the selected experts costs far more than the matmuls, and a decode step of a
    small model revisits the same experts constantly. The budget is in bytes of float32 weights; 0
    disables it. ``EXPERT_CACHE`` starts at the default 1024 MiB; a load sizes it from its plan
    (``configure``: ``DS4_MLX_EXPERT_CACHE_MB``, read by ``load_plan``).

    A pipeline rank (``model/pipeline.py``) runs only its own layers, so it only ever fills the cache
    with their experts; with the default budget it also gets only its share of it (``scale_default``).
    """

    def __init__(self, limit_bytes: int, explicit: bool = True):
        self.limit_bytes = int(limit_bytes)
        self.default_bytes = self.limit_bytes
        self.explicit = explicit  # False: the default budget, which ``scale_default`` may scale
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[tuple[int, int], mx.array] = OrderedDict()

    def get(self, key: tuple[int, int]) -> mx.array | None:
        w = self._items.get(key)
        if w is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return w

    def put(self, key: tuple[int, int], w: mx.array) -> None:
        size = w.nbytes
        if size > self.limit_bytes:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._items[key] = w
        self.nbytes += size
        while self.nbytes > self.limit_bytes:
            _, dropped = self._items.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def planned_bytes(self, limit_bytes: int, explicit: bool) -> int:
        """The budget ``configure(limit_bytes, explicit)`` leaves (before any ``scale_default``)."""
        return int(limit_bytes) if explicit or not self.explicit else self.limit_bytes

    def configure(self, limit_bytes: int, explicit: bool) -> None:
        """Size the cache from a load's plan: ``explicit`` (the user's ``DS4_MLX_EXPERT_CACHE_MB``)
        replaces any budget; the default replaces only a default one, so a program's ``set_limit``
        stands. A default budget is the one ``scale_default`` scales from."""
        if explicit or not self.explicit:
            self.limit_bytes = self.default_bytes = int(limit_bytes)
            self.explicit = bool(explicit)
            self._shrink()

    def set_limit(self, limit_bytes: int) -> None:
        self.limit_bytes = int(limit_bytes)
        self.explicit = True
        self._shrink()

    def scale_default(self, share: float) -> None:
        """A process that holds ``share`` [0, 1] of the model's routed-expert bytes (a pipeline rank):
        the default budget becomes that share of itself; an explicit budget (the environment variable,
        ``set_limit``) is kept. Why: the one-process cache is one LRU over every layer's experts, so
        each layer gets about budget / layers of it; a rank with that share of the layers and of the
        budget keeps the same per-layer budget (the same hit rate), and the ranks together hold what
        one process holds, instead of the default budget each (2 GiB on two ranks)."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"a share of the routed experts must be in [0, 1], got {share!r}")
        if self.explicit:
            return
        self.limit_bytes = int(self.default_bytes * share)
        self._shrink()

    def _shrink(self) -> None:
        while self._items and self.nbytes > self.limit_bytes:
            _, dropped = self._items.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0


# one LRU per process, at the default budget until a load sizes it from its plan (``configure``)
EXPERT_CACHE = ExpertCache(load_plan.EXPERT_CACHE_DEFAULT_MB * load_plan.MIB, explicit=False)


class _LastHostInput(threading.local):
    """The last expert input read to the host for the native products, keyed by the caller's MLX array
    (identity) and the form read. A MoE's gate and up experts multiply the same input array: the second
    call reuses the first's host copy instead of waiting on the device again (one sync less per routed
    layer: 22 -> 16 per decoded token on the tiny model). Holding the key array keeps its id from being
    reused while the entry lives; MLX arrays are immutable, so a hit is always the same values. One
    entry per thread: models on two threads never see each other's inputs."""

    def __init__(self):
        self.entry: tuple[mx.array, str, np.ndarray] | None = None

    def get(self, src: mx.array, form: str, read) -> np.ndarray:
        e = self.entry
        if e is not None and e[0] is src and e[1] == form:
            return e[2]
        value = read()
        self.entry = (src, form, value)
        return value


_HOST_INPUT = _LastHostInput()


def routed_share(gguf_file, layers: range) -> float:
    """The share of the file's routed-expert bytes (``blk.N.ffn_*_exps.*``) in ``layers``; 1.0 when
    the file has none."""
    own = total = 0
    for name in gguf_file.tensors:
        parts = name.split(".")
        if len(parts) < 3 or parts[0] != "blk" or not parts[2].endswith("_exps"):
            continue
        nbytes = int(gguf_file.tensor(name).nbytes)
        total += nbytes
        if parts[1].isdigit() and int(parts[1]) in layers:
            own += nbytes
    return own / total if total else 1.0

def routed_resident_nbytes(qtype: GGMLType | int, shape: tuple[int, int, int], *, device: bool,
                           lru_bytes: int) -> int:
    """Bytes of memory an expert tensor (n_expert, out, in) holds beyond the mapping: its raw blocks
    copied into MLX memory when ``device`` (``DeviceExpertWeights``), plus the dequantized float32
    experts the LRU keeps, at most ``lru_bytes`` (the tensor's share of ``EXPERT_CACHE``'s budget, 0
    for an arithmetic that keeps none: ds4-cpu's and the native products re-read the mapping, the
    raw-block kernels read the blocks) and at most the whole tensor as float32. A pipeline split by
    these bytes (``model/pipeline.py``) weighs a layer by what it holds."""
    n_expert, out_dim, n_in = (int(d) for d in shape)
    elems, block_bytes = BLOCK_GEOMETRY[GGMLType(qtype)]
    resident = n_expert * out_dim * (n_in // elems) * block_bytes if device else 0
    return resident + min(int(lru_bytes), 4 * n_expert * out_dim * n_in)


# Dequantized float32 weights alive at once in one call of the CPU path (the default of an
# ``ExpertWeights``' ``group_bytes``; a load passes its plan's, ``DS4_MLX_EXPERT_GROUP_MB``). A
# 2048-token prefill chunk selects every expert (256 x 32 MiB = 8 GiB per projection at the real
# dims) and MLX's lazy graph would hold them all until the end of the call; evaluating group by
# group bounds the peak.
DENSE_GROUP_BYTES = load_plan.EXPERT_GROUP_DEFAULT_MB * load_plan.MIB
_instance_ids = itertools.count()


def check_expert_call(name: str, shape: tuple[int, int, int], x: mx.array, ids) -> np.ndarray:
    """The ids of a call ``e(x, ids)`` on a ``shape`` = (n_expert, out, in) expert tensor as int64
    [T, k], after checking x [T, 1|k, in] and every id against the tensor (one-line ``LayoutError``)."""
    n_expert, _, n_in = shape
    ids_np = to_host(ids).astype(np.int64, copy=False)
    if ids_np.ndim != 2:
        raise LayoutError(f"tensor {name!r}: expert ids must be [T, k], got shape {ids_np.shape}")
    T, k = ids_np.shape
    if x.ndim != 3 or x.shape[0] != T or x.shape[1] not in (1, k) or x.shape[2] != n_in:
        raise LayoutError(f"tensor {name!r}: input shape {tuple(x.shape)} does not fit ids {ids_np.shape} "
                          f"(expected [{T}, 1 or {k}, {n_in}])")
    if ids_np.size and (ids_np.min() < 0 or ids_np.max() >= n_expert):
        raise LayoutError(f"tensor {name!r}: expert id outside 0..{n_expert - 1} "
                          f"(got {int(ids_np.min())}..{int(ids_np.max())})")
    return ids_np


class ExpertWeights:
    """A 3-D routed-expert tensor ``(n_expert, out, in)``, kept as a zero-copy view of the mmap."""

    SUPPORTED_TYPES = (GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.MXFP4)

    def __init__(
        self,
        name: str,
        qtype: GGMLType,
        raw: np.ndarray,
        n_in: int,
        backend: "Backend | str | None" = None,
        use_kernels: bool | str | None = None,
        native: bool | None = None,
        group_bytes: int = DENSE_GROUP_BYTES,
    ):
        qtype = GGMLType(qtype)
        if qtype not in self.SUPPORTED_TYPES:
            raise LayoutError(f"tensor {name!r}: type {qtype.name} is not a routed-expert type "
                              "(IQ2_XXS, Q2_K, Q4_K, MXFP4)")
        if raw.ndim != 3:
            raise LayoutError(f"tensor {name!r}: expected a 3-D expert tensor, got shape {raw.shape}")
        elems, block_bytes = BLOCK_GEOMETRY[qtype]
        if n_in % elems or raw.shape[2] != n_in // elems * block_bytes:
            raise LayoutError(f"tensor {name!r}: {qtype.name} rows of {raw.shape[2]} bytes do not hold {n_in} values")
        self.name = name
        self.qtype = qtype
        self.raw = raw
        self.shape = (int(raw.shape[0]), int(raw.shape[1]), int(n_in))
        self.backend = resolve_backend(backend)
        # ``use_kernels``: a dialect ("metal" / "cuda", the load plan's ``kernels``), True (the
        # backend's own, Metal's on the CPU backend), None/False (the default: the MLX-ops twins /
        # dequantized experts). Nothing here asks the machine: the loader passes its plan's.
        if use_kernels is None:
            use_kernels = False
        if use_kernels is True:
            use_kernels = load_plan.kernel_dialect(self.backend.value) or "metal"
        if use_kernels not in (False, *metal_kernels.DIALECTS):
            raise LayoutError(f"tensor {name!r}: use_kernels={use_kernels!r}; expected a bool or one of "
                              f"{list(metal_kernels.DIALECTS)}")
        self.kernel_dialect: str | None = use_kernels or None
        self.use_kernels = bool(use_kernels)
        # None: the native library when it builds (decided at the first host call), False: the MLX path
        self.native = native
        if not isinstance(group_bytes, int) or group_bytes < 1:
            raise LayoutError(f"tensor {name!r}: group_bytes={group_bytes!r}; expected an integer >= 1")
        self.group_bytes = group_bytes  # float32 experts dequantized at once (``_dense_pairs``)
        self.cache = EXPERT_CACHE
        self._key = next(_instance_ids)
        self.reset_counters()

    @classmethod
    def from_gguf(cls, gguf_file, name: str, backend: "Backend | str | None" = None,
                  use_kernels: bool | str | None = None, **options) -> "ExpertWeights":
        """The GGUF tensor ``name``; ``options``: the constructor's other keywords (``group_bytes``)."""
        info = gguf_file.tensor(name)
        if len(info.shape) != 3:
            raise LayoutError(f"tensor {name!r}: expected a 3-D expert tensor, got shape {info.shape}")
        return cls(name, info.ggml_type, gguf_file.tensor_array(name), info.shape[2], backend, use_kernels,
                   **options)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's slab in the GGUF."""
        return int(self.raw.shape[1] * self.raw.shape[2])

    def reset_counters(self) -> None:
        """Zero the counters: ``bytes_read`` (bytes copied out of the mmap), ``bytes_selected`` (GGUF bytes
        of the distinct experts each call selected: what a kernel streams), ``calls``, ``pairs``."""
        self.bytes_read = 0
        self.bytes_selected = 0
        self.calls = 0
        self.pairs = 0

    def _native_lib(self):
        """The native library for this tensor's host calls, or None for the MLX-ops path. Only a tensor
        whose slabs are ``raw`` itself (``_read`` not overridden: not the device strategy) goes native."""
        if self.native is False or type(self)._read is not ExpertWeights._read:
            return None
        if self.raw.dtype != np.uint8 or self.raw.strides[2] != 1:
            return None  # the C code walks whole rows of bytes; any other view takes the MLX path
        lib = native.library()
        if lib is None and self.native:
            raise InferenceError(f"tensor {self.name!r}: native experts requested but unavailable "
                               f"({native.status()['reason']})")
        return lib

    def _native_pairs(self, lib, uniq: np.ndarray, x_rows: mx.array, slot: np.ndarray, rows: np.ndarray,
                      ds4: bool, src: mx.array) -> mx.array:
        """The pairs through the native library, reading the slabs of ``uniq`` in place."""
        _, out_dim, n_in = self.shape
        order = np.argsort(slot, kind="stable")
        bounds = np.searchsorted(slot[order], np.arange(uniq.size + 1))
        self.bytes_read += int(uniq.size) * self.expert_nbytes  # read in place, once each
        # One host read per input (the ids are on the host already): a MoE's gate and up calls share
        # theirs (``_HOST_INPUT``), so a decode step's syncs are 1 + routed layers * (1 + 2).
        if ds4 and self.qtype == GGMLType.MXFP4:  # ds4's MXFP4 dot takes the float activation
            y = native.pairs_ds4_f32(lib, int(self.qtype), self.raw, n_in, uniq, bounds, order, rows,
                                     _HOST_INPUT.get(src, "f32", lambda: to_host(x_rows)))
        elif ds4:
            def read():
                xq, xd = quantize_q8_k_activation_mlx(x_rows)
                # codes and scales in one read: the scales' bytes ride behind each row's codes
                return to_host(mx.concatenate([xq, mx.view(xd, mx.int8)], axis=1))
            both = _HOST_INPUT.get(src, "q8_k", read)
            y = native.pairs_ds4(lib, int(self.qtype), self.raw, n_in, uniq, bounds, order, rows,
                                 both[:, :n_in], both[:, n_in:].view(np.float32), SIGNED_GRID_WORDS)
        else:
            y = native.pairs_f32(lib, int(self.qtype), self.raw, n_in, uniq, bounds, order, rows,
                                 _HOST_INPUT.get(src, "f32", lambda: to_host(x_rows)), SIGNED_GRID_WORDS)
        return mx.array(y)

    def _read(self, experts: np.ndarray) -> np.ndarray:
        """Copy the slabs of ``experts`` out of the mmap (only their bytes are touched)."""
        slabs = np.take(self.raw, experts, axis=0)
        self.bytes_read += int(slabs.nbytes)
        return slabs

    def dense_experts(self, experts: np.ndarray) -> list[mx.array]:
        """float32 [out, in] matrices of ``experts``, through the shared cache (misses read and dequantize)."""
        ws: list[mx.array | None] = [self.cache.get((self._key, int(e))) for e in experts]
        missing = [i for i, w in enumerate(ws) if w is None]
        if missing:
            slabs = self._read(experts[missing])
            if self.cache.limit_bytes > 0:
                # one buffer per expert, so evicting one frees exactly its bytes
                for j, i in enumerate(missing):
                    w = mxfp4.expert_rows_mlx(mx.array(slabs[j]), self.qtype)
                    ws[i] = w
                    self.cache.put((self._key, int(experts[i])), w)
            else:
                dense = mxfp4.expert_rows_mlx(mx.array(slabs), self.qtype)
                for j, i in enumerate(missing):
                    ws[i] = dense[j]
        return ws  # type: ignore[return-value]

    # -- the call -----------------------------------------------------------------------------------

    def __call__(self, x: mx.array, ids) -> mx.array:
        """x [T, k|1, in], ids [T, k] -> [T, k, out] in DEFAULT numerics: the raw-block kernels
        (``use_kernels``) or the cached dequantized experts."""
        return self._apply(x, ids, self._kernel_pairs if self.use_kernels else self._dense_pairs)

    def ds4_cpu(self, x: mx.array, ids) -> mx.array:
        """The same with ds4.c's CPU expert arithmetic (module docstring), on the CPU stream."""
        with mx.stream(mx.cpu):
            return self._apply(x, ids, self._ds4_cpu_pairs)

    def _apply(self, x: mx.array, ids, multiply) -> mx.array:
        """Check the call, group its token-expert pairs by expert and count them; ``multiply(uniq,
        x_rows, slot, rows, x)`` -> [T*k, out] does the arithmetic (``x``: the caller's array, whose
        identity lets the native path read an input shared by two calls once)."""
        n_expert, out_dim, n_in = self.shape
        ids_np = check_expert_call(self.name, self.shape, x, ids)
        T, k = ids_np.shape
        if x.dtype != mx.float32:
            x = x.astype(mx.float32)
        if ids_np.size == 0:
            return mx.zeros((T, k, out_dim), dtype=mx.float32)
        kx = x.shape[1]
        uniq, slot = np.unique(ids_np.reshape(-1), return_inverse=True)
        rows = np.arange(T * k, dtype=np.int64)
        rows = rows if kx == k else rows // k  # the input row of pair t*k + j
        slot = slot.reshape(-1)
        self.bytes_selected += int(uniq.size) * self.expert_nbytes
        self.calls += 1
        self.pairs += T * k
        y = multiply(uniq, x.reshape(T * kx, n_in), slot, rows, x)
        return y.reshape(T, k, out_dim)

    def _kernel_pairs(self, uniq: np.ndarray, x_rows: mx.array, slot: np.ndarray, rows: np.ndarray,
                      src: mx.array) -> mx.array:
        return metal_kernels.expert_matmul_kernel(mx.array(self._read(uniq)), self.qtype, x_rows, slot, rows,
                                                  dialect=self.kernel_dialect)

    def _dense_pairs(self, uniq: np.ndarray, x_rows: mx.array, slot: np.ndarray, rows: np.ndarray,
                     src: mx.array) -> mx.array:
        """``expert_matmul_dense`` over groups of experts holding at most ``group_bytes`` of float32
        weights each, evaluated one group at a time. Every expert still sees exactly its own pairs in
        the same order, so the GEMMs (and the bits) are those of the ungrouped call."""
        lib = self._native_lib()
        if lib is not None:
            return self._native_pairs(lib, uniq, x_rows, slot, rows, ds4=False, src=src)
        per_expert = self.shape[1] * self.shape[2] * 4
        group = max(1, self.group_bytes // per_expert)
        if uniq.size <= group and uniq.size == slot.size:
            # One pair per expert (a decode step: one token's k distinct experts): the same
            # [1, in] x [in, out] products as expert_matmul_dense, made in pair order, so no gather
            # (and no index array from the host) undoes the grouping. mx.gather_mm measured slower
            # here: it needs the selected experts stacked into one array, a copy per call.
            ws = self.dense_experts(uniq)
            return mx.concatenate([mx.matmul(x_rows[int(r)][None], ws[int(s)].T) for s, r in zip(slot, rows)],
                                  axis=0)
        if uniq.size <= group:
            return metal_kernels.expert_matmul_dense(self.dense_experts(uniq), x_rows, slot, rows)
        pieces, pair_ids = [], []
        for g0 in range(0, uniq.size, group):
            members = np.flatnonzero((slot >= g0) & (slot < g0 + group))
            y = metal_kernels.expert_matmul_dense(self.dense_experts(uniq[g0:g0 + group]), x_rows,
                                                  slot[members] - g0, rows[members])
            mx.eval(y)
            pieces.append(y)
            pair_ids.append(members)
        order = np.concatenate(pair_ids)
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        return mx.take(mx.concatenate(pieces, axis=0), mx.array(inverse), axis=0)

    # -- DS4_CPU ------------------------------------------------------------------------------------

    def _ds4_cpu_pairs(self, uniq: np.ndarray, x_rows: mx.array, slot: np.ndarray, rows: np.ndarray,
                       src: mx.array) -> mx.array:
        lib = self._native_lib()
        if lib is not None:
            return self._native_pairs(lib, uniq, x_rows, slot, rows, ds4=True, src=src)
        return self._ds4_pairs(mx.array(self._read(uniq)), x_rows, slot, rows)

    def _ds4_pairs(self, slabs: mx.array, x_rows: mx.array, slot: np.ndarray, rows: np.ndarray) -> mx.array:
        """Pairs p = (expert slab slot[p], input row rows[p]) -> [P, out] with ds4's CPU arithmetic."""
        _, out_dim, n_in = self.shape
        if self.qtype == GGMLType.MXFP4:  # float activations, one sequential sum (``mxfp4``)
            order, bounds, inverse = metal_kernels.pair_order(slot)
            # pairs per piece: the scan's loop then holds [pairs, out] (a few pieces of the bound); a
            # piece short enough for one cumsum holds [pairs, out, in] with pairs * out < 4096
            pieces = mxfp4.ds4_pairs(slabs, x_rows, order, bounds, rows, max(1, DS4_CHUNK_ELEMENTS // out_dim))
            return mx.take(mx.concatenate(pieces, axis=0), mx.array(inverse), axis=0)
        xq, xd = quantize_q8_k_activation_mlx(x_rows)  # int8 [R, in], float32 [R, nb]
        xq = xq.astype(mx.float32)
        if self.qtype == GGMLType.IQ2_XXS:
            parts_of, fn = _iq2_xxs_parts, _ds4_iq2_xxs
        elif self.qtype == GGMLType.Q2_K:
            parts_of, fn = _q2_k_parts, _ds4_q2_k
        else:
            parts_of, fn = _q4_k_parts, _ds4_q4_k
        order, bounds, inverse = metal_kernels.pair_order(slot)
        # rows per chunk so the largest temporary, [sub-blocks, rows, out], stays below the bound
        step = max(1, DS4_CHUNK_ELEMENTS // ((n_in // 32) * out_dim))
        many = len(bounds) > 2 or len(slot) > step
        pieces = []
        for s in range(len(bounds) - 1):
            sel = order[bounds[s]:bounds[s + 1]]
            # One expert's parts at a time, evaluated before the next: all selected experts' parts at
            # once held 32 MiB of float32 per expert and more at the real dims (+1.3 GiB peak for a
            # 4-token prefill's 24 experts). The same elementwise arithmetic: the same bits.
            w = tuple(p[0] for p in parts_of(slabs[s:s + 1], n_in))
            for a, b in chunks(len(sel), step):
                r = mx.array(rows[sel[a:b]])
                pieces.append(fn(w, mx.take(xq, r, axis=0), mx.take(xd, r, axis=0)))
                if many:
                    mx.eval(pieces[-1])
        y_sorted = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)
        return mx.take(y_sorted, mx.array(inverse), axis=0)


def _ds4_iq2_xxs(w, xq: mx.array, xd: mx.array) -> mx.array:
    vals, ls, d = w  # [out, S, 32], [out, nb, 8], [out, nb]
    out_dim, S, _ = vals.shape
    nb = S // 8
    n = xq.shape[0]
    # per group of 32: |sum| <= 32 * 43 * 128 < 2**24, so the float32 matmul is exact
    sumi = mx.matmul(xq.reshape(n, S, 32).transpose(1, 0, 2), vals.transpose(1, 2, 0))  # [S, n, out]
    sumi = sumi.astype(mx.int32).reshape(nb, 8, n, out_dim)
    bsum = (sumi * ls.transpose(1, 2, 0)[:, :, None, :]).sum(axis=1)  # int32 [nb, n, out], exact
    bsum = bsum.astype(mx.float32)  # one rounding to nearest even, like ds4's (float)bsum
    sumf = mx.zeros((n, out_dim), dtype=mx.float32)
    for i in range(nb):
        sumf = sumf + (d[:, i][None, :] * xd[:, i:i + 1]) * bsum[i]  # (f16(x.d) * y.d) * (float)bsum
    return mx.array(0.125, dtype=mx.float32) * sumf


def _k_quant_accumulate(isum: mx.array, summs: mx.array, d: mx.array, dmin: mx.array, xd: mx.array) -> mx.array:
    """``sumf = 0; sumf += (y.d * f16(x.d)) * isum_i - (y.d * f16(x.dmin)) * summs_i`` over super-blocks i.

    ``isum``/``summs`` [nb, n, out] (integer valued, exact), ``d``/``dmin`` [out, nb], ``xd`` [n, nb].
    """
    nb, n, out_dim = isum.shape
    sumf = mx.zeros((n, out_dim), dtype=mx.float32)
    for i in range(nb):
        yd = xd[:, i:i + 1]
        dall = yd * d[:, i][None, :]
        dm = yd * dmin[:, i][None, :]
        sumf = sumf + (dall * isum[i] - dm * summs[i])
    return sumf


def _ds4_q2_k(w, xq: mx.array, xd: mx.array) -> mx.array:
    wq, m, d, dmin = w  # [out, nb, 256], [out, nb, 16], [out, nb], [out, nb]
    out_dim, nb, _ = wq.shape
    n = xq.shape[0]
    x3 = xq.reshape(n, nb, QK_K).transpose(1, 0, 2)  # [nb, n, 256]
    # |sum| <= 256 * 45 * 128 < 2**24: exact
    isum = mx.matmul(x3, wq.transpose(1, 2, 0))  # [nb, n, out]
    bsums = x3.reshape(nb, n, 16, 16).sum(axis=-1)  # |.| <= 2048, exact
    summs = mx.matmul(bsums, m.transpose(1, 2, 0))  # <= 16 * 2048 * 15: exact
    return _k_quant_accumulate(isum, summs, d, dmin, xd)


def _ds4_q4_k(w, xq: mx.array, xd: mx.array) -> mx.array:
    nib, sc, m, d, dmin = w  # [out, S, 32], [out, nb, 8], [out, nb, 8], [out, nb], [out, nb]
    out_dim, S, _ = nib.shape
    nb = S // 8
    n = xq.shape[0]
    x3 = xq.reshape(n, S, 32).transpose(1, 0, 2)  # [S, n, 32]
    sumi = mx.matmul(x3, nib.transpose(1, 2, 0))  # <= 32 * 15 * 128: exact
    sumi = sumi.astype(mx.int32).reshape(nb, 8, n, out_dim)
    isum = (sumi * sc.transpose(1, 2, 0)[:, :, None, :]).sum(axis=1)  # int32: can pass 2**24
    bsums = x3.sum(axis=-1).reshape(nb, 8, n).transpose(0, 2, 1)  # [nb, n, 8]
    summs = mx.matmul(bsums, m.transpose(1, 2, 0))  # <= 8 * 4096 * 63: exact
    return _k_quant_accumulate(isum.astype(mx.float32), summs, d, dmin, xd)
