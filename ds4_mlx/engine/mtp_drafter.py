"""The preview checkpoint's MTP head as a ``Drafter`` (``engine/drafter.py``'s protocol).

The verifier (``engine/speculative.py``) owns the target's state and the accept/reject decision;
the drafter only proposes. Its state always describes the *committed* history, never a rejected
guess: ``propose`` runs on a copy of the drafter's window (arrays are immutable, the copy is free),
so a rejection costs nothing and the state after ``accept`` is bit for bit a fresh drafter's given
the same history (ds4-cpu numerics).

Rows, as the protocol passes them: ``hidden[i]`` is the target's last-block HC row at the position
*before* ``tokens[i]`` (the row whose logits chose it). ds4's MTP step at a committed position q
takes the target's row *at* q and the token *at* q (docs/speculative.md), so row i is paired with
the token at its own position: the previous token. Every committed position whose row the drafter
got is *anchored* (the step ran on the target's row); the steps run in position order, so a
position the verifier gave no row for (a plain decode step) is run recursively from the previous
step's own output, as ds4 runs its drafts, when at most ``MAX_RECURSE`` of them separate two rows;
a longer gap restarts the window at the next row (as a prefill leaves ds4's window empty). The
last committed token never has its row yet (it predicts the next one), so a proposal first runs
one recursive step over it: draft 0 continues the context, draft i recurses on draft i - 1.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ds4_mlx.engine.drafter import RowDrafter
from ds4_mlx.errors import InferenceError
from ds4_mlx.model.mtp import DraftWindow, MTPHead

# Committed positions without a target row that the drafter runs recursively (a gap between two
# rows, the tokens since the last row at a proposal): ds4's longest recursion (--mtp-draft caps at
# 16). Past that the recursive state says little about the target's; the window restarts instead.
MAX_RECURSE = 16


class MTPDrafter(RowDrafter):
    """ds4's MTP drafter (``model.mtp.MTPHead``) driven by the verifier (module docstring)."""

    label = "MTP drafter"
    row_what = "the target's last-block HC stream"

    def __init__(self, head: MTPHead, target):
        self.head, self.target = head, target
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.window: DraftWindow = self.head.empty_window()
        self.end: int | None = None  # the steps ran for positions < end (None: no step yet)
        self.state_hc: mx.array | None = None  # H_out of the step at end - 1

    @property
    def row_shape(self) -> tuple[int, int]:
        return self.head.config.n_hc, self.head.config.n_embd

    @property
    def n_pending(self) -> int:
        """Committed positions the drafter has not run yet (the last token's at least)."""
        return len(self.tokens) - (self.end if self.end is not None else 0)

    # -- the protocol ---------------------------------------------------------------------------------

    def propose(self, k: int) -> list[int]:
        if k <= 0 or self.end is None or not 0 < self.n_pending <= MAX_RECURSE:
            return []  # no state yet, or too far past it: the verifier's next rows restart it
        head, target = self.head, self.target
        window, H, logits = self.window.copy(), self.state_hc, None
        for q in range(self.end, len(self.tokens)):  # the committed tokens not run yet, recursively
            H, logits = head.run(target, [self.tokens[q]], H[None], window, q, logits=q == len(self.tokens) - 1)
        drafts = [int(np.argmax(logits))]
        pos = len(self.tokens)
        while len(drafts) < k:
            H, logits = head.run(target, [drafts[-1]], H[None], window, pos)
            drafts.append(int(np.argmax(logits)))
            pos += 1
        return drafts

    # -- inside -----------------------------------------------------------------------------------------

    def _ingest(self, q0: int, h: mx.array) -> None:
        """The target's rows h for positions q0..q0+r-1: fill the gap since the last step (recursively,
        or restart the window), then the anchored steps as one chunk. Only the last n_swa of them can
        reach a later query, so a longer run restarts the window with those (the same rows and
        outputs: a KV row depends on its own position's input only). The committed state changes
        only once every step succeeded."""
        head = self.head
        r, n_swa = int(h.shape[0]), head.config.n_swa
        window, H, end = self.window.copy(), self.state_hc, self.end
        if end is not None and q0 < end:
            raise InferenceError(f"MTP drafter: rows for position {q0}, but it ran up to {end - 1} already")
        if end is None or q0 - end > MAX_RECURSE or r >= n_swa:
            window, H = head.empty_window(), None
            if r > n_swa:
                q0, h, r = q0 + r - n_swa, h[r - n_swa:], n_swa
        else:
            for q in range(end, q0):  # positions without rows: ds4's recursion
                H, _ = head.run(self.target, [self.tokens[q]], H[None], window, q, logits=False)
        H, _ = head.run(self.target, self.tokens[q0: q0 + r], h, window, q0, logits=False)
        self.window, self.state_hc, self.end = window, H, q0 + r

def load_mtp_drafter(path, target, checkpoint=None) -> MTPDrafter:
    """An ``MTPDrafter`` for ``target`` (a loaded ``Model``) from the drafter GGUF at ``path``
    (``model.drafter_loader.load_drafter``: validated, refused with a DrafterError when it does not
    belong to the target; ``checkpoint``: the target's, as the engine decided it)."""
    from ds4_mlx.errors import DrafterError
    from ds4_mlx.model.drafter_loader import load_drafter

    head = load_drafter(path, target, checkpoint)
    if not isinstance(head, MTPHead):
        head.close()
        raise DrafterError(f"{path}: a DSpark drafter, not an MTP head (engine.dspark_drafter runs it)")
    return MTPDrafter(head, target)
