"""Drafters for speculative decoding: the protocol the verifier drives, and the preview's MTP head.

The verifier (``engine/speculative.py``) owns the target's state and the accept/reject decision; a
drafter only proposes. Its own state must always describe the *committed* history, never a
rejected guess: ``MTPDrafter.propose`` runs on a copy of its window, so rolling back after a
rejection costs nothing and the state after ``accept`` equals a fresh drafter's fed the same
history (bit for bit in ds4-cpu numerics).

MTP protocol, as ds4 pairs things (docs/speculative.md): every committed position q whose target
row h_q (the last block's HC-stream output, [n_hc, n_embd]) the drafter has been given is
*anchored*: the MTP step ran there on (h_q, t_q) and its KV row is in the window. Committed
positions after the last anchored one are *pending*: a proposal first runs them recursively (the
previous step's own output as h, as ds4 does for its drafts) on the scratch copy. Then draft 0 is the
argmax of the last step's logits (the token at position n; on an anchored last position, the same
guess the target's own logits make), draft i the argmax after one more recursive step on draft i-1.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import InferenceError
from ds4_mlx.model.mtp import DraftWindow, MTPHead


# NOTE for the merge: the verifier branch (issue-25-verify) defines this protocol in
# engine/speculative.py; this copy has the same signatures and goes once that file is in.
class Drafter(abc.ABC):
    wants_hidden: bool = False  # True: the verifier passes the target's hidden rows

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget everything (an empty context)."""

    @abc.abstractmethod
    def start(self, tokens: Sequence[int], hidden: mx.array | None) -> None:
        """The target's context is ``tokens``; ``hidden``: the target's last-block HC-stream rows
        [n, n_hc, n_embd] float32 of the last n positions of ``tokens`` (None if not wanted)."""

    @abc.abstractmethod
    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens continuing the context (the drafter's state is unchanged)."""

    @abc.abstractmethod
    def accept(self, tokens: Sequence[int], hidden: mx.array | None) -> None:
        """The target committed ``tokens`` (accepted drafts + its correction/bonus token) with its rows
        for them; the drafter drops whatever it guessed past them."""


class MTPDrafter(Drafter):
    """The preview checkpoint's MTP head (``model.mtp``) as a ``Drafter``.

    ``hidden`` rows always belong to the earliest committed positions that have none yet, in order
    (``start``: the last n positions of its tokens). So ``accept(drafts_ok + [bonus], rows of
    drafts_ok)`` leaves the bonus token pending, and a later ``accept([], row of bonus)`` (after the
    target fed it) anchors it: exactly ds4's cycle. Rows for more positions than are pending are an
    error. At least the last position of ``start`` must come with its row.
    """

    wants_hidden = True

    def __init__(self, head: MTPHead, target):
        self.head, self.target = head, target
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.window: DraftWindow = self.head.empty_window()
        self.anchored = 0  # positions 0..anchored-1 are anchored (or before the window)
        self.state_hc: mx.array | None = None  # H_out of the step at anchored-1
        self.logits: np.ndarray | None = None  # its logits (draft 0 when nothing is pending)

    def close(self) -> None:
        """Unmap the drafter file."""
        self.head.close()

    @property
    def n_pending(self) -> int:
        return len(self.tokens) - self.anchored

    def _rows(self, hidden, what: str) -> mx.array:
        cfg = self.head.config
        h = mx.array(hidden) if not isinstance(hidden, mx.array) else hidden
        if h.ndim != 3 or tuple(h.shape[1:]) != (cfg.n_hc, cfg.n_embd):
            raise InferenceError(f"{what}: hidden rows must be [n, {cfg.n_hc}, {cfg.n_embd}] (the target's last-block "
                                 f"HC stream), got shape {tuple(h.shape)}")
        return h.astype(mx.float32)

    def _check_tokens(self, tokens: Sequence[int], what: str) -> list[int]:
        out = [int(t) for t in tokens]
        n_vocab = self.head.config.n_vocab
        bad = [t for t in out if not 0 <= t < n_vocab]
        if bad:
            raise InferenceError(f"{what}: token id {bad[0]} is outside the vocabulary 0..{n_vocab - 1}")
        return out

    def _anchor(self, h: mx.array) -> None:
        """Run the anchored steps of the next ``len(h)`` pending positions (one chunk). Only the last
        n_swa of them can reach a later query, so when there are that many the window restarts with
        them (the same rows and the same outputs: a KV row depends on its own position's input only)."""
        r = int(h.shape[0])
        if r == 0:
            return
        p0 = self.anchored
        n_swa = self.head.config.n_swa
        if r >= n_swa:
            self.window = self.head.empty_window()
            p0, h = p0 + r - n_swa, h[r - n_swa:]
        toks = self.tokens[p0: self.anchored + r]
        window = self.window.copy()  # the committed state changes only once the step succeeded
        H, logits = self.head.run(self.target, toks, h, window, p0)
        self.window, self.state_hc, self.logits = window, H, logits
        self.anchored += r

    def start(self, tokens: Sequence[int], hidden: mx.array | None) -> None:
        toks = self._check_tokens(tokens, "MTP drafter start")
        if hidden is None:
            raise InferenceError("the MTP drafter needs the target's hidden rows (wants_hidden): at least the "
                                 "last context position's")
        h = self._rows(hidden, "MTP drafter start")
        if not 1 <= h.shape[0] <= len(toks):
            raise InferenceError(f"MTP drafter start: {h.shape[0]} hidden rows for {len(toks)} tokens (need 1..n)")
        self.reset()
        self.tokens = toks
        self.anchored = len(toks) - int(h.shape[0])
        self._anchor(h)

    def accept(self, tokens: Sequence[int], hidden: mx.array | None) -> None:
        toks = self._check_tokens(tokens, "MTP drafter accept")
        h = None if hidden is None else self._rows(hidden, "MTP drafter accept")
        if h is not None and h.shape[0] > self.n_pending + len(toks):
            raise InferenceError(f"MTP drafter accept: {h.shape[0]} hidden rows, but only "
                                 f"{self.n_pending + len(toks)} committed positions lack one")
        self.tokens.extend(toks)
        if h is not None:
            self._anchor(h)

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        if self.state_hc is None:
            raise InferenceError("the MTP drafter has no context: call start() with the target's rows first")
        head, target = self.head, self.target
        window, H, logits = self.window.copy(), self.state_hc, self.logits
        pos = self.anchored
        for t in self.tokens[self.anchored:]:  # pending committed tokens, recursively
            H, logits = head.run(target, [t], H[None], window, pos)
            pos += 1
        drafts = [int(np.argmax(logits))]
        while len(drafts) < k:
            H, logits = head.run(target, [drafts[-1]], H[None], window, pos)
            drafts.append(int(np.argmax(logits)))
            pos += 1
        return drafts


def load_mtp_drafter(path, target, checkpoint=None, backend: str | None = None) -> MTPDrafter:
    """An ``MTPDrafter`` for ``target`` (a loaded ``Model``) from the drafter GGUF at ``path``
    (``model.drafter_loader.load_drafter``: validated, refused with a DrafterError when it does not
    belong to the target)."""
    from ds4_mlx.model.drafter_loader import load_drafter

    return MTPDrafter(load_drafter(path, target, checkpoint, backend), target)
