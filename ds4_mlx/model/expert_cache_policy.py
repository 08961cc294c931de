"""Which routed experts a bounded expert cache keeps: replacement policies as pure bookkeeping.

A layer's cache has ``n_slots`` slots; each slot holds one expert's three tensors (gate, up, down:
ds4's "expert triplet"). One ``access`` is one call of the layer (a decoded token: its k experts; a
prefill chunk: every expert its tokens routed to, with its pair count). Given the experts of the
access (distinct ids) the policy answers, without doing any I/O:

* ``slots[i]``  the slot expert ``experts[i]`` is read from, or -1: not admitted (read from the
                mapping into a transient for this call only; only when the access names more
                experts than there are slots, i.e. a prefill chunk);
* ``loads``     (expert, slot) pairs to copy in before the call: the admitted misses.

Rules shared by every policy: the hits of an access are pinned (never evicted by the same access,
ds4's rule); a miss takes a free slot first, then the victim with the lowest ``priority``; when an
access names more experts than there are slots, the slots go to the experts of highest priority
among those resident and those accessed, the accessed ones ranked by their pair counts first
(the warm-up: after a prefill chunk the cache holds the experts the prompt routed to most).

``LRUPolicy``: priority = the access number of the last use (ties in one access: more pairs first).
``LFUPolicy``: priority = a frequency with exponential aging: every access multiplies all the
layer's scores by ``decay`` and adds each accessed expert's pair count, so a burst long ago weighs
less than steady use now; ties go to the more recent use. ``decay`` = 1 is plain LFU (the prompt's
routing would pin the cache forever), 0 is LRU with pair counts as tie-break.

The counters (``hits``, ``misses``: one per accessed expert; ``admitted``, ``evicted``) are the
cache's statistics; the bytes they stand for are counted by the caller, who knows the sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POLICIES = ("lru", "lfu")
DEFAULT_POLICY = "lfu"  # by measurement: benchmarks/NOTES.md, "Bounded device expert cache"
# LFU's aging factor per access of the layer (one decoded token): a score's half-life is
# log(0.5)/log(decay) ~ 69 tokens at 0.99. Measured against LRU in benchmarks/NOTES.md.
DEFAULT_LFU_DECAY = 0.99


@dataclass(frozen=True)
class Access:
    """The policy's answer for one access (see the module docstring)."""

    slots: np.ndarray          # int64 [u], the slot of each accessed expert, -1 = transient
    load_experts: np.ndarray   # int64 [m], admitted misses ...
    load_slots: np.ndarray     # int64 [m], ... and the slots they are copied into
    hits: int
    misses: int


class SlotPolicy:
    """Slot bookkeeping of one layer: which expert each slot holds, and the victim choice."""

    name = "base"

    def __init__(self, n_slots: int, n_expert: int):
        if n_slots < 1 or n_expert < 1:
            raise ValueError(f"a cache needs at least one slot and one expert, got {n_slots} slots, "
                             f"{n_expert} experts")
        self.n_slots, self.n_expert = int(n_slots), int(n_expert)
        self.slot_of = np.full(self.n_expert, -1, dtype=np.int64)    # expert -> slot (-1: not resident)
        self.expert_in = np.full(self.n_slots, -1, dtype=np.int64)   # slot -> expert (-1: free)
        self.tick = 0
        self.hits = self.misses = self.admitted = self.evicted = 0

    # -- what a policy defines ----------------------------------------------------------------------

    def _observe(self, experts: np.ndarray, counts: np.ndarray) -> None:
        """Record the access (before the choice)."""
        raise NotImplementedError

    def priority(self, experts: np.ndarray) -> np.ndarray:
        """Keep-score of ``experts`` (higher = keep), after ``_observe``."""
        raise NotImplementedError

    # -- the access ---------------------------------------------------------------------------------

    def access(self, experts, counts=None) -> Access:
        """``experts``: distinct ids of this access; ``counts``: pairs per expert (default 1 each)."""
        experts = np.asarray(experts, dtype=np.int64).reshape(-1)
        counts = (np.ones(experts.size, dtype=np.float64) if counts is None
                  else np.asarray(counts, dtype=np.float64).reshape(-1))
        if counts.size != experts.size:
            raise ValueError(f"{experts.size} experts but {counts.size} counts")
        if experts.size and (experts.min() < 0 or experts.max() >= self.n_expert):
            raise ValueError(f"expert id outside 0..{self.n_expert - 1}")
        if np.unique(experts).size != experts.size:
            raise ValueError("the experts of an access must be distinct")
        self.tick += 1
        self._observe(experts, counts)
        before = self.slot_of[experts].copy()
        hit = before >= 0
        if experts.size <= self.n_slots:
            admit = experts[~hit]
        else:
            admit = self._admit_many(experts, counts, hit)
        load_slots = self._place(admit, pinned=experts[hit])
        slots = self.slot_of[experts].copy()
        # a hit is an expert read from its slot: one resident before that a large access dropped
        # (its slot reused) is read from the mapping, a miss
        n_hit = int((hit & (slots == before)).sum())
        self.hits += n_hit
        self.misses += int(experts.size - n_hit)
        return Access(slots=slots, load_experts=admit, load_slots=load_slots, hits=n_hit,
                      misses=int(experts.size - n_hit))

    def _admit_many(self, experts: np.ndarray, counts: np.ndarray, hit: np.ndarray) -> np.ndarray:
        """More experts than slots: the misses that enter, so that the resident set becomes the
        ``n_slots`` experts of highest (accessed first, pair count, priority) order among the
        accessed and the resident ones. Resident experts left out are evicted by ``_place``."""
        # accessed ones outrank resident-but-unused ones (they are the most recent use); among the
        # accessed, the most-routed first (the warm-up), then the policy's priority
        order = np.lexsort((-self.priority(experts), -counts))
        keep = experts[order[: self.n_slots]]
        keep_set = np.zeros(self.n_expert, dtype=bool)
        keep_set[keep] = True
        # the resident experts that the new set drops, freed now so ``_place`` finds their slots
        for e in self.expert_in[self.expert_in >= 0]:
            if not keep_set[e]:
                self._evict(int(e))
        return keep[self.slot_of[keep] < 0]

    def _evict(self, e: int) -> None:
        s = self.slot_of[e]
        self.expert_in[s] = -1
        self.slot_of[e] = -1
        self.evicted += 1

    def _place(self, admit: np.ndarray, pinned: np.ndarray) -> np.ndarray:
        """Slots for ``admit`` (free ones first, then victims by lowest priority, never ``pinned``)."""
        out = np.empty(admit.size, dtype=np.int64)
        if admit.size == 0:
            return out
        free = np.flatnonzero(self.expert_in < 0)
        need = admit.size - free.size
        if need > 0:
            resident = self.expert_in[self.expert_in >= 0]
            protect = np.zeros(self.n_expert, dtype=bool)
            protect[pinned] = True
            protect[admit] = True
            cands = resident[~protect[resident]]
            if cands.size < need:
                raise ValueError(f"{admit.size} experts to admit with {free.size} free slots and "
                                 f"{cands.size} evictable ones")
            victims = cands[np.argsort(self.priority(cands), kind="stable")[:need]]
            for e in victims:
                self._evict(int(e))
            free = np.flatnonzero(self.expert_in < 0)
        out[:] = free[: admit.size]
        self.expert_in[out] = admit
        self.slot_of[admit] = out
        self.admitted += int(admit.size)
        return out

    def reset_counters(self) -> None:
        self.hits = self.misses = self.admitted = self.evicted = 0


class LRUPolicy(SlotPolicy):
    """Evict the expert used longest ago (ties within one access: fewer pairs goes first)."""

    name = "lru"

    def __init__(self, n_slots: int, n_expert: int):
        super().__init__(n_slots, n_expert)
        self.last = np.zeros(n_expert, dtype=np.float64)

    def _observe(self, experts: np.ndarray, counts: np.ndarray) -> None:
        # the access number, plus a fraction ranking the pair counts within the access
        frac = counts / (counts.max() + 1.0) if counts.size else counts
        self.last[experts] = self.tick + frac

    def priority(self, experts: np.ndarray) -> np.ndarray:
        return self.last[experts]


class LFUPolicy(SlotPolicy):
    """Evict the expert of lowest aged frequency (``score = score * decay + pairs`` per access)."""

    name = "lfu"

    def __init__(self, n_slots: int, n_expert: int, decay: float = DEFAULT_LFU_DECAY):
        super().__init__(n_slots, n_expert)
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"LFU decay must be in [0, 1], got {decay!r}")
        self.decay = float(decay)
        self.score = np.zeros(n_expert, dtype=np.float64)
        self.last = np.zeros(n_expert, dtype=np.float64)

    def _observe(self, experts: np.ndarray, counts: np.ndarray) -> None:
        self.score *= self.decay
        self.score[experts] += counts
        self.last[experts] = self.tick

    def priority(self, experts: np.ndarray) -> np.ndarray:
        # the score, the recency breaking ties (scaled far below one pair's weight)
        return self.score[experts] + self.last[experts] * 1e-9


def make_policy(name: str, n_slots: int, n_expert: int, **kw) -> SlotPolicy:
    if name == "lru":
        return LRUPolicy(n_slots, n_expert)
    if name == "lfu":
        return LFUPolicy(n_slots, n_expert, **kw)
    raise ValueError(f"unknown expert cache policy {name!r}; expected one of {list(POLICIES)}")
