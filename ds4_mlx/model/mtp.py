"""The preview checkpoint's MTP drafter head: one extra block that guesses the next token from the
target's hidden state, with its own small KV window (ds4: metal_graph_eval_mtp_draft_from_hc).

For a step at position q with token t_q and an input HC state h [n_hc, n_embd] (E = the target's
F16 embedding row, W_out = the target's output matrix, both shared, not in the drafter file):

    e      = e_proj · RMSNorm(E[t_q], enorm)                                  [n_embd]
    H_in[s] = e + h_proj · RMSNorm(h[s], hnorm)          for each stream s     [n_hc, n_embd]
    H_out  = Block(H_in) at position q          (``mtp.0.*``: a target layer's attention and MoE, run
             as the dense layer 1: raw sliding window only, layer 1's RoPE, score routing with
             exp_probs_b; its raw KV rows are the drafter's own ``DraftWindow``)
    logits = W_out · RMSNorm(OutputHC_mtp(H_out), norm)      (hc_head_{fn,scale,base}: the target's
             output mix with the drafter's weights)
    draft  = argmax(logits): the token at q + 1

ds4 pairs h and t_q of the same position: on a committed position (anchored) h is the target's
last-block HC output at q, so the draft there repeats the target's own next-token guess (verified
for free); further drafts recurse with h = the previous step's H_out and t_q = the previous draft.
ds4 runs the drafter only on decode steps, so its window holds the MTP rows of contiguous positions
ending at the last step (at most n_swa of them).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import InferenceError
from ds4_mlx.model.cache import ChunkAt
from ds4_mlx.model.hyper_connection import OutputHC
from ds4_mlx.model.linear import DenseWeight
from ds4_mlx.model.ops import DefaultOps
from ds4_mlx.model.transformer import Block, all_finite, raise_nonfinite

# ds4 evaluates the MTP block as layer 1 (metal_graph_encode_decode_layer(..., il = 1, ...)): its
# compress ratio (0: raw window only) and RoPE parameters are that layer's.
MTP_LAYER = 1


class DraftWindow:
    """The MTP block's raw KV rows: those of the last m <= n_swa positions it ran, oldest first,
    ending at ``end - 1``. Stands in for a ``LayerCache`` of a ratio-0 layer (``Attention`` uses
    only ``at`` and ``update_raw`` of such a layer's cache). Arrays are never changed in place, so
    ``copy`` is a free snapshot: proposals run on a copy and rolling back is dropping it."""

    def __init__(self, n_swa: int, head_dim: int, rows: mx.array | None = None, end: int = 0):
        self.n_swa, self.head_dim = n_swa, head_dim
        self.rows = rows if rows is not None else mx.zeros((0, head_dim), dtype=mx.float32)
        self.end = end
        self.at: ChunkAt | None = None

    @property
    def n_rows(self) -> int:
        return int(self.rows.shape[0])

    def copy(self) -> "DraftWindow":
        return DraftWindow(self.n_swa, self.head_dim, self.rows, self.end)

    def bind(self, at: ChunkAt) -> None:
        if self.n_rows and at.p0 != self.end:
            # ds4's window is contiguous positions; a gap would silently attend to the wrong rows
            raise InferenceError(f"MTP window ends at position {self.end - 1}, cannot run position {at.p0}")
        self.at = at

    def update_raw(self, kv: mx.array) -> tuple[mx.array, int]:
        """Append the call's raw rows kv [L, D]; return (previous rows ++ kv, number of previous
        rows), what ``Attention._attend`` masks per query by the sliding window."""
        raw = mx.concatenate([self.rows, kv], axis=0)
        n_prev = self.n_rows
        self.rows = raw[-self.n_swa:] if raw.shape[0] > self.n_swa else raw
        self.end = self.at.p0 + self.at.L
        return raw, n_prev

    def arrays(self) -> list[mx.array]:
        return [self.rows]

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes


class MTPHead:
    """The MTP drafter's weights and its step (module docstring); the target ``Model`` lends the
    embedding and the output matrix, and the numerics (``ops``) are the target's."""

    def __init__(self, cfg, ops: DefaultOps, *, e_proj: DenseWeight, h_proj: DenseWeight, enorm: mx.array,
                 hnorm: mx.array, norm: mx.array, output_hc: OutputHC, block: Block, source=None):
        self.config, self.ops = cfg, ops
        self.e_proj, self.h_proj, self.enorm, self.hnorm, self.norm = e_proj, h_proj, enorm, hnorm, norm
        self.output_hc, self.block, self.source = output_hc, block, source

    def close(self) -> None:
        """Unmap the drafter file (the head is unusable afterwards)."""
        if self.source is not None:
            self.source.close()

    def empty_window(self) -> DraftWindow:
        return DraftWindow(self.config.n_swa, self.config.head_dim)

    def inputs(self, target, tokens: np.ndarray, h: mx.array) -> mx.array:
        """H_in [T, n_hc, n_embd] from tokens [T] and the input HC states h [T, n_hc, n_embd]."""
        cfg, ops = self.config, self.ops
        T, n_hc, E = h.shape
        emb = mx.array(np.asarray(target.embedding[tokens], dtype=np.float32))
        e = ops.linear(self.e_proj, ops.rms_norm(emb, self.enorm, cfg.rms_eps))
        hp = ops.linear(self.h_proj, ops.rms_norm(h.reshape(T * n_hc, E), self.hnorm, cfg.rms_eps))
        return e[:, None, :] + hp.reshape(T, n_hc, E)

    def run(self, target, tokens, h: mx.array, window: DraftWindow, p0: int,
            logits: bool = True) -> tuple[mx.array, np.ndarray | None]:
        """Steps at positions p0..p0+T-1 (tokens [T], input states h [T, n_hc, n_embd], each row its
        own position's: the anchored case; a recursive step is T = 1). Appends their rows to
        ``window`` (in place: pass a copy to keep the original) and returns (H_out of the last
        position [n_hc, n_embd], its logits as float32 [n_vocab], or None without ``logits``: a
        step whose draft nobody reads skips the output matrix)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if self.source is not None:
            self.source.check_intact()  # a truncated drafter file is an error, not SIGBUS
        with self.ops.stream():
            H = self.inputs(target, tokens, h)
            window.bind(ChunkAt(p0, len(tokens), self.ops))
            # every row's KV enters the window; only the last row's output is wanted (the other
            # rows' FFNs are computed and dropped: a layer has one way through it, Block.__call__,
            # and the anchored steps that feed several rows are the rare case)
            H = self.block(H, tokens, window)[-1:]
            out = None
            if logits:
                x = self.ops.rms_norm(self.output_hc(H), self.norm, self.config.rms_eps)
                out = target.head_logits(x)[0]
            ok = all_finite(H if out is None else out)
            mx.eval(H, ok, *window.arrays(), *([] if out is None else [out]))
            raise_nonfinite([("the MTP drafter", ok)], f"position {p0 + len(tokens) - 1}", self.source)
        return H[0], None if out is None else np.asarray(out, dtype=np.float32)
