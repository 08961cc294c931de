"""The decode step (one token, DEFAULT numerics) as ``mx.compile``d functions over a ``DecodeCache``.

Split of one step (the routed experts read data-dependent slabs out of the mmap, which a trace
cannot do, so the step is cut at every router):

    compiled  layer_fn[il](carry, pos, rope tables, layer cache)
                  finish the previous layer's FFN: H = HC.post(Σ down_i + shared, H, post, C)
                  HC pre → attention (Attention.decode_step: projections, RoPE, FP8, ring write,
                  compressor / indexer lanes, indexer top-k, sink softmax, grouped out) → HC post
                  → HC pre of the FFN → ffn_norm → router scores → shared expert
              -> (H, xn, post, C, prob, choice, shared, new layer cache)
    eager     expert ids: top-k of ``choice`` in numpy (or tid2eid[token]); the router weights;
              gate / up / down of the selected experts (``ExpertWeights``: slab reads, the
              dequantized-expert cache, byte counters)
    compiled  head_fn(carry): finish the last FFN, output HC, norm, output matmul -> logits

Every input of a compiled function keeps its shape from step to step: the position is an int32
scalar array, the RoPE tables of the position are [1, n_rot/2] arrays computed in numpy (the same
tables the chunk path uses), the cache buffers are fixed (``decode_cache``). A function is traced
once per layer, and again only when the row buffers grow (a new shape; log2 times over a context).
``traces`` counts the traces (the Python bodies run only while MLX traces them). On MLX's CPU
backend the first trace of a new shape also builds its fused kernels with the system C++ compiler
(cached on disk under $TMPDIR/mlx/<version>/cpu; ~5 s for the real dims the first time); without
a compiler mx.compile falls back to plain calls.

Compressor emission has no branch: every step pools the open window and writes the result to the
row slot of that window, counted only once the window closes. Measured at the real dims on this
2-core CPU: 0.74 ms per ratio-128 layer and step, 0.16 ms per ratio-4 lane, against ~0.2 s for the
rest of a real-dims layer's decode step (~0.4 %), so one trace per layer beats a second, emitting
variant of every function.

Numerics. The arithmetic is the chunk path's DEFAULT arithmetic for a one-token chunk, op for op,
except that fixed shapes pad the raw window (before it fills) and the compressed rows with masked
keys; the masked keys weigh exactly 0, but BLAS rounds a product's dot products differently
depending on the product's other dimension, so the scores and the weighted sums can differ in the
last bits. MLX's fused kernels compute the same per-element operations as the eager ones (the
compiled and the eager fixed-shape step are bit-identical). So the logits equal the uncompiled
decode's up to rounding noise (``tests/test_compiled_decode.py`` measures it), and since the
shapes depend only on the position, two sessions decoding the same tokens from the same state
agree bit for bit.

Device experts (``MoE.routes_on_device``, ``ds4_mlx.load(..., experts="device")``): routing and the
routed experts are MLX ops on resident blocks, so ``layer_fn`` computes the whole layer (the FFN
included, from the token id passed as an int32 array) and the step has no eager part: one graph per
token, evaluated once (``step(..., evaluate=False)`` leaves even that to the caller, who can then
read the sampled token as the step's only host sync).
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np

from ds4_mlx.model.decode_cache import DecodeCache, LaneCache, LayerCache, capacity_for
from ds4_mlx.model.rope import Rope
from ds4_mlx.model.state import InferenceError


class _RopeRows:
    """cos/sin rows of one RoPE parameter set at single positions, computed a block at a time."""

    BLOCK = 256

    def __init__(self, rope: Rope, ops):
        self.rope, self.ops = rope, ops
        self._b0 = -1
        self._cos = self._sin = None

    def at(self, p: int) -> tuple[mx.array, mx.array]:
        b0 = p - p % self.BLOCK
        if b0 != self._b0:
            c, s = self.ops.rope_tables(self.rope, np.arange(b0, b0 + self.BLOCK))
            self._cos, self._sin = np.array(c), np.array(s)
            self._b0 = b0
        i = p - b0
        return mx.array(self._cos[i: i + 1]), mx.array(self._sin[i: i + 1])


def _rope_key(rope: Rope) -> tuple:
    return float(rope.base), float(rope.freq_scale), bool(rope.yarn), int(rope.half)


def _flatten(lc: LayerCache) -> list[mx.array]:
    out = [lc.ring]
    for lane in (lc.attn, lc.index):
        if lane is not None:
            out += [lane.rows, lane.kst, lane.gst]
    return out


def _unflatten(a: list[mx.array]) -> LayerCache:
    attn = LaneCache(*a[1:4]) if len(a) > 1 else None
    index = LaneCache(*a[4:7]) if len(a) > 4 else None
    return LayerCache(a[0], attn, index)


class _Counter:
    n = 0


def _finish_ffn(carry: list[mx.array], prev) -> mx.array:
    """carry = [H] (layer 0) or [down, shared, H, post, C] (a pending FFN of block ``prev``) -> H."""
    if len(carry) == 1:
        return carry[0]
    down, shared, H, post, comb = carry
    return prev.hc_ffn.post(prev.ffn.combine(down, shared), H, post, comb)


def _layer_body(block, prev, counter: _Counter):
    attn, ffn = block.attn, block.ffn

    def body(carry, pos, tables, cache, token):
        counter.n += 1
        H = _finish_ffn(carry, prev)
        cos, sin, ccos, csin = tables if len(tables) == 4 else (*tables, None, None)
        x, post, comb = block.hc_attn.pre(H)
        a, lc = attn.decode_step(x, pos, cos, sin, ccos, csin, _unflatten(cache))
        H = block.hc_attn.post(a, H, post, comb)
        x, post, comb = block.hc_ffn.pre(H)
        if ffn.routes_on_device:  # the whole FFN in the trace: carry = [H]
            return [block.hc_ffn.post(ffn(x, token), H, post, comb)], _flatten(lc)
        xn = ffn.ops.rms_norm(x, ffn.ffn_norm, ffn.eps)
        prob, choice = ffn.router_scores(xn)
        out = [H, xn, post, comb, prob, ffn.shared_expert(xn)]
        if choice is not None:
            out.append(choice)
        return out, _flatten(lc)

    return body


def _head_body(model_ref, last, counter: _Counter):
    def body(carry):
        counter.n += 1
        return model_ref().head(_finish_ffn(carry, last))[0]

    return body


class CompiledDecoder:
    """Decode steps of one DEFAULT-numerics model. ``compile=False`` runs the same fixed-shape
    functions eagerly (to separate what compilation does from what the fixed shapes do).

    The traced functions hold the blocks and a weak reference to the model (the model holds its
    decoders), so dropping the model frees its weights without waiting for the cycle collector.
    """

    def __init__(self, model, compile: bool = True):
        if not model.ops.compilable:
            raise InferenceError("the compiled decode step exists for DEFAULT numerics only "
                                 "(ds4-cpu runs its reference arithmetic uncompiled)")
        self._model = weakref.ref(model)
        self.compile = compile
        self._counter = _Counter()
        self._tables: dict[tuple, _RopeRows] = {}
        wrap = mx.compile if compile else (lambda f: f)
        blocks = model.blocks
        self._layer_fns = [wrap(_layer_body(b, blocks[i - 1] if i else None, self._counter))
                           for i, b in enumerate(blocks)]
        self._head_fn = wrap(_head_body(self._model, blocks[-1], self._counter))

    @property
    def model(self):
        return self._model()

    @property
    def traces(self) -> int:
        """How many times a function body has run under tracing (or at all, with compile=False)."""
        return self._counter.n

    def _rows(self, rope: Rope) -> _RopeRows:
        key = _rope_key(rope)
        if key not in self._tables:
            self._tables[key] = _RopeRows(rope, self.model.ops)
        return self._tables[key]

    # -- one step -----------------------------------------------------------------------------------

    def step(self, token: int, cache: DecodeCache, *, evaluate: bool = True) -> mx.array:
        """Feed ``token`` at position ``cache.n_tokens``; updates ``cache`` in place (evaluated) and
        returns the next-token logits [n_vocab], lazily: a caller that never reads them (all but the
        last token of a decoded suffix) skips the output projection, as the chunk path does.
        ``evaluate=False`` leaves the new cache arrays lazy too: the caller evaluates them with what
        it reads (e.g. ``mx.depends(next_token, cache.arrays())``), one sync for the whole token."""
        p = cache.n_tokens
        cap = capacity_for(p)
        if cap > cache.capacity:
            grown = cache.grown(cap)
            cache.capacity, cache.layers = grown.capacity, grown.layers
            del grown
        pos = mx.array(p, dtype=mx.int32)
        tokens = np.array([token], dtype=np.int64)
        token_arr = mx.array([token], dtype=mx.int32)
        model = self.model
        carry = [model.embed(tokens)]
        for il, block in enumerate(model.blocks):
            attn, ffn = block.attn, block.ffn
            rows = self._rows(attn.rope)
            tables = list(rows.at(p))
            if attn.ratio:
                tables += list(rows.at(p - p % attn.ratio))
            out, new_cache = self._layer_fns[il](carry, pos, tables, _flatten(cache.layers[il]), token_arr)
            # drop the old buffers before anything is evaluated, so MLX may update them in place
            cache.layers[il] = _unflatten(new_cache)
            del new_cache
            if ffn.routes_on_device:
                carry = out
                continue
            H, xn, post, comb, prob, shared = out[:6]
            sel = ffn.select(out[6] if len(out) > 6 else None, tokens)
            w = ffn.route_weights(prob, sel)
            carry = [ffn.routed_experts(xn, sel, w), shared, H, post, comb]
        logits = self._head_fn(carry)
        cache.n_tokens = p + 1
        if evaluate:
            mx.eval(*cache.arrays())
        return logits
