"""Flash 0731's DSpark drafter as a ``Drafter`` (``engine/drafter.py``'s protocol).

The verifier owns the target's state and the accept/reject decision; the drafter only proposes.
It asks for the target's taps (``taps``: the file's target layers, 40-42 in the real file): the rows
it gets are those layers' HC-mean outputs, ``hidden[i]`` at the position before ``tokens[i]``.

Its state is one context KV ring per stage: the rows of the last n_swa committed positions that
have taps, contiguous (docs/speculative.md §2; ds4's ``dspark_raw_cache``). Draft slots never enter
it, so ``propose`` changes nothing and a rejection needs no rollback: the state after ``accept`` is a
fresh drafter's given the same committed rows. A position without taps (a plain decode step, or the
prompt: the verifier passes no prefill rows) leaves a gap, and the rows after a gap restart the
rings, as ds4 resets its window on a gap. A proposal at L (the last committed token at L) needs
the rows up to L - 1: the one that chose t_L. Without it ``propose`` returns nothing and the
verifier's one-token verify brings it (``Speculator._step``).
"""

from __future__ import annotations

import mlx.core as mx

from ds4_mlx.engine.drafter import RowDrafter
from ds4_mlx.errors import DraftError, InferenceError
from ds4_mlx.model.dspark import DSparkHead

# ds4's --dspark-confidence default: drafts are kept while sigmoid(confidence) >= this (0: keep all)
DEFAULT_CONFIDENCE = 0.455


class DSparkDrafter(RowDrafter):
    """ds4's DSpark drafter (``model.dspark.DSparkHead``) driven by the verifier (module docstring)."""

    label = "DSpark drafter"

    def __init__(self, head: DSparkHead, target, confidence: float = DEFAULT_CONFIDENCE):
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 <= confidence < 1:
            raise DraftError(f"DSpark confidence threshold must be in [0, 1), got {confidence!r}")
        self.head, self.target, self.confidence = head, target, float(confidence)
        self.taps = head.taps
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.rings: list[mx.array] = [self.head.empty_rows() for _ in self.head.stages]
        self.end: int | None = None  # the rings hold the rows of positions end - m .. end - 1

    @property
    def row_shape(self) -> tuple[int, int]:
        return len(self.taps), self.head.config.n_embd

    @property
    def row_what(self) -> str:
        return f"the HC-mean outputs of target layers {list(self.taps)}"

    # -- the protocol ---------------------------------------------------------------------------------

    def propose(self, k: int) -> list[int]:
        L = len(self.tokens) - 1  # the anchor's position
        if k <= 0 or self.end is None or self.end != L:
            return []  # no row up to L - 1 yet: the verifier's next rows bring it
        return self.head.propose(self.target, self.rings, self.tokens[-1], L, k, self.confidence)

    # -- inside -----------------------------------------------------------------------------------------

    def _ingest(self, q0: int, h: mx.array) -> None:
        """The target's tap rows h for positions q0..q0+r-1 into the rings (after a gap: restarted),
        keeping the last n_swa; the state changes only once the rows are computed."""
        n_swa = self.head.config.n_swa
        r = int(h.shape[0])
        if self.end is not None and q0 < self.end:
            raise InferenceError(f"DSpark drafter: rows for position {q0}, but it holds rows up to {self.end - 1}")
        rings = self.rings if self.end == q0 else [self.head.empty_rows() for _ in self.rings]
        if r > n_swa:
            q0, h, r = q0 + r - n_swa, h[r - n_swa:], n_swa
        new = self.head.context_kv(h, q0)
        rings = [mx.concatenate([ring, rows], axis=0)[-n_swa:] for ring, rows in zip(rings, new)]
        mx.eval(*rings)
        self.rings, self.end = rings, q0 + r

def load_dspark_drafter(path, target, checkpoint=None, confidence: float = DEFAULT_CONFIDENCE) -> DSparkDrafter:
    """A ``DSparkDrafter`` for ``target`` (a loaded 0731 ``Model``) from the DSpark GGUF at ``path``
    (``model.drafter_loader.load_drafter``: validated, refused with a DrafterError when it does not
    belong to the target)."""
    from ds4_mlx.errors import DrafterError
    from ds4_mlx.model.drafter_loader import load_drafter

    head = load_drafter(path, target, checkpoint)
    if not isinstance(head, DSparkHead):
        head.close()
        raise DrafterError(f"{path}: an MTP head, not a DSpark drafter")
    return DSparkDrafter(head, target, confidence)
