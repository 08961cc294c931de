"""The bounded device expert cache: the device strategy with at most ``n_slots`` experts per layer resident.

``ds4_mlx.load(path, experts="device", experts_cache=...)``. Unbounded, the device strategy
(``device_experts.DeviceExpertWeights``) copies every expert's raw blocks into MLX memory at load
(~77 GB for the q2 file). Bounded, each routed layer owns, per expert tensor (gate, up, down), one
fixed slot array ``slots`` uint8 [n_slots, out, row_bytes] allocated at load and never grown; slot
``s`` holds the same expert in the layer's three tensors (ds4's "expert triplet").

A call of the layer (one decoded token, or a prefill chunk):

1. the expert ids reach the host (one sync per MoE layer, as the host strategy: a miss needs a
   read from the mapping, so the layer cannot stay inside a host-free compiled graph;
   its MoEs route with ``host_step.HostRouting`` and the decode step is cut at the router);
2. the policy (``expert_cache_policy``, pure bookkeeping) assigns slots: hits pinned, misses to
   free slots or victims; the misses of all three tensors are read from the mapping in one batched
   copy per tensor and written into their slots at the gate call, before gate, up and down run;
3. decode: the matvec kernel (Metal) or its MLX-ops twin runs on the slot array with slot ids in
   place of expert ids: the unbounded path's arithmetic on the same blocks (each pair's bits do
   not depend on the other pairs: ``expert_matvec_twin_ids``); ds4-cpu and prefill chunks go
   through ``ExpertWeights``' grouped paths, whose ``_read`` here returns each expert's blocks from
   its slot or, when not admitted, from the mapping (a transient for the call).

Prefill. A chunk routes to most experts of a layer. It is not streamed through the slots (that
would evict the whole cache every chunk): the chunk's experts are taken grouped by expert (the
grouped paths), hits from the slots, the rest read from the mapping into one transient of at most
one expert tensor's blocks per call, and only the ``n_slots`` experts the chunk routed to most
are admitted (the warm-up preload: after a prompt the cache holds what it used most). The
transient is the prefill working set: at most one expert tensor of one layer in raw blocks plus
its construction copy (~2/3 of a layer's routed bytes), and DEFAULT numerics' dequantized groups
(``ExpertWeights.group_bytes``: the plan's ``DS4_MLX_EXPERT_GROUP_MB``, 512 MiB by default); no
dequantized expert is kept (``ExpertCache(0)``).
ds4 reserves two full layers for prefill; that is the slack stated for this working set
(``prefill_reserve_nbytes``).

Budget (``expert_budget``): slots per layer from ds4's N (a global count of expert triplets, split
evenly over the routed layers) or NGB (bytes, two full layers of it kept for prefill).

Counters (``CacheCounters``, summed over layers by ``ExpertCacheSet.counters``): ``hits`` and
``misses`` per accessed expert of a layer call, ``bytes_read`` from the mapping (slot loads and
transients).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import LayoutError
from ds4_mlx.model.device_experts import DEVICE_MAX_PAIRS, DeviceExpertWeights, matvec_pairs
from ds4_mlx.model.expert_budget import CachePlan
from ds4_mlx.model.expert_cache_policy import DEFAULT_POLICY, POLICIES, SlotPolicy, make_policy
from ds4_mlx.model.experts import ExpertCache, ExpertWeights, check_expert_call

@dataclass(frozen=True)
class CacheCounters:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0

    def __sub__(self, other: "CacheCounters") -> "CacheCounters":
        return CacheCounters(self.hits - other.hits, self.misses - other.misses, self.bytes_read - other.bytes_read)

    def __add__(self, other: "CacheCounters") -> "CacheCounters":
        return CacheCounters(self.hits + other.hits, self.misses + other.misses, self.bytes_read + other.bytes_read)

    @property
    def hit_rate(self) -> float | None:
        n = self.hits + self.misses
        return self.hits / n if n else None


class _Plan:
    """One layer call's slots: the distinct experts (sorted) and each one's slot (-1 = transient)."""

    __slots__ = ("uniq", "slots", "inverse")

    def __init__(self, uniq: np.ndarray, slots: np.ndarray, inverse: np.ndarray):
        self.uniq, self.slots, self.inverse = uniq, slots, inverse

    def slots_of(self, experts: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(self.uniq, experts)
        if np.any(pos >= self.uniq.size) or np.any(self.uniq[np.minimum(pos, self.uniq.size - 1)] != experts):
            raise LayoutError("expert cache: a tensor read experts its layer's call did not route to")
        return self.slots[pos]


class LayerExpertCache:
    """The slots of one routed layer, shared by its gate, up and down tensors (``register``)."""

    def __init__(self, layer: int, n_slots: int, n_expert: int, policy: str = DEFAULT_POLICY, **policy_kw):
        self.layer = int(layer)
        self.n_slots = int(n_slots)
        self.policy: SlotPolicy = make_policy(policy, n_slots, n_expert, **policy_kw)
        self.members: list["CachedDeviceExpertWeights"] = []
        self._last_ids = None  # the ids object of the last planned call (identity), kept alive
        self._last_plan: _Plan | None = None

    def register(self, w: "CachedDeviceExpertWeights") -> mx.array:
        """The zeroed slot array of ``w`` (allocated and evaluated now, at load)."""
        if w.shape[0] != self.policy.n_expert:
            raise LayoutError(f"tensor {w.name!r}: {w.shape[0]} experts, its layer's cache has "
                              f"{self.policy.n_expert}")
        self.members.append(w)
        slots = mx.zeros((self.n_slots, int(w.raw.shape[1]), int(w.raw.shape[2])), dtype=mx.uint8)
        mx.eval(slots)
        return slots

    @property
    def nbytes(self) -> int:
        return sum(int(m.slots.nbytes) for m in self.members)

    @property
    def bytes_read(self) -> int:
        return sum(m.bytes_read for m in self.members)

    def counters(self) -> CacheCounters:
        return CacheCounters(self.policy.hits, self.policy.misses, self.bytes_read)

    def plan(self, ids) -> _Plan:
        """The slots of the call whose expert ids are ``ids`` ([T, k]); the layer's three tensors
        pass the same ids object, so the first call (gate) plans, loads the misses of all three
        tensors, and the other two reuse it."""
        if ids is self._last_ids and self._last_plan is not None:
            return self._last_plan
        ids_np = np.asarray(ids.tolist() if isinstance(ids, mx.array) else ids).astype(np.int64, copy=False)
        uniq, inverse, counts = np.unique(ids_np.reshape(-1), return_inverse=True, return_counts=True)
        acc = self.policy.access(uniq, counts)
        if acc.load_experts.size:
            idx = mx.array(acc.load_slots.astype(np.int32))
            for m in self.members:
                m._load(acc.load_experts, idx)
            # evaluated now: the writes land in place (nothing else holds the old buffers), and the
            # prefill path reads the slots through numpy
            mx.eval(*[m.slots for m in self.members])
        self._last_ids, self._last_plan = ids, _Plan(uniq, acc.slots, inverse.reshape(-1))
        return self._last_plan

    def forget_call(self) -> None:
        self._last_ids = self._last_plan = None


def check_policy(policy) -> str:
    """``policy`` if it names a replacement policy, else a one-line ``LayoutError``."""
    if not isinstance(policy, str) or policy not in POLICIES:
        raise LayoutError(f"unknown expert cache policy {policy!r}; expected one of {list(POLICIES)}")
    return policy


class ExpertCacheSet:
    """Every routed layer's ``LayerExpertCache`` of a model (``Model.expert_cache``) and its plan."""

    def __init__(self, plan: CachePlan, policy: str = DEFAULT_POLICY, **policy_kw):
        check_policy(policy)
        self.plan = plan
        self.policy = policy
        self.policy_kw = policy_kw
        self.layers: dict[int, LayerExpertCache] = {}

    def layer(self, il: int) -> LayerExpertCache:
        c = self.layers.get(il)
        if c is None:
            c = self.layers[il] = LayerExpertCache(il, self.plan.slots, self.plan.n_expert, self.policy,
                                                   **self.policy_kw)
        return c

    @property
    def n_slots(self) -> int:
        return int(self.plan.slots)

    @property
    def nbytes(self) -> int:
        """Bytes the slot arrays hold (fixed from load on)."""
        return sum(c.nbytes for c in self.layers.values())

    def counters(self) -> CacheCounters:
        total = CacheCounters()
        for c in self.layers.values():
            total = total + c.counters()
        return total

    def describe(self) -> str:
        return (f"{self.n_slots} of {self.plan.n_expert} experts per layer resident "
                f"({self.nbytes / 2**20:.0f} MiB, policy {self.policy})")


class CachedDeviceExpertWeights(DeviceExpertWeights):
    """A device expert tensor whose blocks live in its layer's slots (see the module docstring)."""

    def __init__(self, name, qtype, raw: np.ndarray, n_in: int, cache: LayerExpertCache, backend=None,
                 use_kernels=None, source=None, **options):
        ExpertWeights.__init__(self, name, qtype, raw, n_in, backend, use_kernels, **options)  # no full copy
        # the GGUFFile ``raw`` maps: read slabs' pages are dropped from the resident set after the
        # copy (``GGUFFile.drop_pages``), so the process's RSS holds the slots, not the file
        self.source = source
        self.expert_cache = cache
        self.slots = cache.register(self)
        # no dequantized LRU: the budget bounds what stays in memory (a prefill chunk dequantizes
        # its groups and drops them, ``group_bytes`` at a time)
        self.cache = ExpertCache(0)
        self._plan: _Plan | None = None

    @classmethod
    def from_gguf(cls, gguf_file, name: str, cache: LayerExpertCache, backend=None, use_kernels=None, **options):
        info = gguf_file.tensor(name)
        if len(info.shape) != 3:
            raise LayoutError(f"tensor {name!r}: expected a 3-D expert tensor, got shape {info.shape}")
        return cls(name, info.ggml_type, gguf_file.tensor_array(name), info.shape[2], cache, backend, use_kernels,
                   source=gguf_file, **options)

    @property
    def blocks(self) -> mx.array:
        raise AttributeError(f"tensor {self.name!r}: a bounded expert cache holds slots, not every expert's blocks")

    @property
    def resident_nbytes(self) -> int:
        """Bytes this tensor holds in MLX memory: its slot array."""
        return int(self.slots.nbytes)

    def _load(self, experts: np.ndarray, slot_idx: mx.array) -> None:
        """Copy ``experts``' slabs out of the mapping into their slots (one batched copy)."""
        slabs = np.take(self.raw, experts, axis=0)
        self.bytes_read += int(slabs.nbytes)
        self._drop(experts)
        self.slots[slot_idx] = mx.array(slabs)

    def _drop(self, experts: np.ndarray) -> None:
        if self.source is not None:
            for e in experts:
                self.source.drop_pages(self.raw[int(e)])

    def _read(self, experts: np.ndarray) -> mx.array:
        """The blocks of ``experts`` (a subset of the current call's): from their slots, or read
        from the mapping when the call did not admit them (a transient)."""
        experts = np.asarray(experts, dtype=np.int64)
        slots = self._plan.slots_of(experts)
        resident = slots >= 0
        if resident.all():
            return mx.take(self.slots, mx.array(slots.astype(np.int32)), axis=0)
        out = np.empty((experts.size,) + tuple(self.raw.shape[1:]), dtype=np.uint8)
        if resident.any():
            # a zero-copy view of the evaluated slots (MLX's CPU memory), copied out once
            out[resident] = np.asarray(self.slots)[slots[resident]]
        miss = np.take(self.raw, experts[~resident], axis=0)
        self.bytes_read += int(miss.nbytes)
        self._drop(experts[~resident])
        out[~resident] = miss
        del miss
        return mx.array(out)

    def _planned(self, x: mx.array, ids) -> np.ndarray:
        ids_np = check_expert_call(self.name, self.shape, x, ids)
        self._plan = self.expert_cache.plan(ids)
        return ids_np

    def __call__(self, x: mx.array, ids) -> mx.array:
        """x [T, k|1, in], ids [T, k] -> [T, k, out] in DEFAULT numerics (see the module docstring)."""
        ids_np = self._planned(x, ids)
        T, k = ids_np.shape
        out_dim = self.shape[1]
        P = T * k
        slot_of_pair = self._plan.slots[self._plan.inverse] if P else np.zeros(0, dtype=np.int64)
        if P == 0 or P > DEVICE_MAX_PAIRS or (slot_of_pair < 0).any():
            return ExpertWeights.__call__(self, x, ids_np)  # grouped by expert (a prefill chunk)
        if x.dtype != mx.float32:
            x = x.astype(mx.float32)
        self.calls += 1
        self.pairs += P
        self.bytes_selected += P * self.expert_nbytes
        slot = mx.array(slot_of_pair.astype(np.int32))
        return matvec_pairs(self.slots, self.qtype, x, slot, self.kernel_dialect).reshape(T, k, out_dim)

    def ds4_cpu(self, x: mx.array, ids) -> mx.array:
        """ds4's CPU arithmetic (``ExpertWeights.ds4_cpu``) on blocks from the slots: the same bits."""
        ids_np = self._planned(x, ids)
        return ExpertWeights.ds4_cpu(self, x, ids_np)
