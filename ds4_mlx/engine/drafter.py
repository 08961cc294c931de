"""The drafter protocol of speculative decoding (``engine/speculative.py``) and the scripted drafter.

A drafter guesses the next tokens cheaply; the target model checks them all in one batched verify
step and keeps the longest prefix it agrees with. The drafter only ever *proposes*: every emitted
token is the target's own choice, so a bad drafter costs speed, never correctness.

The calls, in the order the speculator makes them during one generation:

    reset()                          forget everything (each generation starts with it, so a
                                     restored or re-synced session speculates again from scratch)
    start(tokens, None)              the target's context: the prompt (its hidden rows are not kept
                                     by the prefill, hence None)
    then, for every token x the target chooses and feeds (in order, none skipped):
    accept(tokens, hidden)           tokens = the target's choices since the last call, ending with
                                     x: drafts it agreed with, then its own correction or bonus
                                     token; hidden[i] = the target's last-block output row
                                     [n_hc, n_embd] (float32) at the position *before* tokens[i] —
                                     the row whose logits chose tokens[i] — or None when the step
                                     that chose them returned no rows (a plain decode step)
    propose(k)                       up to k tokens continuing the context (…, x); [] = no guess

A drafter that reads other layers than the last (DSpark: the outputs of layers 40-42) names them in
``taps``; its rows are then those layers' HC-stream means [n, len(taps), n_embd] at the same
positions (``Model.forward_verify``'s taps: the same forward, no second pass).

So ``len(hidden) == len(tokens)`` whenever hidden is given, and ``(hidden[-1], tokens[-1])`` is the
pair ds4's MTP head takes (the target's state at position p and the token at p + 1) to draft the
token at p + 2. Rejected drafts are never passed back: a drafter that keeps state per draft
position rolls it back to the accepted context in ``accept`` itself.

``ScriptedDrafter`` (the benchmark's and the tests' drafter, no weights) knows the target's
continuation and proposes it with a chosen per-token error rate.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import InferenceError


class Drafter(abc.ABC):
    """The protocol (module docstring). ``wants_hidden``: the speculator passes the target's rows;
    ``taps``: the layers whose HC-mean outputs those rows are (None: the last block's HC rows)."""

    wants_hidden: bool = False
    taps: tuple[int, ...] | None = None

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget everything (a new generation, a restored session)."""

    @abc.abstractmethod
    def start(self, tokens: Sequence[int], hidden: mx.array | None) -> None:
        """The target's context is ``tokens``; ``hidden``: rows [n, n_hc, n_embd] predicting its
        last n tokens (n <= n_swa), or None."""

    @abc.abstractmethod
    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens continuing the context."""

    @abc.abstractmethod
    def accept(self, tokens: Sequence[int], hidden: mx.array | None) -> None:
        """The target committed ``tokens`` (module docstring for ``hidden``)."""


class RowDrafter(Drafter):
    """A drafter of a drafter file fed the target's rows (``MTPDrafter``, ``DSparkDrafter``): the
    protocol's bookkeeping they share — the committed tokens, the rows checked against the token
    count and the position of the row that chose ``tokens[0]`` — around their own ``_ingest(q0, h)``
    (rows h for positions q0.., which changes the state only once it succeeded). ``head``: the
    drafter's model (``config``, ``close``); ``label``: its name in errors; ``row_shape`` and
    ``row_what``: one row's shape and what it is."""

    wants_hidden = True
    label = "drafter"

    def close(self) -> None:
        """Unmap the drafter file."""
        self.head.close()

    @property
    @abc.abstractmethod
    def row_shape(self) -> tuple[int, int]: ...

    row_what = "the target's rows"

    @abc.abstractmethod
    def _ingest(self, q0: int, h: mx.array) -> None: ...

    def start(self, tokens: Sequence[int], hidden: mx.array | None) -> None:
        what = f"{self.label} start"
        toks = self._check_tokens(tokens, what)
        h = None if hidden is None else self._rows(hidden, what)
        if h is not None and h.shape[0] > max(len(toks) - 1, 0):
            raise InferenceError(f"{what}: {h.shape[0]} rows for {len(toks)} tokens: the rows "
                                 f"predict the last tokens, so at most {max(len(toks) - 1, 0)}")
        self.reset()
        self.tokens = toks
        if h is not None and h.shape[0]:
            self._ingest(len(toks) - h.shape[0] - 1, h)

    def accept(self, tokens: Sequence[int], hidden: mx.array | None) -> None:
        what = f"{self.label} accept"
        toks = self._check_tokens(tokens, what)
        h = None if hidden is None else self._rows(hidden, what)
        if h is not None and h.shape[0] != len(toks):
            raise InferenceError(f"{what}: {h.shape[0]} rows for {len(toks)} tokens "
                                 f"(one row per token: the row that chose it)")
        if h is not None and h.shape[0] and not self.tokens:
            raise InferenceError(f"{what}: rows before any context (start() first)")
        first = len(self.tokens) - 1  # the position of the row that chose tokens[0]
        self.tokens.extend(toks)
        if h is not None and h.shape[0]:
            self._ingest(first, h)

    def _rows(self, hidden, what: str) -> mx.array:
        h = hidden if isinstance(hidden, mx.array) else mx.array(np.asarray(hidden, dtype=np.float32))
        if h.ndim != 3 or tuple(h.shape[1:]) != tuple(self.row_shape):
            raise InferenceError(f"{what}: rows must be [n, {', '.join(map(str, self.row_shape))}] "
                                 f"({self.row_what}), got shape {tuple(h.shape)}")
        return h.astype(mx.float32)

    def _check_tokens(self, tokens: Sequence[int], what: str) -> list[int]:
        out = [int(t) for t in tokens]
        n_vocab = self.head.config.n_vocab
        bad = [t for t in out if not 0 <= t < n_vocab]
        if bad:
            raise InferenceError(f"{what}: token id {bad[0]} is outside the vocabulary 0..{n_vocab - 1}")
        return out


class ScriptedDrafter(Drafter):
    """Proposes ``script`` (the target's token sequence: a prompt and its plain continuation) from
    where the context stands, each draft token replaced with probability ``error_rate`` by another
    id. The errors are a deterministic function of (seed, position), so a run repeats exactly.
    A context that left the script gets no proposals."""

    def __init__(self, script: Sequence[int], error_rate: float = 0.0, seed: int = 0, n_vocab: int = 129280):
        if not 0.0 <= float(error_rate) <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate!r}")
        self.script = [int(t) for t in script]
        self.error_rate, self.seed, self.n_vocab = float(error_rate), int(seed), int(n_vocab)
        self.context: list[int] = []

    def reset(self) -> None:
        self.context = []

    def start(self, tokens, hidden) -> None:
        self.context = [int(t) for t in tokens]

    def accept(self, tokens, hidden) -> None:
        self.context.extend(int(t) for t in tokens)

    def wrong(self, p: int) -> bool:
        """Whether the draft for position ``p`` is an error."""
        return random.Random(self.seed * 1_000_003 + p).random() < self.error_rate

    def propose(self, k: int) -> list[int]:
        n = len(self.context)
        if n > len(self.script) or self.script[:n] != self.context:
            return []
        out = []
        for p in range(n, min(n + k, len(self.script))):
            t = self.script[p]
            out.append((t + 1 + p % 7) % self.n_vocab if self.wrong(p) else t)
        return out
