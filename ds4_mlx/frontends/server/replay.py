"""Exact tool-call replay: tool-call id -> the exact DSML bytes the model sampled.

When a client sends a tool call back in its history, ds4 renders the sampled block verbatim
instead of the canonical rendering, so the prompt is byte-identical to what the KV cache holds.
The map is bounded (least recently used ids go first) and lives in the server process; a block
with several calls is replayed only when the message carries exactly that block's ids."""

from __future__ import annotations

import threading
from collections import OrderedDict


class ReplayMap:
    def __init__(self, max_ids: int = 100_000) -> None:
        self.max_ids = max_ids
        self._map: OrderedDict[str, tuple[tuple[str, ...], str]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._map)

    def record(self, ids: list[str], raw_dsml: str) -> None:
        if not ids or not raw_dsml or self.max_ids <= 0:
            return
        key = tuple(ids)
        with self._lock:
            for i in ids:
                self._map[i] = (key, raw_dsml)
                self._map.move_to_end(i)
            while len(self._map) > self.max_ids:
                self._map.popitem(last=False)

    def lookup(self, ids: list[str]) -> str | None:
        with self._lock:
            first = self._map.get(ids[0]) if ids else None
            if first is None or first[0] != tuple(ids):
                return None
            for i in ids:
                self._map.move_to_end(i)
            return first[1]

    def apply(self, messages: list[dict]) -> list[dict]:
        """Copies of ``messages`` with ``raw_dsml`` set on assistant turns whose calls replay."""
        out = []
        for m in messages:
            calls = m.get("tool_calls") if m.get("role") == "assistant" else None
            if calls:
                ids = [c.get("id") for c in calls if isinstance(c, dict)]
                if ids and all(isinstance(i, str) for i in ids):
                    raw = self.lookup(ids)
                    if raw is not None:
                        m = dict(m, raw_dsml=raw)
            out.append(m)
        return out
