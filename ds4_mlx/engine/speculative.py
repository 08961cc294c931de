"""Speculative decoding: a drafter guesses, the target verifies k guesses in one batched step.

The verify step. After the target chose token x (not yet fed), the drafter proposes d1..dk
continuing (…, x); the session runs [x, d1, …, dk] as one chunk (``Session.verify``: the prefill
path, every position's logits, and the state before it kept). Row i of its logits is what plain
decoding would see after feeding x, d1, …, di. The generation loop then chooses tokens exactly as
it always does — from row 0, then row 1 while its choice equals the next draft — so every emitted
token is the target's own choice, made by the same code (sampler, RNG, logits processors,
structural greedy, stop checks) from the same logits. A choice that differs from the draft (the
correction), or one chosen from the last row (the bonus token), ends the verify: ``Session.commit``
keeps the fed prefix and rolls back everything else (``ModelCache.rollback``: raw ring slots,
compressor rows and frontiers, indexer lanes; no re-prefill), and the chosen token starts the
next verify. The drafter's own state is rolled back by the drafter (``Drafter.accept``).

Exactness. In ds4-cpu numerics a chunk's logits at every position are bit-identical to one-token
decode steps (every operation's order is fixed whatever the chunking) and the rolled-back state is
bit for bit plain decoding's, so speculation changes no bit of any logit: the output is plain
decoding's at every temperature and seed. In default numerics plain decoding runs the compiled
one-token step and a verify runs the chunk path: logits differ by BLAS rounding (~5e-6 on the tiny
model, against logits of std ~1), so at temperature 0 the tokens are the same unless two logits tie
within that noise.

Sampling (temperature > 0): the exact semantics, always. The target's token is drawn from its own
distribution p with the plain sampler and RNG, and a draft d is accepted iff the draw equals it.
For a drafter that proposes tokens (a one-hot q), this *is* speculative sampling's rule: accept d
with probability min(1, p(d)/q(d)) = p(d), and on rejection draw from the residual
max(0, p - q) normalised = p without d — the draw conditioned on differing from d is exactly that.
It consumes the RNG as plain decoding does (one draw per token), so a seed gives the same text with
or without a drafter. ds4's opportunistic mode (accept a draft the sampler finds plausible, which
changes the distribution) is not implemented.

Draft length (``DraftLength``): a cost model once the speculator has timed a plain step and a
verify — the k in 0 .. k_max that maximises expected tokens per second from the recent acceptance
and the measured step times — and a greedy rule before that (start at 1, +1 after a fully accepted
verify, accepted + 1 after a partial one, halved after a fully rejected one). At 0 the speculator
runs plain decode steps (the compiled step in default numerics) and probes with one draft after a
back-off that doubles (16 .. 256 tokens) while probes keep failing, so a useless drafter costs a
handful of verify steps per few hundred tokens, and one whose acceptance does not pay for the
verify cost on this machine is dropped too.

Chunk size and boundaries: a verify holds at most n_swa tokens (its raw rows must not overwrite each
other in the ring) and never extends past a multiple of the session's prefill chunk or the disk
cache's continued-save step, so the commits land on every such boundary as plain decoding does
(automatic checkpoints, continued saves see the same lengths).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ds4_mlx.engine.drafter import Drafter
from ds4_mlx.errors import DraftError

DEFAULT_DRAFT_K = 4
MAX_DRAFT_K = 16
BACKOFF_MIN, BACKOFF_MAX = 16, 256


def check_draft_path(draft) -> None:
    """A draft given as a path names a file (checked before the target model loads)."""
    if isinstance(draft, (str, os.PathLike)) and not os.path.isfile(draft):
        raise DraftError(f"draft model {os.fspath(draft)}: no such file")


def load_drafter(path, model) -> Drafter:
    """The drafter stored at ``path`` for ``model`` (an ``Engine``), validated against the loaded
    model and its checkpoint: the preview's MTP head (``engine.mtp_drafter``) or 0731's DSpark file
    (``engine.dspark_drafter``); another checkpoint's or other dims' drafter, or a main model file,
    is a one-line ``DrafterError`` (``model.drafter_loader``)."""
    from ds4_mlx.engine.dspark_drafter import DSparkDrafter
    from ds4_mlx.engine.mtp_drafter import MTPDrafter
    from ds4_mlx.model.drafter_loader import load_drafter as load_head
    from ds4_mlx.model.dspark import DSparkHead

    p = os.fspath(path)
    check_draft_path(p)
    head = load_head(p, model.network, checkpoint=model.checkpoint)
    if isinstance(head, DSparkHead):
        return DSparkDrafter(head, model.network)
    return MTPDrafter(head, model.network)


def check_draft_k(k) -> int:
    """``--draft-k`` / ``draft_k``: an integer 1 .. MAX_DRAFT_K."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise DraftError(f"draft_k must be an integer, got {k!r}")
    if not 1 <= k <= MAX_DRAFT_K:
        raise DraftError(f"draft_k must be in 1..{MAX_DRAFT_K}, got {k}")
    return int(k)


def resolve_drafter(draft, model) -> Drafter | None:
    """``draft`` as given to ``ds4_mlx.load`` / ``generate``: None, a ``Drafter``, or a path."""
    if draft is None or isinstance(draft, Drafter):
        return draft
    if isinstance(draft, (str, os.PathLike)):
        return load_drafter(draft, model)
    raise DraftError(f"draft must be a Drafter or a path to a draft model, got {type(draft).__name__}")


def check_speculation(network) -> None:
    """A model that can verify drafts: one process (a distributed model's ranks hold no rollback)."""
    if not network.can_verify:
        raise DraftError("speculative decoding runs in one process only, not with distributed=...")


@dataclass
class SpecStats:
    """Counters of one generation (or a server's lifetime): drafted / accepted tokens, verify steps."""

    drafted: int = 0
    accepted: int = 0
    verifies: int = 0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def add(self, other: "SpecStats") -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.verifies += other.verifies


class DraftLength:
    """The adaptive draft length with back-off (module docstring).

    Two rules. Until both costs are measured, a greedy one: +1 after a fully accepted verify, down to
    accepted + 1 after a partial one, halved after a fully rejected one. Then a cost model: the
    speculator times every step (``timed``: from the start of a step to the start of the next, so
    what the loop does with the tokens is counted), a plain step costs c0, a verify of k drafts
    cost(k) (measured, else ``cost``'s estimate); with a the recent per-draft acceptance, k drafts
    emit E(k) = 1 + a + … + a^k tokens, and k is the argmax of E(k) / cost(k) over 0 .. k_max
    (0: plain steps). The first
    ``CALIBRATE`` steps of a generation are plain, so c0 is known from the start. At k = 0 the
    speculator backs off (plain steps) and then probes with one draft, the back-off doubling
    (16 .. 256 tokens) while probes fail."""

    CALIBRATE = 2
    DECAY = 0.8     # weight of the older acceptance counts at each verify
    ALPHA = 0.3     # weight of a new time in the cost averages

    def __init__(self, k_max: int):
        self.k_max = check_draft_k(k_max)
        self.k = 1  # one draft first: a useless drafter is found out at the price of one 2-token verify
        self.backoff = BACKOFF_MIN
        self.wait = self.CALIBRATE
        self.hits, self.misses = 1.0, 1.0
        self.c0: float | None = None
        self.t_verify: dict[int, float] = {}  # k -> average seconds of a verify step with k drafts

    def next(self) -> int:
        """The number of drafts to ask for at this token (0: a plain step)."""
        if self.wait > 0:
            self.wait -= 1
            return 0
        return self.k or 1  # k == 0 after the back-off: a probe

    def timed(self, k: int, seconds: float) -> None:
        """A step with ``k`` drafts (0: plain) took ``seconds`` up to the next step."""
        if k == 0:
            self.c0 = seconds if self.c0 is None else (1 - self.ALPHA) * self.c0 + self.ALPHA * seconds
        else:
            old = self.t_verify.get(k)
            self.t_verify[k] = seconds if old is None else (1 - self.ALPHA) * old + self.ALPHA * seconds

    @property
    def acceptance(self) -> float:
        return self.hits / (self.hits + self.misses)

    def cost(self, k: int) -> float:
        """Seconds of a step with ``k`` drafts: measured, or between / beyond the measured ones (a
        verify's cost is affine in k, its intercept above c0: the chunk path's fixed part); beyond
        the largest measured k with the measured slope, or optimistically 10 % of c0 per draft when
        one k is measured, so a longer draft gets tried once the acceptance makes it worth it."""
        if k == 0:
            return self.c0
        t = self.t_verify
        if k in t:
            return t[k]
        lo = max((j for j in t if j < k), default=None)
        hi = min((j for j in t if j > k), default=None)
        if lo is not None and hi is not None:
            return t[lo] + (t[hi] - t[lo]) * (k - lo) / (hi - lo)
        ks = sorted(t)
        slope = (t[ks[-1]] - t[ks[0]]) / (ks[-1] - ks[0]) if len(ks) > 1 else 0.1 * self.c0
        slope = max(slope, 0.0)
        base = lo if lo is not None else hi
        return max(t[base] + slope * (k - base), 1e-9)

    def best(self) -> int | None:
        """The k of the cost model, or None while c0 or every verify cost is unknown."""
        if self.c0 is None or not self.t_verify:
            return None
        a = self.acceptance
        return max(range(self.k_max + 1), key=lambda k: (sum(a ** i for i in range(k + 1)) / self.cost(k), -k))

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        probe = self.k == 0
        self.hits = self.DECAY * self.hits + accepted
        self.misses = self.DECAY * self.misses + (accepted < drafted)
        if accepted == drafted:
            self.k = min(self.k_max, max(self.k, drafted) + 1)
        elif accepted:
            self.k = min(max(self.k, 1), accepted + 1)
        else:
            self.k = (self.k // 2) if not probe else 0
        best = self.best()
        if best is not None:
            self.k = best
        if self.k and accepted:
            self.backoff = BACKOFF_MIN
        elif self.k == 0:
            self.wait = self.backoff
            if probe:
                self.backoff = min(BACKOFF_MAX, self.backoff * 2)


class Speculator:
    """Drives one generation's speculation on ``session`` (see the module docstring).

    The generation loop calls ``logits()`` for the row to choose from and ``feed(token, room)``
    for each chosen token it would feed (``room``: how many more tokens it may still choose after
    this one); ``finish()`` at the end commits what was fed. ``on_commit(session)``: called whenever
    the session holds exactly the fed tokens and a feed just completed there (the disk cache's
    after-feed hook), never while draft tokens are held."""

    def __init__(self, session, drafter: Drafter, k_max: int = DEFAULT_DRAFT_K, *,
                 boundaries: Sequence[int] = (), on_commit: Callable | None = None):
        check_speculation(session.model)
        if not isinstance(drafter, Drafter):
            raise DraftError(f"a drafter must implement ds4_mlx.engine.drafter.Drafter, got {type(drafter).__name__}")
        self.session, self.drafter = session, drafter
        self.length = DraftLength(k_max)
        self.stats = SpecStats()
        self.n_vocab = session.config.n_vocab
        self.n_swa = session.config.n_swa
        self.boundaries = tuple(b for b in (session.chunk, *boundaries) if b and b > 0)
        self.on_commit = on_commit
        self._chunk: list[int] | None = None  # the pending verify's tokens
        self._rows: np.ndarray | None = None
        self._hidden: mx.array | None = None
        self._fed = 0
        self._t_step, self._timed_k = 0.0, None
        drafter.reset()
        drafter.start(session.tokens, None)

    # -- what the loop sees -----------------------------------------------------------------------

    def logits(self) -> np.ndarray:
        if self._chunk is not None:
            return self._rows[self._fed - 1]
        return self.session.logits()

    def feed(self, token: int, room: int) -> None:
        token = int(token)
        if self._chunk is not None:
            if self._fed < len(self._chunk) and self._chunk[self._fed] == token:
                self._fed += 1  # the target chose the draft: its row is computed already
                return
            agreed, hidden = self._settle()
            self.drafter.accept(agreed + [token], hidden)
        else:
            self.drafter.accept([token], None)
        self._step(token, room)

    def finish(self) -> None:
        """Commit what was fed (the loop ends): the session holds exactly the plain run's tokens."""
        if self._chunk is not None:
            self._settle(final=True)

    # -- inside ----------------------------------------------------------------------------------------

    def _settle(self, final: bool = False) -> tuple[list[int], mx.array | None]:
        """Commit the fed prefix of the pending verify; returns the drafts the target agreed with
        and the rows that chose them and the loop's next token (``Drafter.accept``)."""
        chunk, fed, hidden = self._chunk, self._fed, self._hidden
        self._chunk = self._rows = self._hidden = None
        self.session.commit(fed)
        accepted = fed - 1
        self.stats.accepted += accepted
        if not final:
            self.length.update(len(chunk) - 1, accepted)
        if self.on_commit is not None and not final:
            self.on_commit(self.session)
        return chunk[1:fed], None if hidden is None else hidden[:fed]

    def _room(self, room: int) -> int:
        """Drafts that can still be used and fit: rows beyond what the loop may choose are waste; a
        verify stays within n_swa tokens, the context and the next boundary."""
        pos = self.session.pos  # the verify starts here, with the loop's token
        k = min(room - 1, self.n_swa - 1, self.session.ctx - pos - 1)
        for b in self.boundaries:
            k = min(k, b - pos % b - 1)
        return max(k, 0)

    def _step(self, token: int, room: int) -> None:
        now = time.perf_counter()
        if self._timed_k is not None:
            self.length.timed(self._timed_k, now - self._t_step)
        self._t_step, self._timed_k = now, None
        k = min(self.length.next(), self._room(room))
        drafts = self._propose(k) if k else []
        if not drafts and not (k and self.drafter.wants_hidden):
            self._timed_k = 0
            self.session.eval(token)  # a plain step
            if self.on_commit is not None:
                self.on_commit(self.session)
            return
        # (a drafter that wants rows and had none to draft from gets a one-token verify: its rows)
        chunk = [token] + drafts
        self._timed_k = len(drafts) or None  # (a one-token verify for rows is not a cost sample)
        rows, hidden = self.session.verify(chunk, self.drafter.taps if self.drafter.wants_hidden else None)
        self.stats.verifies += 1
        self.stats.drafted += len(drafts)
        self._chunk, self._fed = chunk, 1
        self._rows = np.asarray(rows.astype(mx.float32))
        self._hidden = hidden if self.drafter.wants_hidden else None

    def _propose(self, k: int) -> list[int]:
        out = self.drafter.propose(k)
        if not isinstance(out, (list, tuple)):
            raise DraftError(f"the drafter's propose({k}) returned {type(out).__name__}, not a list of token ids")
        drafts = []
        for t in out[:k]:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < self.n_vocab:
                raise DraftError(f"the drafter proposed {t!r}, not a token id in 0..{self.n_vocab - 1}")
            drafts.append(int(t))
        return drafts
