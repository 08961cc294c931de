"""ds4's disk KV cache policy: when a prefix is worth saving, where to cut it, what to evict first.

Pure arithmetic over token counts, sizes and timestamps; the file format and all I/O live in
``kvstore.py``. Every rule here is ds4's (``ds4_kvstore.c`` / ``ds4_server.c``) except the two
eviction factors described after the list:

* Save points. A *cold* save is made once for a fresh (not cached) prompt of ``min_tokens`` ..
  ``cold_max_tokens`` tokens, cut at the chat anchor (the last ``<｜User｜>`` before the first
  ``<｜Assistant｜>``, when that is at index >= ``min_tokens``) or else at ``n - trim`` rounded down
  to ``align`` (used when still >= ``min_tokens``, otherwise ``n``). *Continued* saves happen
  whenever the live length reaches a multiple of ``ceil(interval / align) * align`` (10240 by
  default) beyond the last save. *evict* / *shutdown* saves store the whole live session and need
  no helper.
* Budget. A file of ``B`` bytes may only be written when ``B + ceil(B / 100) <= budget``: the 1%
  headroom keeps a file that barely fits from being evicted by the very pass that follows it.
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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ds4_mlx.errors import KVStoreError

DEFAULT_MIN_TOKENS = 512
DEFAULT_COLD_MAX_TOKENS = 30000
DEFAULT_CONTINUED_INTERVAL_TOKENS = 10000
DEFAULT_BOUNDARY_TRIM_TOKENS = 32
DEFAULT_BOUNDARY_ALIGN_TOKENS = 2048
DEFAULT_BUDGET_MB = 4096
HIT_HALF_LIFE_SECONDS = 6 * 60 * 60
MIN_EFFECTIVE_HITS = 0.01
MIB = 1024 * 1024
ANCHOR_SCORE_FACTOR = 2.0  # ds4-mlx: explicit checkpoints are worth two continued ones of their shape
SUPERSEDED_HIT_FACTOR = 0.25  # ds4 before 1a5ce45: a superseded prefix that served branches
SUPERSEDED_NO_HIT_FACTOR = 0.02  # ... and one that never did (or whose hits have decayed away)


@dataclass(frozen=True)
class KVStoreOptions:
    """ds4's ``ds4_kvstore_options`` (server flags ``--kv-cache-*``); 0 disables cold/continued/trim/align.

    Plus ds4-mlx's two eviction refinements (module docstring): ``anchor_score_factor`` multiplies
    the score of cold / evict / shutdown entries, ``demote_superseded_continued`` demotes continued
    entries that a newer stored entry extends. ``ds4_head()`` gives ds4 HEAD's exact eviction.
    """

    min_tokens: int = DEFAULT_MIN_TOKENS
    cold_max_tokens: int = DEFAULT_COLD_MAX_TOKENS
    continued_interval_tokens: int = DEFAULT_CONTINUED_INTERVAL_TOKENS
    boundary_trim_tokens: int = DEFAULT_BOUNDARY_TRIM_TOKENS
    boundary_align_tokens: int = DEFAULT_BOUNDARY_ALIGN_TOKENS
    anchor_score_factor: float = ANCHOR_SCORE_FACTOR
    demote_superseded_continued: bool = True

    def __post_init__(self) -> None:
        for name in ("min_tokens", "cold_max_tokens", "continued_interval_tokens",
                     "boundary_trim_tokens", "boundary_align_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise KVStoreError(f"KV store option {name}={value!r}: expected an integer >= 0")
        if 0 < self.cold_max_tokens < self.min_tokens:
            raise KVStoreError(f"KV store option cold_max_tokens={self.cold_max_tokens}: must be 0 or "
                               f">= min_tokens={self.min_tokens}")
        factor = self.anchor_score_factor
        if (isinstance(factor, bool) or not isinstance(factor, (int, float))
                or not math.isfinite(factor) or factor <= 0):
            raise KVStoreError(f"KV store option anchor_score_factor={factor!r}: expected a finite "
                               f"number > 0")
        if not isinstance(self.demote_superseded_continued, bool):
            raise KVStoreError(f"KV store option demote_superseded_continued="
                               f"{self.demote_superseded_continued!r}: expected a bool")

    @classmethod
    def ds4_head(cls, **overrides) -> KVStoreOptions:
        """Options whose eviction order is ds4 HEAD's exactly: no anchor bonus, no demotion."""
        return cls(**{"anchor_score_factor": 1.0, "demote_superseded_continued": False, **overrides})


DEFAULT_OPTIONS = KVStoreOptions()
DS4_HEAD_OPTIONS = KVStoreOptions.ds4_head()


def stable_store_len(n_tokens: int, opts: KVStoreOptions = DEFAULT_OPTIONS) -> int:
    """ds4_kvstore_store_len: ``n - trim`` aligned down, when that keeps >= min_tokens; else ``n``.

    The trim keeps the tail where the tokenizer may merge across the prompt boundary out of the
    checkpoint; the 2048 alignment matches the prefill chunk schedule, so compressor rows are
    finalized exactly as in a cold full prompt.
    """
    trim, align = opts.boundary_trim_tokens, opts.boundary_align_tokens
    if n_tokens > opts.min_tokens + trim:
        stable = n_tokens - trim
        if align > 0:
            stable -= stable % align
        if stable >= opts.min_tokens:
            return stable
    return n_tokens


def chat_anchor_pos(tokens: Sequence[int], user_id: int, assistant_id: int,
                    opts: KVStoreOptions = DEFAULT_OPTIONS) -> int:
    """Index of the last ``user_id`` token before the first ``assistant_id`` token, or -1.

    -1 also when that index is below ``min_tokens`` or either id is negative. Everything before
    the task's own user turn is the part independent agent sessions share.
    """
    if user_id < 0 or assistant_id < 0:
        return -1
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    assistants = np.flatnonzero(ids == assistant_id)
    end = int(assistants[0]) if assistants.size else ids.size
    users = np.flatnonzero(ids[:end] == user_id)
    last_user = int(users[-1]) if users.size else -1
    return last_user if last_user >= opts.min_tokens else -1


def cold_store_len(tokens: Sequence[int], user_id: int, assistant_id: int,
                   opts: KVStoreOptions = DEFAULT_OPTIONS) -> int:
    """Token count of the cold checkpoint for a fresh prompt, or 0 when none is due.

    None is due when the prompt is shorter than ``min_tokens``, longer than ``cold_max_tokens``, or
    cold saves are off (``cold_max_tokens == 0``). The caller prefills exactly this prefix, saves it
    with reason "cold", then prefills the rest.
    """
    n = len(tokens)
    if opts.cold_max_tokens <= 0 or n < opts.min_tokens or n > opts.cold_max_tokens:
        return 0
    anchor = chat_anchor_pos(tokens, user_id, assistant_id, opts)
    return anchor if anchor >= opts.min_tokens else stable_store_len(n, opts)


def continued_step(opts: KVStoreOptions = DEFAULT_OPTIONS) -> int:
    """Distance between continued save frontiers: the interval rounded up to the alignment (0 = off)."""
    step = opts.continued_interval_tokens
    if step <= 0:
        return 0
    align = opts.boundary_align_tokens
    if align > 0:
        step = -(-step // align) * align
    return step


def continued_save_due(live_len: int, last_saved_len: int,
                       opts: KVStoreOptions = DEFAULT_OPTIONS) -> bool:
    """ds4_kvstore_continued_store_target: save the live session as "continued" now?

    Due when ``live_len >= min_tokens``, ``live_len`` is a multiple of ``continued_step`` and it is
    beyond ``last_saved_len`` (the largest length stored or loaded in this session; 0 after a
    cache miss, as ds4 resets it).
    """
    step = continued_step(opts)
    return (step > 0 and live_len >= opts.min_tokens and live_len % step == 0
            and live_len > last_saved_len)


def budget_bytes(budget_mb: float) -> int:
    """Budget in bytes for a size in MiB; 0 (or less) means ds4's default 4096 MiB."""
    if budget_mb is None or budget_mb <= 0:
        budget_mb = DEFAULT_BUDGET_MB
    return int(budget_mb * MIB)


def required_bytes(file_bytes: int) -> int:
    """Budget a new file needs: its size plus 1% headroom rounded up."""
    return file_bytes + -(-file_bytes // 100)


def fits_budget(file_bytes: int, budget: int) -> bool:
    return required_bytes(file_bytes) <= budget


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
