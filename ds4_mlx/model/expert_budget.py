"""How many experts per layer a bounded device expert cache holds: the ``experts_cache`` budget.

No MLX here (the command line checks ``--experts-cache`` with ``parse_experts_cache`` while it parses,
before anything loads). The semantics follow ds4's ``--ssd-streaming-cache-experts N|NGB``:

* None: every expert resident (the unbounded device strategy);
* a count N (the string "N", as on ds4's command line): N expert triplets (gate + up + down of one
  expert of one layer) over all routed layers. ds4's count is global (one LRU over every layer);
  here each layer owns fixed slot arrays, so the count is split evenly: N // layers per layer
  (every layer of a token routes to k experts, so an even split is what a decode step needs);
* bytes (an int, or "8GB", "512MiB", "1.5G"; K/M/G/T = powers of 1024, as ds4's GB): ds4's NGB, a
  memory budget for complete triplets that "also reserves two full prefill layers": the slots are as
  many per layer as fit in the budget minus two full layers (the largest), kept for a prefill
  chunk's working set (``expert_cache``'s module docstring);
* a budget of all the experts or more: the unbounded strategy; fewer than k slots per layer: an
  error, since one token needs its k experts of a layer at once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numbers

from ds4_mlx.errors import LayoutError

# ds4's NGB reserve: two full routed layers kept free for a prefill chunk's working set.
PREFILL_RESERVE_LAYERS = 2

_UNITS = {"": None, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_BUDGET_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Budget:
    """A parsed ``experts_cache``: ``kind`` "experts" (a count of expert triplets) or "bytes"."""

    kind: str
    amount: int

    def __str__(self) -> str:
        return f"{self.amount} experts" if self.kind == "experts" else f"{self.amount / 2**20:.0f} MiB"


def parse_experts_cache(value) -> Budget | None:
    """``experts_cache`` -> ``Budget`` or None (all resident). An int is bytes; a string is a count
    ("1024") or a size ("8GB", "512MiB", "1.5G"; K/M/G/T are powers of 1024, as ds4's GB). Zero,
    negative, NaN, booleans and anything else are a one-line ``LayoutError``."""
    if value is None:
        return None
    what = f"experts_cache {value!r}"
    if isinstance(value, bool):
        raise LayoutError(f"{what}: expected bytes (int), a size string ('8GB') or an expert count ('256')")
    if isinstance(value, numbers.Integral):
        if value <= 0:
            raise LayoutError(f"{what}: a budget must be positive")
        return Budget("bytes", int(value))
    if isinstance(value, float):
        if not math.isfinite(value) or value <= 0:
            raise LayoutError(f"{what}: a budget must be a positive finite number of bytes")
        return Budget("bytes", int(value))
    if not isinstance(value, str):
        raise LayoutError(f"{what}: expected bytes (int), a size string ('8GB') or an expert count ('256')")
    m = _BUDGET_RE.match(value)
    if not m:
        raise LayoutError(f"{what}: expected an expert count ('256') or a size such as '8GB' or '512MiB'")
    number, prefix, suffix = m.group(1), m.group(2).lower(), m.group(3)
    if not prefix and not suffix:  # a bare number: an expert count, as ds4's N
        if "." in number:
            raise LayoutError(f"{what}: an expert count must be a whole number (a size needs a unit: '1.5GB')")
        n = int(number)
        if n <= 0:
            raise LayoutError(f"{what}: a budget must be positive")
        return Budget("experts", n)
    nbytes = int(float(number) * _UNITS[prefix or "b"])
    if nbytes <= 0:
        raise LayoutError(f"{what}: a budget must be positive")
    return Budget("bytes", nbytes)


@dataclass(frozen=True)
class CachePlan:
    """How the loader sizes the caches: ``slots`` per routed layer, or None (every expert fits)."""

    slots: int | None
    budget: Budget | None
    triplet_nbytes: tuple[int, ...]    # per routed layer: one expert's gate + up + down bytes
    n_expert: int

    @property
    def cache_nbytes(self) -> int:
        """Bytes of all slot arrays (allocated once at load)."""
        return 0 if self.slots is None else self.slots * sum(self.triplet_nbytes)

    @property
    def prefill_reserve_nbytes(self) -> int:
        """ds4's prefill headroom: two full routed layers (the largest)."""
        if not self.triplet_nbytes:
            return 0
        return PREFILL_RESERVE_LAYERS * self.n_expert * max(self.triplet_nbytes)


def plan_cache(budget: Budget | None, *, triplet_nbytes: list[int], n_expert: int, n_used: int) -> CachePlan:
    """Slots per layer for ``budget`` over layers whose expert triplets weigh ``triplet_nbytes``."""
    trip = tuple(int(t) for t in triplet_nbytes)
    plan = CachePlan(None, budget, trip, int(n_expert))
    if budget is None or not trip:
        return plan
    n_layers, per_slot = len(trip), sum(trip)
    if budget.kind == "experts":
        if budget.amount >= n_layers * n_expert:
            return plan
        slots = budget.amount // n_layers
        if slots < n_used:
            raise LayoutError(f"experts_cache {budget.amount} experts is {slots} per routed layer over "
                              f"{n_layers} layers; a token routes to {n_used} per layer: give at least "
                              f"{n_used * n_layers}")
        return CachePlan(slots, budget, trip, int(n_expert))
    if budget.amount >= per_slot * n_expert:
        return plan
    reserve = plan.prefill_reserve_nbytes
    slots = max(0, budget.amount - reserve) // per_slot
    if slots < n_used:
        need = reserve + n_used * per_slot
        raise LayoutError(f"experts_cache {budget.amount / 2**20:.0f} MiB holds {slots} experts per routed "
                          f"layer after ds4's prefill reserve of {PREFILL_RESERVE_LAYERS} full layers "
                          f"({reserve / 2**20:.0f} MiB); a token routes to {n_used} per layer: give at "
                          f"least {math.ceil(need / 2**20)} MiB, or an expert count")
    return CachePlan(min(slots, n_expert), budget, trip, int(n_expert))
