"""Flash 0731's DSpark block drafter: three target-shaped stages that draft a block of B tokens in one
pass from the target's layer taps (ds4: metal_graph_eval_dspark_stage_chain; docs/speculative.md §2).

Per committed position p, from the target's taps t_p = [HCmean(out_40); HCmean(out_41); HCmean(out_42)]
(the outputs of the file's target layers, ``Model.tap_rows``):

    main_x_p = RMSNorm(main_proj · t_p, main_norm)                                             [E]
    ctx_s,p  = FP8(RoPE_p(RMSNorm(kv_s · RMSNorm(HCPre_attn,s([main_x_p] × n_hc), attn_norm_s),
                                  kv_norm_s)))                 stage s's context KV row        [D]

each stage keeping the rows of the last n_swa positions (``context_kv``). A proposal at L (the last
committed token t_L at position L; the newest context row is p = L - 1):

    X^0      = E[t_L, noise, …, noise] × n_hc                      [B, n_hc, E], slot j at L + j
    X^{s+1}  = Stage_s(X^s)     a target block whose attention takes queries from the B slots only and
               keys = ctx_s rows of max(0, L - n_swa) .. L - 1  ++  the slots' own KV rows, non-causal
               (every slot sees every key), with sinks; then its HC-wrapped MoE (score routing)
    x_j      = OutputHC_dspark(X^3_j);   base_j = W_out · RMSNorm(x_j, norm)
    m_j      = markov_w1[prev_j];  logits_j = base_j + markov_w2 · m_j;  d_j = argmax (prev_0 = t_L,
               prev_{j+1} = d_j);   c_j = confidence · [x_j ; m_j]
    drafts   = d_0 .. d_{n-1}, n = the first j with sigmoid(c_j) < threshold (none: all B)

d_j is the draft for position L + 1 + j. The stages run with a ratio-0 layer's RoPE (base theta, no
YaRN) and the target's numerics (``ops``); the embedding and output matrix are the target's.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import InferenceError
from ds4_mlx.formats.drafter_layout import DSparkParams
from ds4_mlx.model.hyper_connection import OutputHC
from ds4_mlx.model.linear import DenseWeight
from ds4_mlx.model.numerics import fp8_kv_round
from ds4_mlx.model.ops import DefaultOps
from ds4_mlx.model.rope import apply_rope
from ds4_mlx.model.transformer import Block, all_finite, raise_nonfinite


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """BF16 bits (uint16) -> float32 (exact: the upper half of the float32)."""
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class DSparkHead:
    """The DSpark drafter's weights and its computations (module docstring); the target ``Model``
    lends the embedding and the output matrix, and the numerics (``ops``) are the target's."""

    def __init__(self, cfg, ops: DefaultOps, params: DSparkParams, *, main_proj: DenseWeight,
                 main_norm: mx.array, stages: list[Block], output_hc: OutputHC, norm: mx.array,
                 markov_w1: np.ndarray, markov_w2: np.ndarray, confidence: np.ndarray, source=None):
        self.config, self.ops, self.params = cfg, ops, params
        self.main_proj, self.main_norm, self.stages = main_proj, main_norm, stages
        # each stage run as a block (``Block.__call__``) whose attention is the stage's non-causal
        # one over its context rows (``StageAttention``): the same HC and MoE code as a target layer
        self._stage_blocks = [Block(st.il, st.hc_attn, StageAttention(st.attn, ops), st.hc_ffn, st.ffn)
                              for st in stages]
        self.output_hc, self.norm = output_hc, norm
        self.markov_w1, self.markov_w2 = markov_w1, markov_w2  # float32 [n_vocab, R] each
        self.confidence = confidence  # float32 [n_embd + R]
        self.source = source

    @property
    def taps(self) -> tuple[int, ...]:
        return self.params.target_layers

    def close(self) -> None:
        """Unmap the drafter file (the head is unusable afterwards)."""
        if self.source is not None:
            self.source.close()

    def empty_rows(self) -> mx.array:
        return mx.zeros((0, self.config.head_dim), dtype=mx.float32)

    # -- the context rows -------------------------------------------------------------------------------

    def main_x(self, taps: mx.array) -> mx.array:
        """The target's tap rows [n, n_taps, E] -> main_x [n, E]."""
        n, k, E = taps.shape
        ops = self.ops
        return ops.rms_norm(ops.linear(self.main_proj, taps.reshape(n, k * E)), self.main_norm, self.config.rms_eps)

    def _kv(self, stage: Block, x: mx.array, positions: np.ndarray) -> mx.array:
        """A stage's KV rows [n, D] from its attention input x [n, E] at ``positions`` (the target
        attention's kv path: attn_norm, kv, kv_norm, RoPE, FP8 of the non-rotary dims)."""
        ops, attn, eps = self.ops, stage.attn, self.config.rms_eps
        kv = ops.rms_norm(ops.linear(attn.kv, ops.rms_norm(x, attn.attn_norm, eps)), attn.kv_norm, eps)
        cos, sin = ops.rope_tables(attn.rope, positions)
        return fp8_kv_round(apply_rope(kv, cos, sin), attn.n_nope)

    def context_kv(self, taps: mx.array, p0: int) -> list[mx.array]:
        """Every stage's context KV rows [n, D] for the positions p0.. of the tap rows [n, n_taps, E]
        (ds4 metal_graph_seed_dspark_stage_target_cache: main_x repeated over the HC streams, the
        stage's attention HC pre-mix, then the kv path), evaluated."""
        cfg = self.config
        if self.source is not None:
            self.source.check_intact()
        with self.ops.stream():
            main = self.main_x(taps.astype(mx.float32))
            n = main.shape[0]
            X = mx.broadcast_to(main[:, None, :], (n, cfg.n_hc, cfg.n_embd))
            positions = np.arange(p0, p0 + n)
            out = []
            for stage in self.stages:
                x, _ = stage.hc_attn.reduce(X, stage.hc_attn.mix(X))
                out.append(self._kv(stage, x, positions))
            ok = all_finite(mx.stack(out))
            mx.eval(*out, ok)
            raise_nonfinite([("the DSpark context rows", ok)], f"positions {p0}..{p0 + n - 1}", self.source)
        return out

    # -- a proposal ----------------------------------------------------------------------------------

    def block_outputs(self, target, rings: list[mx.array], anchor: int, L: int) -> tuple[np.ndarray, np.ndarray]:
        """The block at L with ``anchor`` = t_L over the stages' context rows ``rings`` (those of
        positions max(0, L - n_swa) .. L - 1): (x [B, E], base logits [B, n_vocab]) as float32."""
        cfg, ops, B = self.config, self.ops, self.params.block_size
        ids = np.array([anchor] + [self.params.noise_token_id] * (B - 1), dtype=np.int64)
        if self.source is not None:
            self.source.check_intact()
        with ops.stream():
            H = target.embed(ids)
            for block, ctx in zip(self._stage_blocks, rings):
                H = block(H, ids, StageKeys(ctx, L))
            x = self.output_hc(H)
            base = target.head_logits(ops.rms_norm(x, self.norm, cfg.rms_eps))
            ok = all_finite(base)
            mx.eval(x, base, ok)
            raise_nonfinite([("the DSpark drafter", ok)], f"the block at position {L}", self.source)
        return np.asarray(x, dtype=np.float32), np.asarray(base, dtype=np.float32)

    def propose(self, target, rings: list[mx.array], anchor: int, L: int, k: int,
                threshold: float) -> list[int]:
        """Up to min(k, B) drafts for positions L + 1.. (the Markov chain and the confidence cut;
        ``threshold`` <= 0: no cut)."""
        if len(rings) != len(self.stages) or any(r.shape[0] == 0 for r in rings):
            raise InferenceError("DSpark proposal: every stage needs its context rows (at least position L - 1)")
        x, base = self.block_outputs(target, rings, anchor, L)
        E = self.config.n_embd
        w_x, w_m = self.confidence[:E].astype(np.float64), self.confidence[E:].astype(np.float64)
        drafts, prev = [], int(anchor)
        for j in range(min(int(k), self.params.block_size)):
            m = self.markov_w1[prev]
            c = float(w_x @ x[j].astype(np.float64) + w_m @ m.astype(np.float64))
            if threshold > 0 and _sigmoid(c) < threshold:
                break  # ds4 dspark_confident_prefix_len: the prefix while the confidence holds
            logits = base[j] + self.markov_w2 @ m
            prev = int(np.argmax(logits))  # the first maximum: ties go to the smaller id, as ds4
            drafts.append(prev)
        return drafts


class StageKeys:
    """What a stage's attention attends to besides the block's own slots: its context rows ``ctx``
    [n, D] (positions L - n .. L - 1), and the block's first slot position ``L``."""

    def __init__(self, ctx: mx.array, L: int):
        self.ctx, self.L = ctx, L


class StageAttention:
    """A DSpark stage's attention, in a block's attention slot: the target attention's projections and
    output, queries from the B slots at L..L+B-1, keys = the context rows ++ the slots' own KV rows,
    non-causal (every slot sees every key: ds4's noncausal raw attention), with sinks."""

    def __init__(self, attn, ops: DefaultOps):
        self.attn, self.ops = attn, ops

    def __call__(self, x: mx.array, keys: StageKeys) -> mx.array:
        ops, attn = self.ops, self.attn
        B = x.shape[0]
        _, _, q, kv = attn._project(x, B)  # the target attention's projections (attn_norm first)
        positions = np.arange(keys.L, keys.L + B)
        cos, sin = ops.rope_tables(attn.rope, positions)
        q = apply_rope(q, cos, sin)
        kv = fp8_kv_round(apply_rope(kv, cos, sin), attn.n_nope)
        all_keys = mx.concatenate([keys.ctx, kv], axis=0)
        heads = ops.sink_softmax(q, [(all_keys, np.ones((B, all_keys.shape[0]), dtype=bool))], attn.sinks,
                                 attn.kq_scale)
        icos, isin = ops.rope_tables(attn.rope, positions, inverse=True)
        return attn._output(apply_rope(heads, icos, isin))


def _sigmoid(c: float) -> float:
    """ds4's sigmoid_stable: no overflow for either sign."""
    if c >= 0:
        return 1.0 / (1.0 + math.exp(-c))
    e = math.exp(c)
    return e / (1.0 + e)
