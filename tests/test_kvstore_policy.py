"""ds4's disk KV cache policy (kvstore_policy.py, kvstore_eviction.py): save points, budget, eviction score.

Expected values are ds4's own unit tests (ds4_server.c test_kv_cache_*) or worked by hand from the
rules in ds4_kvstore.c, not taken from our implementation.
"""

from __future__ import annotations

import math

import pytest

from ds4_mlx.engine import kvstore_eviction as ev
from ds4_mlx.engine import kvstore_policy as pol
from ds4_mlx.engine.kvstore_policy import KVStoreOptions
from ds4_mlx.errors import KVStoreError

USER, ASSISTANT = 9001, 9002


def test_defaults_are_ds4s():
    o = pol.DEFAULT_OPTIONS
    assert (o.min_tokens, o.cold_max_tokens, o.continued_interval_tokens,
            o.boundary_trim_tokens, o.boundary_align_tokens) == (512, 30000, 10000, 32, 2048)
    assert pol.DEFAULT_BUDGET_MB == 4096
    assert ev.HIT_HALF_LIFE_SECONDS == 21600


def test_stable_store_len_matches_ds4_tests():
    assert pol.stable_store_len(11011) == 10240  # (11011 - 32) aligned down to 2048
    assert pol.stable_store_len(1695) == 1695  # 1663 -> 0 after alignment: below min, keep n
    assert pol.stable_store_len(3500, KVStoreOptions(boundary_trim_tokens=0, boundary_align_tokens=1000)) == 3000
    assert pol.stable_store_len(3500, KVStoreOptions(boundary_trim_tokens=0, boundary_align_tokens=0)) == 3500
    assert pol.stable_store_len(544) == 544  # not > min + trim
    assert pol.stable_store_len(2600) == 2048


def test_chat_anchor_matches_ds4_tests():
    opts = KVStoreOptions(min_tokens=4, cold_max_tokens=0)
    codex = [1, 2, USER, 3, 4, USER, 5, ASSISTANT]
    claude = [1, 2, 3, 4, USER, 5, ASSISTANT]
    assert pol.chat_anchor_pos(codex, USER, ASSISTANT, opts) == 5
    assert pol.chat_anchor_pos(claude, USER, ASSISTANT, opts) == 4
    multi = [1, 2, USER, 3, ASSISTANT, 4, USER, 5, ASSISTANT]  # later turns never anchor
    assert pol.chat_anchor_pos(multi, USER, ASSISTANT, KVStoreOptions(min_tokens=2, cold_max_tokens=0)) == 2
    assert pol.chat_anchor_pos(multi, USER, ASSISTANT, KVStoreOptions(min_tokens=3, cold_max_tokens=0)) == -1
    assert pol.chat_anchor_pos(multi, -1, ASSISTANT, opts) == -1
    assert pol.chat_anchor_pos(multi, USER, -1, opts) == -1
    assert pol.chat_anchor_pos([USER] * 3, USER, ASSISTANT, KVStoreOptions(min_tokens=1, cold_max_tokens=0)) == 2


def test_cold_store_len():
    n = 5000
    plain = [7] * n
    assert pol.cold_store_len(plain, USER, ASSISTANT) == 4096  # (5000 - 32) aligned down to 2048
    anchored = [7] * 1000 + [USER] + [7] * 3000 + [ASSISTANT] + [7] * 999
    assert pol.cold_store_len(anchored, USER, ASSISTANT) == 1000
    early = [7] * 100 + [USER] + [7] * 4899  # anchor below min_tokens: fall back to alignment
    assert pol.cold_store_len(early, USER, ASSISTANT) == 4096
    assert pol.cold_store_len([7] * 511, USER, ASSISTANT) == 0
    assert pol.cold_store_len([7] * 512, USER, ASSISTANT) == 512
    assert pol.cold_store_len([7] * 30000, USER, ASSISTANT) == 28672
    assert pol.cold_store_len([7] * 30001, USER, ASSISTANT) == 0
    assert pol.cold_store_len(plain, USER, ASSISTANT, KVStoreOptions(cold_max_tokens=0)) == 0


def test_continued_save_due_matches_ds4_tests():
    assert pol.continued_step() == 10240  # ceil(10000 / 2048) * 2048
    assert not pol.continued_save_due(10239, 0)
    assert pol.continued_save_due(10240, 0)
    assert pol.continued_save_due(10240, 4096)
    assert pol.continued_save_due(30720, 24576)
    assert not pol.continued_save_due(18432, 10240)
    assert pol.continued_save_due(20480, 10240)
    assert not pol.continued_save_due(20480, 20480)
    no_align = KVStoreOptions(boundary_align_tokens=0)
    assert not pol.continued_save_due(29999, 20480, no_align)
    assert pol.continued_save_due(30000, 20480, no_align)
    assert not pol.continued_save_due(10240, 0, KVStoreOptions(continued_interval_tokens=0))
    assert not pol.continued_save_due(256, 0, KVStoreOptions(min_tokens=512, continued_interval_tokens=256,
                                                             boundary_align_tokens=0))


def test_budget_arithmetic():
    assert pol.required_bytes(100) == 101
    assert pol.required_bytes(101) == 103  # ceil(1.01) = 2
    assert pol.required_bytes(0) == 0
    assert pol.fits_budget(10000, 10100) and not pol.fits_budget(10000, 10099)
    assert pol.budget_bytes(1) == 1 << 20
    assert pol.budget_bytes(0) == 4096 << 20  # ds4: 0 means the default
    assert pol.budget_bytes(0.5) == 1 << 19


def test_effective_hits_half_life():
    hl = ev.HIT_HALF_LIFE_SECONDS
    assert ev.effective_hits(8, 1000, 500, 1000) == 8
    assert ev.effective_hits(8, 1000, 500, 1000 + hl) == pytest.approx(4)
    assert ev.effective_hits(8, 1000, 500, 1000 + 3 * hl) == pytest.approx(1)
    assert ev.effective_hits(8, 0, 1000, 1000 + hl) == pytest.approx(4)  # created stands in
    assert ev.effective_hits(8, 0, 0, 5000) == 0  # no timestamp at all
    # 1 hit decays below 0.01 after log2(100) = 6.64 half-lives and then counts as none
    assert ev.effective_hits(1, 1000, 0, 1000 + 6.6 * hl) > 0.01
    assert ev.effective_hits(1, 1000, 0, 1000 + 6.7 * hl) == 0
    assert ev.effective_hits(5, 2000, 0, 1000) == 5  # clock behind last use: no decay


def test_eviction_score_matches_ds4():
    hl = ev.HIT_HALF_LIFE_SECONDS
    now = 1000 + 14 * hl
    stale = ev.eviction_score(1024, 10, 4096, 1000, 0, now)  # ds4: decays_stale_hits
    fresh = ev.eviction_score(2048, 0, 4096, now, 0, now)
    assert stale < fresh
    assert fresh == 1.0 * 2048 / 4096
    assert ev.eviction_score(1000, 3, 2000, now - hl, 0, now) == pytest.approx((1.5 + 1) * 0.5)
    assert ev.eviction_score(1000, 3, 0, now, 0, now) == 0
    assert math.isfinite(ev.eviction_score(1, 2**32 - 1, 1, now, now, now))


def test_options_validation():
    with pytest.raises(KVStoreError, match="cold_max_tokens"):
        KVStoreOptions(min_tokens=600, cold_max_tokens=500)
    with pytest.raises(KVStoreError, match="min_tokens"):
        KVStoreOptions(min_tokens=-1)
    KVStoreOptions(min_tokens=600, cold_max_tokens=0)


def test_ds4_mlx_eviction_defaults_and_ds4_head_mode():
    o = pol.DEFAULT_OPTIONS
    assert (o.anchor_score_factor, o.demote_superseded_continued) == (2.0, True)
    head = KVStoreOptions.ds4_head()
    assert (head.anchor_score_factor, head.demote_superseded_continued) == (1.0, False)
    assert pol.DS4_HEAD_OPTIONS == head
    # the save-point options are untouched by ds4_head(); overrides pass through
    assert KVStoreOptions.ds4_head(min_tokens=1, cold_max_tokens=0).min_tokens == 1
    assert (head.min_tokens, head.boundary_align_tokens) == (o.min_tokens, o.boundary_align_tokens)


def test_score_factors():
    f = ev.score_factors
    assert f(anchor=False, superseded=False, eff_hits=0) == (1.0, 1.0)
    assert f(anchor=True, superseded=False, eff_hits=3) == (2.0, 1.0)
    assert f(anchor=False, superseded=True, eff_hits=0) == (1.0, 0.02)
    assert f(anchor=False, superseded=True, eff_hits=0.5) == (1.0, 0.25)
    triple = KVStoreOptions(anchor_score_factor=3)
    assert f(anchor=True, superseded=False, eff_hits=0, opts=triple) == (3, 1.0)
    head = KVStoreOptions.ds4_head()
    for anchor, superseded, hits in [(True, False, 0), (False, True, 0), (False, True, 2)]:
        assert f(anchor=anchor, superseded=superseded, eff_hits=hits, opts=head) == (1.0, 1.0)
    # a fresh anchor outranks a fresh continued entry of the same shape until that one has a hit
    density = 1000 / 20000
    anchor = ev.eviction_score(1000, 0, 20000, 10, 0, 10) * f(anchor=True, superseded=False, eff_hits=0)[0]
    assert anchor == 2 * density
    assert ev.eviction_score(1000, 0, 20000, 10, 0, 10) < anchor
    assert ev.eviction_score(1000, 1, 20000, 10, 0, 10) == anchor


@pytest.mark.parametrize("kw", [{"anchor_score_factor": 0}, {"anchor_score_factor": -1.0},
                                {"anchor_score_factor": float("inf")}, {"anchor_score_factor": float("nan")},
                                {"anchor_score_factor": True}, {"anchor_score_factor": "2"},
                                {"demote_superseded_continued": 1}])
def test_eviction_option_validation(kw):
    with pytest.raises(KVStoreError, match=next(iter(kw))):
        KVStoreOptions(**kw)
