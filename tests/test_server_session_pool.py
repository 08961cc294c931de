"""SessionPool policy without HTTP or a model: which session a request gets, the thinking-visible
and rendered-text rungs, LRU eviction under the count and byte budgets, reported reuse."""

from __future__ import annotations

import pytest

from ds4_mlx.engine.session_pool import PoolError, SessionPool
from ds4_mlx.engine.session import Snapshot, SyncStats, plan_sync


class FakeSession:
    """Tokens only, over the session's own sync decision (``plan_sync``): the live prefix or a kept
    snapshot is reused, the rest counted as computed."""

    ctx = 1000

    def __init__(self):
        self._tokens: list[int] = []
        self._kept: list[Snapshot] = []
        self.on_prefill = None
        self.computed = 0

    @property
    def tokens(self):
        return list(self._tokens)

    @property
    def pos(self):
        return len(self._tokens)

    def checkpoints(self):
        return sorted({k.pos for k in self._kept})

    def plan(self, target, snapshots=True):
        return plan_sync(self._tokens, self._kept if snapshots else (), list(target))

    def sync(self, target, allow_rebuild=True):
        target = list(target)
        p = self.plan(target)
        self.computed += p.computed
        self._tokens = target
        if self.on_prefill is not None and p.computed:
            self.on_prefill(p.computed, p.computed)
        return SyncStats(p.reused, p.computed, p.source, "prefill")

    def snapshot(self, keep=False):
        if keep:
            live = tuple(self._tokens)
            self._kept = [k for k in self._kept if k.tokens != live] + [Snapshot(live, None, None)]

    def memory_bytes(self):
        return 100 * len(self._tokens)

    def generate(self, n):  # what stream_generate leaves: the generated tokens fed
        self._tokens += [900 + i for i in range(n)]


def pool(**kw):
    return SessionPool(FakeSession, eos_id=1, **kw)


def test_live_prefix_and_resend():
    p = pool()
    a = p.prepare([5, 6, 7])
    assert (a.cached, a.source, a.rung) == (0, "none", "cold")
    a.slot.session.generate(3)
    b = p.prepare([5, 6, 7])  # identical resend: the kept prompt-end snapshot
    assert (b.cached, b.source, b.rung) == (3, "live", "snapshot")
    c = p.prepare([5, 6, 7, 8, 9])
    assert (c.cached, c.rung) == (3, "token")


def test_thinking_visible_rung_keeps_hidden_reasoning():
    p = pool()
    a = p.prepare([5, 6, 40])            # ... <Assistant><think>
    a.slot.session.generate(4)           # reasoning </think> content (EOS not fed)
    p.remember_answer(a.slot, [5, 6, 41, 77, 1])  # what the client resends: </think> content EOS
    b = p.prepare([5, 6, 41, 77, 1, 8, 9])
    assert b.rung == "visible" and b.prompt == [5, 6, 40, 900, 901, 902, 903, 1, 8, 9]
    # computed: the EOS closing the live answer and the new suffix; the rest counts as cached
    assert b.cached == 4 and b.slot.session.computed == 3 + 3


def test_sessions_interleave_and_lru():
    p = pool(max_sessions=2)
    a = p.prepare([5, 10, 11])
    b = p.prepare([5, 20, 21])
    assert a.slot is not b.slot and len(p.slots) == 2
    assert p.prepare([5, 10, 11, 12]).slot is a.slot
    assert p.prepare([5, 20, 21, 22]).slot is b.slot
    c = p.prepare([5, 30])               # continues neither: the least recently used (a) goes
    assert c.slot is a.slot and c.cached == 0


def test_named_sessions_and_budget():
    p = pool(max_sessions=3, budget_bytes=1000)
    m = p.prepare([1, 2, 3, 4, 5, 6], session_id="main")
    s = p.prepare([1, 2, 3, 4, 5, 6], session_id="sub")
    assert m.slot is not s.slot and s.cached == 0
    big = p.prepare(list(range(100, 106)))  # 3 x 600 bytes > 1000: LRU evicted down to budget
    assert big.slot in p.slots and m.slot not in p.slots and p.memory_bytes() <= 1000
    with pytest.raises(PoolError):
        SessionPool(FakeSession, max_sessions=0)
    with pytest.raises(PoolError):
        p.prepare([])


def test_prefill_abandon_keeps_computed_tokens():
    p = pool()

    def stop(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        p.prepare([5, 6, 7], on_prefill=stop)
    assert p.slots[0].session.tokens == [5, 6, 7] and p.slots[0].session.on_prefill is None


class FakeTokenizer:
    """Bytes per id: 2 is the control token "<C>", 14 spells the same characters as plain text."""

    TEXT = {2: b"<C>", 10: b"ab", 11: b"a", 12: b"b", 13: b"c", 14: b"<C>", 15: b"bc"}

    def token_text(self, t):
        return self.TEXT[t]

    def decode_bytes(self, ids):
        return b"".join(self.TEXT[t] for t in ids)


def test_rendered_text_rung_continues_another_tokenization():
    p = pool(tokenizer=FakeTokenizer(), control_ids=frozenset({2}))
    p.prepare([2, 10])                    # the live tokens spell "<C>ab"
    b = p.prepare([2, 11, 12, 13])        # the client's ids for "<C>" "a" "b" "c"
    assert b.rung == "text" and b.prompt == [2, 10, 13]
    assert b.cached == 3 and b.slot.session.computed == 2 + 1
    p2 = pool(tokenizer=FakeTokenizer(), control_ids=frozenset({2}))
    p2.prepare([14, 10])                  # typed "<C>" is not the control token
    assert p2.prepare([2, 11, 12, 13]).rung == "cold"
    p3 = pool(tokenizer=FakeTokenizer(), control_ids=frozenset({2}))
    p3.prepare([2, 10])
    assert p3.prepare([2, 11, 15]).rung == "cold"  # "<C>ab" ends inside the prompt's token "bc"
