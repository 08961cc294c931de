"""What a full cache directory evicts first, and the eviction itself.

Pure scoring over an entry's token count, size, hits and timestamps, plus the one file-format read
it needs (the stored tokens of entries that may supersede a continued checkpoint) and the unlink.
Every rule is ds4's (``ds4_kvstore.c``) except the two factors after the first bullet:

* Eviction, while the directory is over budget: lowest score first, where ds4's score is
  ``base = (effective_hits + 1) * tokens / file_bytes`` and
  ``effective_hits = hits * 2 ** (-(now - last_used) / 6 h)`` (``created`` stands in for a zero
  ``last_used``; no timestamp at all, or a value under 0.01, means 0). Ties go to the older
  ``last_used``. The file just written is never the victim. The ``+ 1`` keeps a fresh zero-hit
  checkpoint worth its token density; the decay only removes *stale* popularity, never the
  baseline.

ds4-mlx multiplies that base by two factors ds4 HEAD does not have (both on by default; the
options ``anchor_score_factor`` / ``demote_superseded_continued`` control them, and
``KVStoreOptions.ds4_head()`` turns both off for ds4 HEAD's exact order):

* Anchors. cold / evict / shutdown checkpoints are saved on purpose, to serve a later request
  that starts over (a new session with the same system prompt, a conversation swapped out of
  RAM). Their score is multiplied by ``ANCHOR_SCORE_FACTOR`` (2): a fresh continued snapshot of
  the same shape needs one real, undecayed hit to tie with a fresh anchor, so a marginally denser
  continued stream cannot push an anchor out. This is a multiplier on the whole score, so it
  decays along with the hits but never below 2x the density (a contributor branch of ds4,
  f6bd3ee, instead raised the ``+ 1`` to ``+ 4`` for the same three reasons; a multiplier keeps
  the hit/no-hit ratio of ds4 intact within each class).
* Superseded continued checkpoints. A continued checkpoint whose tokens are a strict prefix of a
  newer stored entry of the same model and payload version only serves requests that branch off
  between its end and the newer entry's end; everything else is served better by the newer one.
  Its score is multiplied by ``SUPERSEDED_HIT_FACTOR`` (0.25) when it has effective hits (it *has*
  served such branches) and ``SUPERSEDED_NO_HIT_FACTOR`` (0.02) otherwise: the values of ds4's own
  rule before commit 1a5ce45. There the newer sequence was the live session in RAM, and ds4
  dropped the rule when continued saves became aligned restart frontiers: a prefix of the live
  session is its only durable restart point. A prefix of a newer *stored* entry is not: the
  newer file already is a durable restart point further on. ds4's extra ``* tokens / live_len``
  depth factor is left out: the density term already ranks sibling prefixes, and depth would
  make the penalty depend on how far the newer entry happened to run. The entry is only
  demoted, never deleted for this reason: it still goes only when the budget needs room, and if
  its superseder is evicted first it regains its full score.

Deciding supersession reads the stored tokens (trailer only, ``4 * tokens`` bytes) of entries that
could extend a continued one, and only when something has to be evicted. ``KVStoreOptions.ds4_head()``
gives ds4 HEAD's order exactly.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ds4_mlx.engine.kvstore_format import Entry, InvalidFile, SaveReason, read_trailer_tokens
from ds4_mlx.engine.kvstore_policy import DEFAULT_OPTIONS, KVStoreOptions
from ds4_mlx.engine.kvstore_scan import scan_dir

logger = logging.getLogger("ds4_mlx.kvstore")

HIT_HALF_LIFE_SECONDS = 6 * 60 * 60
MIN_EFFECTIVE_HITS = 0.01
SUPERSEDED_HIT_FACTOR = 0.25  # ds4 before 1a5ce45: a superseded prefix that served branches
SUPERSEDED_NO_HIT_FACTOR = 0.02  # ... and one that never did (or whose hits have decayed away)


def effective_hits(hits: int, last_used: int, created_at: int, now: float) -> float:
    """Hit count halved for every 6 h without use (see the module docstring)."""
    used_at = last_used or created_at
    if used_at == 0:
        return 0.0
    eff = float(hits)
    if now > used_at:
        eff *= math.exp2(-(now - used_at) / HIT_HALF_LIFE_SECONDS)
        if eff < MIN_EFFECTIVE_HITS:
            eff = 0.0
    return eff


def eviction_score(tokens: int, hits: int, file_bytes: int, last_used: int, created_at: int,
                   now: float) -> float:
    """ds4 HEAD's value per byte of keeping a checkpoint (the base score). 0 for an empty file."""
    if file_bytes <= 0:
        return 0.0
    return (effective_hits(hits, last_used, created_at, now) + 1.0) * tokens / file_bytes


def score_factors(*, anchor: bool, superseded: bool, eff_hits: float,
                  opts: KVStoreOptions = DEFAULT_OPTIONS) -> tuple[float, float]:
    """(anchor factor, superseded factor) that ds4-mlx multiplies the base score by.

    ``anchor``: a cold / evict / shutdown entry. ``superseded``: a continued entry whose tokens a
    newer stored entry strictly extends (the caller decides both). Both 1.0 under
    ``KVStoreOptions.ds4_head()``.
    """
    anchor_f = opts.anchor_score_factor if anchor else 1.0
    superseded_f = 1.0
    if superseded and opts.demote_superseded_continued:
        superseded_f = SUPERSEDED_HIT_FACTOR if eff_hits > 0 else SUPERSEDED_NO_HIT_FACTOR
    return anchor_f, superseded_f


# The issue's (and ds4 branch f6bd3ee's) set; ds4's agent-system / agent-session saves come from
# its separate agent tool and are left at x1 until there is a reason to rank them.
ANCHOR_REASONS = frozenset({SaveReason.COLD, SaveReason.EVICT, SaveReason.SHUTDOWN})


@dataclass(frozen=True)
class Evicted:
    path: Path
    file_size: int
    tokens: int  # 0 for an invalid file
    hits: int
    score: float  # the effective score it was chosen by
    why: str  # "disk-cache-full" or "invalid: <reason>"
    note: str = ""  # the score's factors, e.g. "superseded x0.02 by <name>" (EvictionScore.note)


@dataclass(frozen=True)
class PendingCheckpoint:
    """The file ``store`` is about to write. Room is made before it exists, but it may already
    supersede stored continued checkpoints (ds4 evicts after the rename, with the new file listed)."""

    name: str
    token_bytes: bytes
    model_id: bytes
    payload_version: int
    created_at: int  # as its header will say (now, or the replaced file's when rewritten)


@dataclass(frozen=True)
class EvictionScore:
    """An item's eviction value: ``score = base * anchor_factor * superseded_factor``."""

    score: float  # what eviction compares, lowest first (inf for the protected file)
    base: float  # ds4 HEAD's (effective hits + 1) * tokens / bytes; 0 for an invalid file
    anchor_factor: float = 1.0
    superseded_factor: float = 1.0
    superseded_by: tuple[str, ...] = ()  # newer entries whose tokens strictly extend this one
    protected: bool = False

    @property
    def note(self) -> str:
        parts = []
        if self.protected:
            parts.append("protected")
        if self.anchor_factor != 1.0:
            parts.append(f"anchor x{self.anchor_factor:g}")
        if self.superseded_factor != 1.0:
            more = f" (+{len(self.superseded_by) - 1})" if len(self.superseded_by) > 1 else ""
            parts.append(f"superseded x{self.superseded_factor:g} by {self.superseded_by[0]}{more}")
        return ", ".join(parts)

def superseded_continued(entries: Sequence[Entry],
                         pending: PendingCheckpoint | None = None) -> dict[str, tuple[str, ...]]:
    """Continued entries whose tokens are a strict prefix of a newer entry's, by file name, with
    the names of those newer entries.

    Newer means created at the same second or later (timestamps are whole seconds, and within one
    session a prefix is always saved before its extension); ``pending`` counts as listed. Only an
    entry of the same model id and payload version can stand in for the prefix. Trailer tokens
    are read only for entries that could extend some continued entry, each once, and each one's
    candidate prefixes are hashed incrementally in one pass over its tokens.
    """
    conts = [e for e in entries if e.reason == SaveReason.CONTINUED]
    if not conts:
        return {}
    newer: list[tuple[str, int, float, bytes, int, Callable[[], bytes | None]]] = [
        (e.name, e.tokens, float(e.created_at), e.model_id, e.payload_version,
         (lambda e=e: read_trailer_tokens(e))) for e in entries]
    if pending is not None:
        newer.append((pending.name, len(pending.token_bytes) // 4, float(pending.created_at),
                      pending.model_id, pending.payload_version, lambda: pending.token_bytes))
    found: dict[str, list[str]] = {}
    for name, n_tokens, created, model_id, payload_version, read in newer:
        cands = sorted((p for p in conts if p.name != name and p.tokens < n_tokens
                        and p.created_at <= created and p.model_id == model_id
                        and p.payload_version == payload_version), key=lambda p: p.tokens)
        if not cands:
            continue
        data = read()
        if data is None:
            continue
        view = memoryview(data)
        h, pos = hashlib.sha1(), 0
        for p in cands:
            end = 4 * p.tokens
            h.update(view[pos:end])
            pos = end
            if h.hexdigest() == p.token_key:
                found.setdefault(p.name, []).append(name)
    return {k: tuple(sorted(v)) for k, v in found.items()}


def entry_score(item: Entry | InvalidFile, now: float, options: KVStoreOptions = DEFAULT_OPTIONS,
           superseded_by: Sequence[str] = ()) -> EvictionScore:
    if isinstance(item, InvalidFile):
        return EvictionScore(0.0, 0.0)  # unloadable: worth nothing
    base = eviction_score(item.tokens, item.hits, item.file_size, item.last_used, item.created_at, now)
    eff = effective_hits(item.hits, item.last_used, item.created_at, now)
    superseded = bool(superseded_by) and item.reason == SaveReason.CONTINUED
    anchor_f, superseded_f = score_factors(anchor=item.reason in ANCHOR_REASONS, superseded=superseded,
                                           eff_hits=eff, opts=options)
    return EvictionScore(base * anchor_f * superseded_f, base, anchor_f, superseded_f,
                         tuple(superseded_by) if superseded_f != 1.0 else ())


def eviction_scores(items: Sequence[Entry | InvalidFile], now: float,
                    options: KVStoreOptions = DEFAULT_OPTIONS) -> dict[str, EvictionScore]:
    """Every item's current eviction score, by file name (what ``kv ls`` shows)."""
    entries = [x for x in items if isinstance(x, Entry)]
    sup = superseded_continued(entries) if options.demote_superseded_continued else {}
    return {x.path.name: entry_score(x, now, options, sup.get(x.path.name, ())) for x in items}


def eviction_order(items: Sequence[Entry | InvalidFile], now: float, protect: str | None = None, *,
                   options: KVStoreOptions = DEFAULT_OPTIONS, pending: PendingCheckpoint | None = None,
                   ) -> list[tuple[Entry | InvalidFile, EvictionScore]]:
    """Items in the order they are evicted: score, then older last use, then name; ``protect``
    (a file name) last.

    Equal to ds4's repeated minimum search: a score only changes when an entry's last superseder
    goes, which restores its full score, so that entry is re-queued with its new key.
    """
    entries = [x for x in items if isinstance(x, Entry)]
    sup = superseded_continued(entries, pending) if options.demote_superseded_continued else {}
    remaining = {p: set(qs) for p, qs in sup.items()}
    extends: dict[str, list[str]] = {}
    for p, qs in sup.items():
        for q in qs:
            extends.setdefault(q, []).append(p)
    by_name = {x.path.name: x for x in items}
    current: dict[str, tuple[int, EvictionScore]] = {}  # name -> (version, score)
    heap: list[tuple[float, int, str, int]] = []

    def push(name: str) -> None:
        item = by_name[name]
        s = entry_score(item, now, options, sorted(remaining.get(name, ())))
        if protect and name == protect:
            s = replace(s, score=math.inf, protected=True)
        version = current[name][0] + 1 if name in current else 0
        current[name] = (version, s)
        heapq.heappush(heap, (s.score, item.last_used if isinstance(item, Entry) else 0, name, version))

    for name in by_name:
        push(name)
    order: list[tuple[Entry | InvalidFile, EvictionScore]] = []
    done: set[str] = set()
    while heap:
        _, _, name, version = heapq.heappop(heap)
        if name in done or version != current[name][0]:
            continue  # the old key of a re-queued entry
        done.add(name)
        order.append((by_name[name], current[name][1]))
        for p in extends.get(name, ()):
            left = remaining[p]
            left.discard(name)
            if not left and p not in done:
                push(p)
    return order


def unlink_victim(item: Entry | InvalidFile, score: EvictionScore) -> Evicted | None:
    try:
        item.path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("kv cache: cannot evict %s: %s", item.path, exc.strerror)
        return None
    if isinstance(item, InvalidFile):
        ev = Evicted(item.path, item.file_size, 0, 0, score.score, f"invalid: {item.reason}", score.note)
    else:
        ev = Evicted(item.path, item.file_size, item.tokens, item.hits, score.score, "disk-cache-full",
                     score.note)
    logger.info("kv cache evicted reason=%s tokens=%d hits=%d size=%.2f MiB score=%.6g%s file=%s",
                ev.why, ev.tokens, ev.hits, ev.file_size / 2**20, ev.score,
                f" ({ev.note})" if ev.note else "", ev.path)
    return ev


def evict_to_budget(directory: str | os.PathLike, budget: int, now: float | None = None, *,
                    protect: str | None = None, extra_bytes: int = 0,
                    options: KVStoreOptions = DEFAULT_OPTIONS) -> list[Evicted]:
    """Delete files by ``eviction_order`` until all ``.kv`` files plus ``extra_bytes`` fit ``budget``.

    ``protect`` (a file name) is never chosen unless it alone exceeds the budget (ds4's rule).
    ``options`` selects the scoring (``KVStoreOptions.ds4_head()``: ds4 HEAD's). Returns what was
    removed.
    """
    now = time.time() if now is None else now
    scan = scan_dir(directory)
    total = scan.total_bytes + extra_bytes
    if total <= budget:
        return []  # no scoring, so no trailer reads, when nothing has to go
    protected = scan.by_name(protect) if protect else None
    if protected is not None and protected.file_size > budget:
        protect = None
    removed = []
    for item, score in eviction_order([*scan.entries, *scan.invalid], now, protect, options=options):
        if total <= budget:
            break
        if protect and item.path.name == protect:
            break
        ev = unlink_victim(item, score)
        if ev is not None:
            removed.append(ev)
            total -= item.file_size
    return removed
