"""ds4's disk KV cache policy: the store's options, when a prefix is worth saving, where to cut it.

Pure arithmetic over token counts and sizes; the file format is ``kvstore_format``, what to evict
first is ``kvstore_eviction``. Every rule here is ds4's (``ds4_kvstore.c`` / ``ds4_server.c``):

* Save points. A *cold* save is made once for a fresh (not cached) prompt of ``min_tokens`` ..
  ``cold_max_tokens`` tokens, cut at the chat anchor (the last ``<｜User｜>`` before the first
  ``<｜Assistant｜>``, when that is at index >= ``min_tokens``) or else at ``n - trim`` rounded down
  to ``align`` (used when still >= ``min_tokens``, otherwise ``n``). *Continued* saves happen
  whenever the live length reaches a multiple of ``ceil(interval / align) * align`` (10240 by
  default) beyond the last save. *evict* / *shutdown* saves store the whole live session and need
  no helper.
* Budget. A file of ``B`` bytes may only be written when ``B + ceil(B / 100) <= budget``: the 1%
  headroom keeps a file that barely fits from being evicted by the very pass that follows it.

The options also carry the two ds4-mlx eviction refinements (``anchor_score_factor``,
``demote_superseded_continued``) that ``kvstore_eviction`` applies.
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
MIB = 1024 * 1024
ANCHOR_SCORE_FACTOR = 2.0  # ds4-mlx: explicit checkpoints are worth two continued ones of their shape


@dataclass(frozen=True)
class KVStoreOptions:
    """ds4's ``ds4_kvstore_options`` (server flags ``--kv-cache-*``); 0 disables cold/continued/trim/align.

    Plus ds4-mlx's two eviction refinements (``kvstore_eviction``): ``anchor_score_factor`` multiplies
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
