"""Live sessions kept across requests, and ds4-server's KV reuse ladder over them.

An agent resends its whole transcript every turn; what makes a long transcript cheap is finding
the state that already holds most of it. ``SessionPool.prepare(prompt)`` brings one of up to
``max_sessions`` live ``Session`` objects to the prompt, trying in order (ds4_server.c
``generate_job``, rungs 3-6; rungs 1-2, the Responses / Anthropic tool-id continuations, become
rung 1 here because exact DSML replay makes a tool continuation a plain token prefix):

1. *live token prefix*: the session's tokens are a prefix of the prompt, or a kept snapshot is
   (the end of the previous prompt is always kept, so a resent or edited last turn restores it).
   The session decides which and how much (``Session.plan``): the pool asks it to score a slot,
   and the sync (the disk cache's, with ``snapshots=True``, or the session's own) executes it;
2. *thinking-visible*: after an answer without tool calls the session holds the hidden reasoning,
   while the client resends only the visible transcript (``</think>`` + content + EOS). The pool
   remembers those visible ids; a prompt that extends them continues the live state (reasoning
   kept, as ds4 does) with only the new suffix computed;
3. *rendered-text prefix*: the live tokens spell a byte prefix of the prompt that ends on a
   prompt token boundary with the same control tokens at the same offsets (the model sampled
   another tokenization of the same text); the prompt's own tokens after that point follow;
4. *disk*: the ``DiskCache`` (``--kv-disk-dir``) loads the longest stored prefix (and saves the
   state it replaces as "evict", cold and continued checkpoints as ds4).

Beyond ds4 (its issue #209), the pool keeps several sessions, least recently used first out,
under a byte budget: a sub-agent's request takes a free or old session instead of evicting the
main conversation's KV. A request is matched to the session that reuses the most of it, or to
the one named by the client (``session_id``, the server's ``X-Session-Id`` header).

Reported reuse is in the request's own tokens: ``cached`` = prompt tokens not computed,
``prompt - cached`` were computed (a thinking-visible hit reuses hidden reasoning tokens the
prompt does not contain; they are not counted).

Pure policy apart from the session I/O: no HTTP, no threads; the caller owns the thread the model
lives on.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ds4_mlx.errors import InferenceError


class PoolError(InferenceError):
    """A session pool configured or used wrongly (sizes, an unknown slot)."""


@dataclass(eq=False)
class Slot:
    """One live session and what the pool remembers about it."""

    session: object
    name: str | None = None           # the client's session id, when it gave one
    used: int = 0                     # LRU clock value of the last use
    visible: list[int] | None = None  # ids the client will resend for the last answer (rung 2)
    visible_live: tuple[int, ...] | None = None  # the live tokens that answer left
    prompt_len: int = 0               # length of the last prompt prepared here
    continues_at: int = 0             # reusing this much of it continues the conversation


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` did: ``prompt`` is what the session now holds (the effective prompt to
    generate from), ``cached`` the request's prompt tokens not computed, ``source`` live|disk|none,
    ``rung`` which rule matched (token|snapshot|visible|text|disk|cold), ``reports`` the disk
    cache's report when one was used."""

    slot: Slot
    prompt: list[int]
    cached: int
    source: str
    rung: str
    reports: list = field(default_factory=list)


class SessionPool:
    """``new_session()`` makes a session of the served ctx; ``disk`` is an optional ``DiskCache``
    (its ``sync``/``save`` are used); ``budget_bytes`` caps the live sessions' memory (0: no cap,
    the count alone bounds them); ``tokenizer`` gives token bytes for rung 3 (None: rung 3 off)."""

    def __init__(self, new_session: Callable[[], object], *, max_sessions: int = 1, budget_bytes: int = 0,
                 disk=None, tokenizer=None, control_ids: frozenset[int] = frozenset(), eos_id: int | None = None,
                 min_evict_tokens: int = 512):
        if not isinstance(max_sessions, int) or max_sessions < 1:
            raise PoolError(f"sessions must be an integer >= 1, got {max_sessions!r}")
        if budget_bytes < 0:
            raise PoolError(f"session memory budget must be >= 0, got {budget_bytes}")
        self._new = new_session
        self.max_sessions = max_sessions
        self.budget_bytes = budget_bytes
        self.disk = disk
        self.tokenizer = tokenizer
        self.control_ids = control_ids
        self.eos_id = eos_id
        self.min_evict_tokens = min_evict_tokens
        find = getattr(tokenizer, "token_to_id", None)
        aid = find("<｜Assistant｜>") if find is not None else None
        self._assistant_id = aid if isinstance(aid, int) and aid >= 0 else None
        self.slots: list[Slot] = []
        self._clock = 0

    # -- choosing ----------------------------------------------------------------------------------

    def _touch(self, slot: Slot) -> None:
        self._clock += 1
        slot.used = self._clock

    def _visible_match(self, slot: Slot, prompt: Sequence[int]) -> int:
        v = slot.visible
        if (v is None or slot.visible_live is None or len(prompt) <= len(v)
                or tuple(slot.session.tokens) != slot.visible_live or list(prompt[:len(v)]) != v):
            return 0
        return len(v)

    def _reuse(self, slot: Slot, prompt: Sequence[int], memo: dict) -> int:
        """Tokens of ``prompt`` this slot could serve without computing them (an estimate for
        choosing: the exact count comes from the sync)."""
        best = self._reach(slot.session, prompt)
        return max(best, self._visible_match(slot, prompt), self._text_match(slot, prompt, memo)[0])

    def choose(self, prompt: Sequence[int], session_id: str | None = None) -> Slot:
        """The slot for ``prompt``: the named one (created if new), else the one whose
        conversation it continues (reusing the most); a prompt that continues none gets a free
        slot while there is one, else the least recently used one, so a sub-agent sharing only a
        system prompt with the main thread never overwrites the main thread's KV."""
        return self._choose(prompt, session_id, {})

    def _choose(self, prompt: Sequence[int], session_id: str | None, memo: dict) -> Slot:
        if session_id is not None:
            for slot in self.slots:
                if slot.name == session_id:
                    return slot
            return self._fresh(session_id)
        scored = [(self._reuse(s, prompt, memo), s.used, s) for s in self.slots if s.name is None]
        if scored:
            reuse, _, best = max(scored, key=lambda t: (t[0], t[1]))
            # it continues that conversation when it reuses at least its last prompt (a resend,
            # an edit of the last answer, the next turn) or all of it up to the kept point in its
            # last turn (text appended to that turn); a shared system prompt alone does not
            if reuse > 0 and reuse >= min(best.continues_at or best.prompt_len, best.session.pos):
                return best
        if len(self.slots) < self.max_sessions:
            return self._fresh(None)
        # full: take the least recently used unnamed slot (named ones are the clients' to keep)
        pool = [s for s in self.slots if s.name is None] or self.slots
        slot = min(pool, key=lambda s: s.used)
        slot.name, slot.visible, slot.visible_live = None, None, None
        return slot

    def _fresh(self, name: str | None) -> Slot:
        if len(self.slots) >= self.max_sessions:
            self.evict(min(self.slots, key=lambda s: s.used))
        slot = Slot(self._new(), name)
        self.slots.append(slot)
        return slot

    # -- rung 3: rendered-text prefix -------------------------------------------------------------

    def _layout(self, tokens: Sequence[int]) -> tuple[bytes, list[int], list[tuple[int, int]]]:
        """The bytes ``tokens`` spell, each token's end offset, and (offset, id) of the control
        tokens: one pass over the token texts."""
        parts, ends, controls, pos = [], [], [], 0
        for t in tokens:
            text = self.tokenizer.token_text(t)
            if t in self.control_ids:
                controls.append((pos, t))
            parts.append(text)
            pos += len(text)
            ends.append(pos)
        return b"".join(parts), ends, controls

    def _text_match(self, slot: Slot, prompt: Sequence[int], memo: dict) -> tuple[int, int]:
        """(prompt tokens covered, live tokens) when the live tokens spell a byte prefix of the
        prompt ending on a prompt token boundary with identical control tokens; else (0, 0).
        ``memo`` (one per prepare) keeps the prompt's layout and each slot's answer, so choosing
        a slot and then preparing it lays the prompt out once."""
        if self.tokenizer is None:
            return 0, 0
        if slot in memo:
            return memo[slot]
        live = slot.session.tokens
        memo[slot] = (0, 0)
        if not live or slot.session.plan(prompt).source == "live":
            return memo[slot]  # empty, or already a token prefix (rung 1)
        if "prompt" not in memo:
            memo["prompt"] = self._layout(prompt)
        prompt_b, ends, controls = memo["prompt"]
        live_b, _, live_controls = self._layout(live)
        n = len(live_b)
        if not prompt_b.startswith(live_b):
            return memo[slot]
        cut = bisect.bisect_left(ends, n)
        if cut >= len(ends) - 1 or ends[cut] != n:
            return memo[slot]  # ends inside a token (continuing would re-tokenize), or nothing after it
        if live_controls != [c for c in controls if c[0] < n]:
            return memo[slot]  # typed marker characters are not markers
        memo[slot] = (cut + 1, len(live))
        return memo[slot]

    # -- preparing a request ------------------------------------------------------------------------

    def prepare(self, prompt: Sequence[int], *, session_id: str | None = None,
                on_prefill: Callable[[int, int], None] | None = None) -> Prepared:
        """Bring a session to ``prompt`` through the ladder (module docstring). ``on_prefill`` is
        the session's chunk hook for the sync (raise from it to abandon: the chunks computed so
        far stay in the session, reusable by the next request)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise PoolError("the prompt is empty")
        memo: dict = {}
        slot = self._choose(prompt, session_id, memo)
        self._touch(slot)
        s = slot.session
        effective, rung_hint, hint_live = prompt, None, 0
        vis = self._visible_match(slot, prompt)
        if vis and self.eos_id is not None:
            live = list(slot.visible_live)
            effective, rung_hint, hint_live = live + [self.eos_id] + prompt[vis:], "visible", len(live)
        else:
            n_prompt, n_live = self._text_match(slot, prompt, memo)
            if n_prompt:
                effective = s.tokens + prompt[n_prompt:]
                rung_hint, hint_live = "text", n_live
        slot.visible, slot.visible_live = None, None
        slot.prompt_len = len(prompt)
        slot.continues_at = self._turn_end(prompt) or len(prompt)
        if len(effective) >= s.ctx:  # the hidden part pushed it over: use the prompt as sent
            effective, rung_hint = prompt, None
        previous = s.on_prefill
        s.on_prefill = on_prefill
        # The last user/tool turn minus its final token is kept restorable too: a client that
        # continues by appending to that turn (Claude Code adds a text block to the user message
        # after a capped answer; more tool results) shares all of it but that final token, which
        # the appended text may change (a trailing "." and the "\n" after it are one pretoken).
        turn_end = self._turn_end(effective)
        if turn_end and self._reach(s, effective) > turn_end:
            turn_end = 0  # the live state (or a kept one) already holds more: nothing to split
        try:
            head, reused, reports, rung, source = self._sync(s, effective[:turn_end] if turn_end else effective)
            if turn_end:
                s.snapshot(keep=True)
                tail = effective[turn_end:]
                effective = head + tail
                reports = reports + self._sync(s, effective)[2]
            else:
                effective = head
        finally:
            s.on_prefill = previous
        if rung_hint is not None and reused >= hint_live:
            rung = rung_hint
        # the prompt end is where a resent or edited last turn diverges: keep it restorable
        s.snapshot(keep=True)
        computed = len(effective) - reused
        cached = max(0, len(prompt) - computed)
        if cached == 0:
            source = "none"
        self.enforce_budget(keep=slot)
        return Prepared(slot, effective, cached, source, rung, reports)

    @staticmethod
    def _reach(s, prompt: Sequence[int]) -> int:
        """How much of ``prompt`` session ``s`` holds, live or in a snapshot it kept (what its
        sync would reuse)."""
        return s.plan(prompt).reused

    def _turn_end(self, prompt: list[int]) -> int:
        """The position before the last token of the turn that precedes the trailing assistant
        prefix (``<｜Assistant｜>`` + ``<think>``/``</think>``), or 0 when the prompt does not end
        with one (or the pool has no tokenizer)."""
        aid = self._assistant_id
        if aid is None or len(prompt) < 5 or prompt[-2] != aid:
            return 0
        return len(prompt) - 3

    def _sync(self, s, target: list[int]):
        """One sync of ``s`` to ``target`` (through the disk cache when there is one, the session's
        own snapshots first): (the tokens the session now holds, tokens reused, disk reports, rung,
        source)."""
        rungs = {"live": "token", "snapshot": "snapshot"}
        if self.disk is not None:
            rep = self.disk.sync(s, target, snapshots=True)
            reused = rep.cached_tokens
            rung = "disk" if rep.source.startswith("disk") else (rungs.get(rep.source, "cold") if reused else "cold")
            source = "disk" if rung == "disk" else ("live" if reused else "none")
            return list(rep.effective_prompt), reused, [rep], rung, source
        st = s.sync(target)
        reused = st.reused
        rung = rungs.get(st.source, "cold") if reused else "cold"
        return list(target), reused, [], rung, "live" if reused else "none"

    def remember_answer(self, slot: Slot, visible_ids: Sequence[int] | None) -> None:
        """After a tool-less answer ended by EOS: the ids the client will resend for the
        transcript so far (``None`` forgets). The session's current tokens are what they map to."""
        if visible_ids is None:
            slot.visible, slot.visible_live = None, None
            return
        slot.visible = [int(t) for t in visible_ids]
        slot.visible_live = tuple(slot.session.tokens)

    # -- memory and exit ---------------------------------------------------------------------------

    def memory_bytes(self) -> int:
        return sum(s.session.memory_bytes() for s in self.slots)

    def enforce_budget(self, keep: Slot | None = None) -> list:
        """Evict least recently used slots (never ``keep``) while over the byte budget."""
        results = []
        while self.budget_bytes and len(self.slots) > 1 and self.memory_bytes() > self.budget_bytes:
            victims = [s for s in self.slots if s is not keep]
            if not victims:
                break
            results.append(self.evict(min(victims, key=lambda s: s.used)))
        return [r for r in results if r is not None]

    def evict(self, slot: Slot):
        """Drop ``slot``, saving it to the disk cache first ("evict") when it is worth it."""
        if slot not in self.slots:
            raise PoolError("evict: the slot is not in this pool")
        self.slots.remove(slot)
        if self.disk is not None and slot.session.pos >= self.min_evict_tokens:
            return self.disk.save(slot.session, "evict")
        return None

    def save_all(self, reason: str = "shutdown") -> list:
        """ds4-server's exit save: every live session to the disk cache (None entries skipped)."""
        if self.disk is None:
            return []
        out = []
        for slot in sorted(self.slots, key=lambda s: s.used):
            res = self.disk.close(slot.session, reason)
            if res is not None:
                out.append(res)
        return out

    def describe(self) -> list[Mapping]:
        return [{"name": s.name, "tokens": s.session.pos, "bytes": s.session.memory_bytes()}
                for s in sorted(self.slots, key=lambda s: -s.used)]
