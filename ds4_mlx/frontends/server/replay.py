"""Exact tool-call replay: tool-call id -> the exact DSML bytes the model sampled.

When a client sends a tool call back in its history, ds4 renders the sampled block verbatim
instead of the canonical rendering, so the prompt is byte-identical to what the KV cache holds.
The map is bounded (least recently used ids go first) and lives in the server process; a block
with several calls is replayed only when the message carries exactly that block's ids.

With ``--kv-disk-dir`` the map is persisted as ds4 does it: every checkpoint the disk cache writes
carries, in its KTM section, the ids whose DSML its text holds (:meth:`entries_in`), and a request
naming ids the map does not know looks them up in the directory's KTM sections
(:meth:`restore_from_dir`), so a restarted server still replays byte for byte."""

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

    def entries_in(self, text: bytes) -> dict[str, str]:
        """``{id: dsml}`` of the recorded blocks that occur in ``text`` (a checkpoint's key)."""
        with self._lock:
            items = list(self._map.items())
        out = {}
        found: dict[str, bool] = {}
        for i, (_, raw) in items:
            hit = found.get(raw)
            if hit is None:
                # a checkpoint taken right after the call lacks its last token (never fed):
                # the block counts as held without its final closing tag
                head = raw.rsplit("</", 1)[0] if "</" in raw else raw
                hit = found[raw] = head.encode("utf-8") in text
            if hit:
                out[i] = raw
        return out

    def restore_from_dir(self, directory, wanted: list[str]) -> int:
        """Learn the ids of ``wanted`` this map lacks from the KTM sections in ``directory``;
        ids of one block share its DSML, which regroups them. Returns the ids learned."""
        from ds4_mlx.engine.kvstore_format import KVFileRejected, read_tool_map
        from ds4_mlx.engine.kvstore_scan import scan_dir
        from ds4_mlx.errors import KVStoreError

        with self._lock:
            missing = {i for i in wanted if i not in self._map}
        if not missing:
            return 0
        try:
            entries = scan_dir(directory).entries
        except KVStoreError:
            return 0
        learned: dict[str, str] = {}
        for entry in sorted(entries, key=lambda e: -e.mtime_ns):
            if not entry.has_tool_map:
                continue
            try:
                tool_map = read_tool_map(entry)
            except KVFileRejected:
                continue
            if missing & tool_map.keys():
                for i, raw in tool_map.items():
                    learned.setdefault(i, raw)
                missing -= tool_map.keys()
            if not missing:
                break
        blocks: dict[str, list[str]] = {}
        for i, raw in learned.items():
            blocks.setdefault(raw, []).append(i)
        for raw, ids in blocks.items():
            self.record(ids, raw)
        return len(learned)

    @staticmethod
    def call_ids(messages: list[dict]) -> list[str]:
        out = []
        for m in messages:
            calls = m.get("tool_calls") if m.get("role") == "assistant" else None
            for c in calls or ():
                if isinstance(c, dict) and isinstance(c.get("id"), str):
                    out.append(c["id"])
        return out

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
