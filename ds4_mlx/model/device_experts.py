"""The "device" expert strategy: expert blocks resident as MLX arrays, routing and expert ids on the device.

Two strategies run the routed experts (``ds4_mlx.load(path, experts=...)``):

* ``host`` (``experts.ExpertWeights``): the router's scores come back to numpy, the top-k is taken
  there, and the selected experts' slabs are copied out of the mmap and dequantized into a shared LRU.
  Nothing but the mmap holds the experts, so the resident memory stays small; every MoE layer of a
  decode step waits for the device (one host round trip per layer).
* ``device`` (``DeviceExpertWeights`` here): every expert tensor's raw GGUF blocks are copied once, at
  load, into an MLX array [n_expert, out, row_bytes]. The top-k (``topk_lowest_id``) and hash routing
  (``mx.take`` on the tid2eid table) run as MLX ops, and the expert ids stay MLX arrays: they index the
  blocks with ``mx.take`` and feed the matvec kernel of the load plan's dialect (Metal or CUDA) or,
  without one, the MLX-ops twin (gather the k blocks, dequantize them with ``mxfp4.expert_rows_mlx``,
  one batched matvec). A decode step is then one graph with no host break (``DeviceRouting``:
  ``compiled_decode`` traces the whole layer, ``Block.__call__``).

Cost of ``device``: the expert bytes are resident in MLX memory (on top of the mmap's page cache), i.e.
the GGUF's routed-expert bytes, ``expert_bytes_resident``: ~80 GiB for DS4 Flash's 2-bit file, all of
the tiny test model's ~10 MiB. On a GPU that is the price of having the weights where the arithmetic
runs; on MLX's CPU backend it buys little (host and device share one memory and one set of cores, a
host round trip costs microseconds) and doubles the expert memory, and the twin dequantizes the k
selected experts on every step where the host strategy's LRU keeps them dequantized. So ``auto``
picks ``device`` on a GPU backend (Metal, CUDA) and ``host`` on the CPU (``load_plan.resolve`` decides).

Numerics. DEFAULT: float activations times the dequantized blocks (the host path's arithmetic; the
batched matvec may round its dot products differently in the last bits). DS4_CPU: the ids come from the
same exact top-k (ties go to the lower expert id, as ds4's insertion top-k with strict '>'), then the
call goes through ``ExpertWeights``' integer-exact ds4 arithmetic on blocks taken from the resident
array, so both strategies give identical bits (that mode is never compiled and syncs where it likes).

A prefill chunk of many tokens selects most experts; there the pairs are grouped by expert on the host
(one sync per layer, as the host strategy) so each selected expert is dequantized once, not once per pair.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import LayoutError
from ds4_mlx.model import load_plan, metal_kernels, mxfp4
from ds4_mlx.model.experts import ExpertWeights
from ds4_mlx.model.host import to_host

STRATEGIES = load_plan.STRATEGIES  # the ``experts=`` choices; the plan resolves "auto"

# Up to this many token-expert pairs a call gathers and dequantizes one block per pair on the device
# (a decode step: k pairs). Beyond it (a prefill chunk), pairs are grouped by expert on the host so
# each selected expert is dequantized once.
DEVICE_MAX_PAIRS = 16


def topk_lowest_id(scores: mx.array, k: int) -> mx.array:
    """Indices int32 [T, k] of the k largest scores per row, best first, ties to the lower index.

    ds4's top-k (an insertion sort with strict '>') and the host strategy's stable argsort of the
    negated scores pick exactly these. k passes of (max, lowest index holding it, mask it out): every
    step is an exact comparison, so the result is the same on every backend, unlike a sort whose
    tie order is unspecified. NaN scores rank last (numpy's order)."""
    T, n = scores.shape
    if not 0 < k <= n:
        raise LayoutError(f"top-k of {k} among {n} experts")
    idx = mx.arange(n, dtype=mx.int32)[None, :]
    s = mx.where(mx.isnan(scores), -mx.inf, scores)
    picks = []
    for i in range(k):
        m = mx.max(s, axis=1, keepdims=True)
        j = mx.min(mx.where(s == m, idx, n), axis=1, keepdims=True)
        # a row of only -inf left (never for a router: its scores are finite) still yields an id in range
        j = mx.minimum(j, n - 1)
        picks.append(j)
        if i + 1 < k:
            s = mx.where(idx == j, -mx.inf, s)
    return mx.concatenate(picks, axis=1).astype(mx.int32)


class DeviceRouting:
    """Expert ids chosen on the device (``MoE.routing`` for the device strategy's resident experts):
    MLX arrays the expert matvecs index without a host read, so a decode step has no host break."""

    name = "device"

    @staticmethod
    def table(tid2eid: np.ndarray) -> mx.array:
        """A hash layer's tid2eid [n_vocab, k] as the int32 MLX array ``select`` gathers from."""
        return mx.array(np.ascontiguousarray(tid2eid, dtype=np.int32))

    @staticmethod
    def select(choice: mx.array | None, table: mx.array | None, tokens, k: int) -> mx.array:
        """int32 [T, k]: ``table[tokens]`` (hash layers; ``tokens`` numpy or an MLX array), else the
        top-k of ``choice`` (``topk_lowest_id``)."""
        if table is not None:
            toks = tokens if isinstance(tokens, mx.array) else mx.array(np.asarray(tokens, dtype=np.int32))
            return mx.take(table, toks.reshape(-1).astype(mx.int32), axis=0)
        return topk_lowest_id(choice, k)


DEVICE_ROUTING = DeviceRouting()


class DeviceExpertWeights(ExpertWeights):
    """``ExpertWeights`` whose raw blocks live in an MLX array and whose ``__call__`` takes expert ids as
    an MLX array without reading them on the host (see the module docstring)."""

    def __init__(self, name, qtype, raw: np.ndarray, n_in: int, backend=None, use_kernels=None, **options):
        super().__init__(name, qtype, raw, n_in, backend, use_kernels, **options)
        self.blocks = mx.array(np.ascontiguousarray(raw))  # [n_expert, out, row_bytes] uint8, a copy
        mx.eval(self.blocks)  # pay the copy at load, not inside the first decode step

    @property
    def resident_nbytes(self) -> int:
        """Bytes this tensor holds in MLX memory (all experts' raw blocks)."""
        return int(self.blocks.nbytes)

    def _read(self, experts: np.ndarray) -> mx.array:
        # The resident blocks of ``experts`` (a device gather, not a copy out of the mmap: bytes_read
        # stays 0). ExpertWeights' grouped, kernel and ds4-cpu paths take their slabs from here.
        return mx.take(self.blocks, mx.array(np.asarray(experts, dtype=np.int32)), axis=0)

    def __call__(self, x: mx.array, ids) -> mx.array:
        """x [T, k|1, in], ids [T, k] (MLX int array, or numpy) -> [T, k, out] in DEFAULT numerics.

        Up to ``DEVICE_MAX_PAIRS`` pairs with MLX ids: all on the device, nothing read back (MLX ids are
        the router's, in range by construction; numpy ids are range-checked here). Larger calls go
        through ``ExpertWeights``' grouping on the host."""
        n_expert, out_dim, n_in = self.shape
        if not isinstance(ids, mx.array):
            ids_np = to_host(ids)
            if ids_np.size and (ids_np.min() < 0 or ids_np.max() >= n_expert):
                raise LayoutError(f"tensor {self.name!r}: expert id outside 0..{n_expert - 1} "
                                  f"(got {int(ids_np.min())}..{int(ids_np.max())})")
            ids = mx.array(ids_np.astype(np.int32))
        if ids.ndim != 2:
            raise LayoutError(f"tensor {self.name!r}: expert ids must be [T, k], got shape {tuple(ids.shape)}")
        if not mx.issubdtype(ids.dtype, mx.integer):
            raise LayoutError(f"tensor {self.name!r}: expert ids must be integers, got {ids.dtype}")
        T, k = ids.shape
        if x.ndim != 3 or x.shape[0] != T or x.shape[1] not in (1, k) or x.shape[2] != n_in:
            raise LayoutError(f"tensor {self.name!r}: input shape {tuple(x.shape)} does not fit ids {(T, k)} "
                              f"(expected [{T}, 1 or {k}, {n_in}])")
        if T * k > DEVICE_MAX_PAIRS:
            return super().__call__(x, ids)  # reads the ids: a prefill chunk, grouped by expert
        if x.dtype != mx.float32:
            x = x.astype(mx.float32)
        P = T * k
        if P == 0:
            return mx.zeros((T, k, out_dim), dtype=mx.float32)
        # Counted per call; inside a compiled step the body runs at trace time only.
        self.calls += 1
        self.pairs += P
        self.bytes_selected += P * self.expert_nbytes  # a token's k experts are distinct
        slot = ids.reshape(P).astype(mx.int32)
        return matvec_pairs(self.blocks, self.qtype, x, slot, self.kernel_dialect).reshape(T, k, out_dim)


def matvec_pairs(blocks: mx.array, qtype, x: mx.array, slot: mx.array, dialect: str | None) -> mx.array:
    """x [T, 1 or k, n_in] times the blocks at ``slot`` [T*k] (one expert's rows per token-expert
    pair, in pair order) -> [T*k, out]: the matvec kernel in ``dialect`` ("metal" / "cuda", the load
    plan's ``kernels``), or with None its MLX-ops twin.
    ``blocks``: every expert's (``DeviceExpertWeights``) or a bounded cache's slots (``expert_cache``)."""
    T, P, n_in = x.shape[0], slot.shape[0], x.shape[-1]
    x_rows = (x if x.shape[1] * T == P else mx.broadcast_to(x, (T, P // T, n_in))).reshape(P, n_in)
    if dialect:
        return metal_kernels.expert_matvec_kernel_ids(blocks, qtype, x_rows, slot, mx.arange(P, dtype=mx.int32),
                                                      dialect=dialect)
    return expert_matvec_twin_ids(blocks, qtype, x_rows, slot)


def expert_matvec_twin_ids(blocks: mx.array, qtype, x_rows: mx.array, slot: mx.array) -> mx.array:
    """MLX-ops twin of the matvec kernel with device ids: y[p] = dequant(blocks[slot[p]]) @ x_rows[p]
    -> float32 [P, out]. Dequantizes the P gathered blocks (one per pair: meant for a few pairs).

    The dot products are an elementwise product and a row sum, not a batched matmul: a row sum's
    order depends on the row's length only, so each pair's bits are the same whatever the other
    pairs of the call are (expert parallelism replaces foreign pairs and relies on that). A BLAS
    gemv chooses its own order per kernel family and thread split (it held on one machine's
    OpenBLAS and not on another's)."""
    w = mxfp4.expert_rows_mlx(mx.take(blocks, slot, axis=0), qtype)  # [P, out, in]
    return mx.sum(w * x_rows[:, None, :], axis=-1)
