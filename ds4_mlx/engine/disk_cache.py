"""A session's disk KV cache: when to look up, load, and save checkpoints (ds4-server's rules).

``KVStore`` (``kvstore.py``) owns the files and ``kvstore_policy.py`` the arithmetic; this module
decides, for one live ``Session``, when each happens. Frontends (the CLI now, the server later)
call only ``DiskCache``.

``sync(session, prompt)`` brings the session to a prompt, in ds4-server's order:

1. *Live*: the live tokens are a prefix of the prompt (and not empty): only the rest is computed.
   The session decides this (``Session.plan``), as it decides every reuse of its own state;
   ``snapshots=True`` (the server's session pool) lets it also restore one of its in-memory
   snapshots here, before the disk is searched (otherwise they serve only after a disk miss, when
   the session computes the prompt).
2. Otherwise the previous conversation is saved whole as "evict" (when it holds ``min_tokens``
   or more; loading or rebuilding is about to replace it), and the store is searched two ways:
   for the longest stored token sequence that is a prefix of the prompt (exact; ds4-mlx's own
   key), and, as ds4 does, for the longest stored text that is a byte prefix of the rendered
   prompt. The hit holding more tokens is loaded; on a tie the token match (they are usually the
   same file). A text hit continues with the checkpoint's *own* tokens followed by the prompt's
   own tokens after the matched bytes (the effective prompt), because the stored state is the
   state of those tokens, whatever our tokenizer would make of the same bytes.

   Reuse never changes how user text tokenizes. Bytes alone cannot tell ``<｜Assistant｜>`` the
   control token from the same characters typed by a user, so a text hit is taken only when (a)
   the matched bytes end exactly on a boundary between two prompt tokens (the rest of the prompt
   keeps its tokens; it is never re-tokenized, which would turn typed markers into control
   tokens), (b) the checkpoint's tokens spell exactly its text, and (c) its control tokens (ds4's
   specials and every added token) sit at the same byte offsets, with the same ids, as the
   prompt's in the matched part. Otherwise the hit is refused (``refused`` says why) and the
   token match, or a miss, is used: the effective prompt then *is* the prompt.

   A file the store rejects (damage, truncation), whose payload the session refuses, or whose
   stored token list holds an id outside the vocabulary (valid checksums do not make its ids
   valid) is marked (``mark_unloadable``: logged once, kept on disk, never offered again by this
   process) and the next best one tried; the session is left as it was before the attempt.
3. On a miss, a fresh prompt gets ds4's *cold* save: sync to ``cold_store_len``, store, then sync
   the rest.

Continued saves. Whenever the live length reaches a multiple of ``continued_step`` (ds4's
``ceil(10000 / 2048) * 2048 = 10240``) beyond the largest length saved or loaded so far, the live
session is stored as "continued". During a prompt sync the sync is cut into segments that end
exactly on such frontiers, so every continued checkpoint is an aligned restart point, as ds4's
prefill-chunk callback makes it; during generation ``after_eval`` checks after each token. The
"largest length saved or loaded" follows ds4: the loaded length after a disk hit, 0 after a miss,
unchanged on a live hit. A cold cut that lands on a frontier counts as saved before the prefill
starts (ds4 suppresses the duplicate continued write there; the mark is undone if the cold write
fails), so, exactly as in ds4, the frontiers below such a cut are not written during that prefill:
the cold checkpoint covers them.

Saves never raise: a failed or skipped write is reported in the returned ``SaveResult`` and the
run goes on, as in ds4. Each attempt gives exactly one ``SaveResult``, which is *the* report: the
library logs it once more only at INFO (``ds4_mlx.disk_cache``, off unless a frontend turns
logging on) and the store below raises rather than logs, so a frontend that prints each result on
its own stderr line shows one line per failed save. A state holding NaN or infinity is never
written (status "skipped", naming the array).

Exit status policy for frontends (the CLI follows it): when generation succeeded and only the
cache failed (unwritable directory, full disk, a skipped save), the run still exits 0, with one
stderr warning line per failed or skipped save, as ds4 goes on without its cache. A cache
directory that cannot be used at all is an error at open: ``DiskCache(...)`` raises
``KVCacheDirError`` (a ``KVStoreError``) when the path is a regular file or cannot be created.

Exit save. ``close(session)`` stores the whole live session ("shutdown"), as ds4-server does when
it stops. The CLI calls it only on request (``--kv-cache-save-on-exit``): ds4's CLI keeps no disk
cache, and the server's shutdown save is of a conversation its next request extends. A one-shot
run's final state (prompt + answer) is only a prefix of a later prompt that replays the answer (a
raw transcript continued by hand); the usual next prompt (the same document with another
question) diverges before the answer and is served by the cold and continued checkpoints. Saved
every run, that file would cost a full-length write and, as an anchor (score x2, see
``kvstore_policy``), crowd out useful continued checkpoints.

One ``DiskCache`` per directory and process (``KVStore``'s single-writer rule); the per-session
save frontier is kept in a weak map, so sessions may come and go.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds4_mlx.engine.kvstore import KVStore, LoadedEntry
from ds4_mlx.engine.kvstore_format import Entry, KVFileRejected, KVSaveSkipped, SaveReason, read_trailer_tokens
from ds4_mlx.engine.kvstore_policy import (
    DEFAULT_BUDGET_MB,
    DEFAULT_OPTIONS,
    KVStoreOptions,
    cold_store_len,
    continued_save_due,
    continued_step,
)
from ds4_mlx.engine.kvstore_scan import check_cache_dir
from ds4_mlx.engine.payload import VERSION as PAYLOAD_VERSION
from ds4_mlx.engine.payload import NonFiniteStateError, PayloadError
from ds4_mlx.engine.session import Session
from ds4_mlx.errors import KVStoreError

logger = logging.getLogger("ds4_mlx.disk_cache")


@dataclass(frozen=True)
class SaveResult:
    """One attempted checkpoint write. ``status``: "stored" (``path`` is the file; it may be an
    identical checkpoint that was already there), "skipped" (below ``min_tokens`` or larger than
    the budget) or "failed" (``detail`` says why)."""

    reason: str
    tokens: int
    status: str
    path: Path | None = None
    detail: str = ""

    @property
    def stored(self) -> bool:
        return self.status == "stored"


@dataclass(frozen=True)
class SyncReport:
    """What ``DiskCache.sync`` did.

    ``effective_prompt``: the tokens the session now holds (the prompt, or after a text hit the
    checkpoint's tokens plus the prompt's tokens after the matched text). ``cached_tokens``: tokens whose
    state was taken rather than computed. ``source``: "live", "snapshot" (``sync(snapshots=True)``),
    "disk-tokens", "disk-text" or "none". ``hit_path``: the loaded file. ``saved``: the writes made on the way, in order.
    ``refused``: "path: reason" for each checkpoint that was found but could not be used.
    """

    effective_prompt: list[int]
    cached_tokens: int
    source: str
    saved: list[SaveResult] = field(default_factory=list)
    hit_path: Path | None = None
    refused: list[str] = field(default_factory=list)


class DiskCache:
    """ds4-server's disk KV cache policy around one engine and a ``KVStore`` directory.

    ``engine``: an ``Engine`` (model identity, quant bits, tokenizer, chat marker ids). ``ctx``:
    the context size of the sessions it serves (files record it; larger-ctx files are skipped).
    ``budget_mb``: directory budget in MiB (0 = ds4's 4096). ``options``: ds4's ``--kv-cache-*``
    settings.
    """

    def __init__(self, engine, directory: str | os.PathLike, budget_mb: float = DEFAULT_BUDGET_MB,
                 ctx: int = 32768, options: KVStoreOptions = DEFAULT_OPTIONS, *,
                 clock: Callable[[], float] = time.time):
        check_cache_dir(directory)  # before the model id is computed: fail fast on a bad path
        self.engine = engine
        self.ctx = ctx
        self.options = options
        self.store = KVStore(directory, budget_mb, model_id=engine.model_id, quant_bits=engine.quant_bits,
                             ctx=ctx, payload_version=PAYLOAD_VERSION, options=options, clock=clock,
                             lock_timeout=engine.load_plan.kv_lock_timeout)  # the load plan's wait
        self._tokenizer = engine.tokenizer
        self._user_id = engine.user_id
        self._assistant_id = engine.assistant_id
        tok = self._tokenizer
        self._control_ids = frozenset(tok.special_ids.values()) | {a.id for a in tok.added_tokens}
        # Ids both the tokenizer (text layout) and the model (embedding) accept. A file's stored
        # token list is checked against it before any use: its checksums prove only that the
        # bytes are as written, and an id outside it would fail every request with this prefix.
        self._n_vocab = min(tok.vocab_size, engine.config.n_vocab)
        self._step = continued_step(options)
        self._last_saved: weakref.WeakKeyDictionary[Session, int] = weakref.WeakKeyDictionary()
        # tool_memory(key_text) -> {tool call id: exact DSML}: the replays a saved checkpoint's
        # text holds, stored in its KTM section (ds4's tool memory); None stores none
        self.tool_memory: Callable[[bytes], dict[str, str]] | None = None

    @property
    def directory(self) -> Path:
        return self.store.directory

    def last_saved(self, session: Session) -> int:
        """Largest length saved or loaded for ``session`` since its last cache miss (ds4's
        ``continued_last_store_tokens``); continued saves happen only beyond it."""
        return self._last_saved.get(session, 0)

    # -- prompt sync -------------------------------------------------------------------------------

    def sync(self, session: Session, prompt_tokens: Sequence[int], *,
             rendered_text: bytes | str | None = None, snapshots: bool = False) -> SyncReport:
        """Bring ``session`` to the prompt through the live state, the disk store or a cold prefill.

        ``rendered_text``: the prompt's rendered text, ds4's lookup key (default: the tokenizer's
        bytes of ``prompt_tokens``; a server passes its chat rendering). ``snapshots``: the
        session's own snapshots come before the disk (module docstring).
        """
        self._check_session(session)
        prompt = [int(t) for t in prompt_tokens]
        if not prompt:
            raise KVStoreError("disk cache sync needs at least one prompt token")
        saved: list[SaveResult] = []
        plan = session.plan(prompt, snapshots=snapshots)
        if plan.source != "cold":  # the session holds a prefix: live (or one of its snapshots)
            saved += self._advance(session, prompt)[0]
            return SyncReport(prompt, plan.reused, plan.source, saved)

        self._last_saved[session] = 0
        if session.pos >= self.options.min_tokens:
            saved.append(self.save(session, "evict"))
        refused: list[str] = []
        text = rendered_text if rendered_text is not None else self._tokenizer.decode_bytes(prompt)
        text_b = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        found = self._load_best(session, prompt, text_b, refused)
        if found is not None:
            hit, effective, source = found
            self._last_saved[session] = len(hit.tokens)
            saved += self._advance(session, effective)[0]
            return SyncReport(effective, len(hit.tokens), source, saved, hit.entry.path, refused)

        cut = cold_store_len(prompt, self._user_id, self._assistant_id, self.options)
        if cut < self.options.min_tokens:
            cut = 0
        suppressed = self._suppress_continued(session, cut)
        if 0 < cut < len(prompt):
            more, cached = self._advance(session, prompt[:cut])
            saved += more
            saved.append(self._cold_save(session, cut, suppressed))
            saved += self._advance(session, prompt)[0]
        else:
            more, cached = self._advance(session, prompt)
            saved += more
            if cut:
                saved.append(self._cold_save(session, cut, suppressed))
        return SyncReport(prompt, cached, "none", saved, None, refused)

    def _check_session(self, session: Session) -> None:
        if session.ctx != self.ctx:
            raise KVStoreError(f"disk cache of {self.directory} serves ctx {self.ctx}, the session has "
                               f"ctx {session.ctx}")

    def _load_best(self, session: Session, prompt: list[int], text: bytes,
                   refused: list[str]) -> tuple[LoadedEntry, list[int], str] | None:
        """Load the checkpoint that covers most of the prompt: the longest token prefix, or the
        longest text prefix when that one holds more tokens and is safe (see the module docstring;
        ties go to the exact token match). Returns (hit, effective prompt, source) or None."""
        unusable: set[str] = set()  # text hits that cannot continue this prompt (not the file's fault)
        layout = None
        while True:
            listing = self.store.scan()  # one listing for both lookups: it is most of their cost
            by_tokens = self.store.lookup(tokens=prompt, scan=listing)
            by_text = self.store.lookup(rendered_text=text, scan=listing)
            if (by_text is not None and by_text.name not in unusable
                    and (by_tokens is None or by_text.tokens > by_tokens.tokens)):
                layout = layout or self._layout(prompt)
                cut, why = self._text_cut(by_text, text, layout)
                if why is not None:
                    refused.append(f"{by_text.path}: {why}")
                    unusable.add(by_text.name)
                    continue
                before = session.snapshot()
                hit = self._load(session, by_text, refused)
                if hit is None:
                    continue
                effective = session.tokens + prompt[cut:]
                if len(effective) < session.ctx:
                    return hit, effective, "disk-text"
                refused.append(f"{by_text.path}: the prompt continued from it has {len(effective)} "
                               f"tokens, ctx is {session.ctx}")
                unusable.add(by_text.name)
                self._put_back(session, before)
                continue
            if by_tokens is None:
                return None
            hit = self._load(session, by_tokens, refused)
            if hit is not None:
                return hit, prompt, "disk-tokens"

    def _layout(self, tokens: Sequence[int]) -> tuple[bytes, list[int], list[tuple[int, int]]]:
        """(bytes of the tokens, byte end of each token, (byte offset, id) of each control token)."""
        ends: list[int] = []
        controls: list[tuple[int, int]] = []
        parts: list[bytes] = []
        pos = 0
        for t in tokens:
            if t in self._control_ids:
                controls.append((pos, t))
            piece = self._tokenizer.token_text(t)
            parts.append(piece)
            pos += len(piece)
            ends.append(pos)
        return b"".join(parts), ends, controls

    def _text_cut(self, entry: Entry, text: bytes, layout) -> tuple[int, str | None]:
        """(prompt tokens covered by ``entry``'s text, None) when the text hit cannot change how
        any byte of the prompt tokenizes, else (0, why not)."""
        spelled, ends, controls = layout
        n = entry.text_bytes
        if spelled[:n] != text[:n]:
            return 0, "the rendered prompt is not its tokens' bytes there: a text match cannot be mapped to tokens"
        cut = bisect.bisect_left(ends, n)
        if n == 0 or cut >= len(ends) or ends[cut] != n:
            return 0, "its text ends inside a prompt token: continuing would re-tokenize the prompt"
        data = read_trailer_tokens(entry)
        if data is None:
            return 0, "its stored tokens cannot be read"
        ids = np.frombuffer(data, dtype="<u4")
        bad = self._out_of_vocab(ids)
        if bad is not None:  # the file's fault, not this prompt's: never offer it again
            self.store.mark_unloadable(entry, bad)
            return 0, bad
        own = self._layout(ids.tolist())
        if own[0] != text[:n]:
            return 0, "its tokens do not spell its key text (a visible-transcript key)"
        if own[2] != [c for c in controls if c[0] < n]:
            return 0, ("its control tokens differ from the prompt's in the matched text (typed "
                       "marker characters are not markers)")
        return cut + 1, None

    def _out_of_vocab(self, ids) -> str | None:
        """Why a stored token list cannot be used here (its first id outside the vocabulary), or None."""
        arr = np.asarray(ids, dtype=np.int64)
        bad = np.flatnonzero((arr < 0) | (arr >= self._n_vocab))
        if not bad.size:
            return None
        i = int(bad[0])
        return (f"stored token id {int(arr[i])} at index {i} is outside the vocabulary "
                f"0..{self._n_vocab - 1}")

    def _load(self, session: Session, entry, refused: list[str]) -> LoadedEntry | None:
        """Load ``entry`` into the session; on any refusal put the session back and return None."""
        try:
            hit = self.store.load(entry)
        except KVFileRejected as rej:  # the store remembers it and will not offer it again
            refused.append(f"{entry.path}: {rej.reason}")
            return None
        before = session.snapshot()
        why = self._out_of_vocab(hit.tokens)  # named here rather than as a payload mismatch
        if why is None:
            try:
                session.load_payload(hit.payload)
            except PayloadError as exc:
                why = str(exc)
            else:
                if session.tokens != hit.tokens:
                    why = "payload tokens differ from the file's token list"
        if why is not None:
            self.store.mark_unloadable(hit.entry, why)
            refused.append(f"{entry.path}: {why}")
            self._put_back(session, before)
            return None
        return hit

    @staticmethod
    def _put_back(session: Session, snap) -> None:
        if snap.pos == 0:
            session.reset()
        else:
            session.restore(snap)

    def _advance(self, session: Session, target: list[int]) -> tuple[list[SaveResult], int]:
        """Sync to ``target`` in segments that end on each due continued frontier, saving there.
        Returns the saves and the tokens the first segment took from the live state or a snapshot."""
        saved: list[SaveResult] = []
        reused = None
        if self._step:
            # the first frontier past what the sync takes as is: every one it computes through
            f = (session.plan(target).reused // self._step + 1) * self._step
            while f < len(target):
                if continued_save_due(f, self.last_saved(session), self.options):
                    st = session.sync(target[:f])
                    reused = st.reused if reused is None else reused
                    saved += self._continued(session)
                f += self._step
        st = session.sync(target)
        reused = st.reused if reused is None else reused
        saved += self._continued(session)
        return saved, reused

    def _suppress_continued(self, session: Session, cut: int) -> int | None:
        """A cold cut on a continued frontier: count it as saved now so the sync that stops there
        does not also write it as "continued". Returns the previous mark to restore on failure."""
        if cut and continued_save_due(cut, self.last_saved(session), self.options):
            old = self.last_saved(session)
            self._last_saved[session] = cut
            return old
        return None

    def _cold_save(self, session: Session, cut: int, suppressed: int | None) -> SaveResult:
        res = self.save(session, "cold")
        if res.stored:
            self._note_store(session, cut)
        elif suppressed is not None and self.last_saved(session) == cut:
            self._last_saved[session] = suppressed
        return res

    def _note_store(self, session: Session, n: int) -> None:
        if n > self.last_saved(session):
            self._last_saved[session] = n

    # -- generation and exit ---------------------------------------------------------------------

    def after_eval(self, session: Session) -> SaveResult | None:
        """Call after each generated token is fed: a continued save when one is due, else None."""
        results = self._continued(session)
        return results[0] if results else None

    def _continued(self, session: Session) -> list[SaveResult]:
        if not continued_save_due(session.pos, self.last_saved(session), self.options):
            return []
        res = self.save(session, "continued")
        if res.stored:
            self._note_store(session, res.tokens)
        return [res]

    def close(self, session: Session, reason: str = "shutdown") -> SaveResult | None:
        """Store the whole live session (ds4-server's shutdown save); None when it holds fewer
        than ``min_tokens`` tokens."""
        if session.pos < self.options.min_tokens:
            return None
        return self.save(session, reason)

    def save(self, session: Session, reason: str, *, text: bytes | str | None = None,
             key_kind: str = "token-text") -> SaveResult:
        """Store the live session now with ``reason``; keyed by its rendered tokens unless ``text``
        (a visible-transcript key, with ``key_kind``) is given. Never raises for a failed write.
        Does not move the continued-save frontier (ds4 counts only cold and continued saves)."""
        self._check_session(session)
        SaveReason.parse(reason)  # an unknown reason is the caller's bug, not a failed write
        n = session.pos
        if n == 0:
            return SaveResult(reason, 0, "skipped", detail="the session holds no tokens")
        tokens = session.tokens
        key = text if text is not None else self._tokenizer.decode_bytes(tokens)
        try:
            key_b = key.encode("utf-8") if isinstance(key, str) else bytes(key)
            tool_map = self.tool_memory(key_b) if self.tool_memory is not None else None
            entry = self.store.store(tokens, key, session.payload_chunks(), reason, key_kind=key_kind,
                                     tool_map=tool_map or None)
        except (KVSaveSkipped, NonFiniteStateError) as exc:
            logger.info("kv cache store skipped tokens=%d reason=%s: %s", n, reason, exc)
            return SaveResult(reason, n, "skipped", detail=str(exc))
        except (KVStoreError, PayloadError) as exc:
            # INFO, not WARNING: the SaveResult is the report; logging it louder would print it twice
            logger.info("kv cache store failed tokens=%d reason=%s: %s", n, reason, exc)
            return SaveResult(reason, n, "failed", detail=str(exc))
        if entry is None:
            return SaveResult(reason, n, "skipped", detail="below min tokens or over the budget")
        return SaveResult(reason, n, "stored", entry.path)
