"""The decode step (one token, DEFAULT numerics): ``mx.compile`` over the model's own ``Block``
methods, run on a ``ModelCache`` whose buffers have fixed shapes (``cache.StepAt``).

Nothing here re-assembles a layer: a compiled layer function builds a view of the layer's cache
over its input arrays (``LayerCache.view``) and calls ``Block.attention_part`` — the very code a
prefill chunk runs — then ``Block.ffn_pre``. Where the routed experts are chosen on the host
(``MoE.routes_on_device`` False: numpy top-k, expert slabs read out of the mmap, which a trace
cannot do) the step is cut at every router:

    compiled  mixer_fn[il](carry): finish the previous layer's FFN (``Block.ffn_post``), then the
                  attention mixer's logits (``Block.attention_mix``) -> H, mix
    eager     the attention mixer's combine matrix from mix, on the host (its Sinkhorn:
                  ``Block.attention_comb``, ``HyperConnection.comb_on_host``)
    compiled  layer_fn[il](H, mix, C, pos, rope tables, layer cache arrays)
                  ``Block.attention_part``, ``Block.ffn_pre`` (HC pre without the Sinkhorn,
                  ffn_norm, router scores, shared expert)
              -> (H, xn, post, FFN mixer logits, prob, shared[, choice]), new layer cache arrays
    eager     expert ids (``MoE.select``), the FFN mixer's combine matrix (``Block.ffn_comb``), the routed
              experts' weights and products (``ExpertWeights``)
    compiled  head_fn(carry): finish the last FFN, output HC, norm, output matmul -> logits
              (or hidden_fn: the same without the matmul, for a pipeline's last rank, which shares
              the output matrix's rows with rank 0, and for a model whose output matrix is multiplied
              on the host, ``Model.host_head``, which then follows eagerly; or finish_fn: the last
              FFN only, H for the next rank)

A MoE that routes on the device (``routes_on_device`` True) has no host break: its whole layer,
``Block.__call__`` with the token id as an int32 array, is one compiled function per layer.

Every input of a compiled function keeps its shape from step to step: the position is an int32
scalar array, the RoPE tables of the position are [1, n_rot/2] arrays computed in numpy (the same
tables the chunk path uses), the cache buffers are fixed (``cache.capacity_for``). A function is traced
once per layer, and again only when the row buffers grow (a new shape; log2 times over a context).
``traces`` counts the traces (the Python bodies run only while MLX traces them). On MLX's CPU
backend the first trace of a new shape also builds its fused kernels with the system C++ compiler
(cached on disk under $TMPDIR/mlx/<version>/cpu; ~5 s for the real dims the first time); without
a compiler mx.compile falls back to plain calls.

Compressor emission is chosen on the host: a layer with compressors has two traced functions, one
for the step that closes its window (pooled into the window's row: ``StepAt.closes``) and one for
the others (the token only joins the frontier), so a ratio-4 layer pools on one step in four and a
ratio-128 layer on one in 128. (Pooling every step without a branch cost ~200 graph nodes a ratio-4
layer on the tiny model, where a decode step is bound by its node count; at the real dims it was
~0.4 % of a step.)

Numerics. The arithmetic is the chunk path's DEFAULT arithmetic for a one-token chunk (the same
module code; only the cache's layout-dependent parts and the key selection take their fixed-shape
form), except that fixed shapes pad the raw window (before it fills) and the compressed rows with
masked keys; the masked keys weigh exactly 0, but BLAS rounds a product's dot products differently
depending on the product's other dimension, so the scores and the weighted sums can differ in the
last bits. MLX's fused kernels compute the same per-element operations as the eager ones (the
compiled and the eager fixed-shape step are bit-identical). So the logits equal the uncompiled
decode's up to rounding noise (``tests/test_compiled_decode.py`` measures it), and since the
shapes depend only on the position, two sessions decoding the same tokens from the same state
agree bit for bit.

Device experts (``MoE.routes_on_device``, ``ds4_mlx.load(..., experts="device")``): routing and the
routed experts are MLX ops on resident blocks, so each layer's function is the whole ``Block.__call__``
(from the token id passed as an int32 array) and the step has no eager part: one graph per token,
evaluated once (``step(..., evaluate=False)`` leaves even that to the caller, who can then read the
sampled token as the step's only host sync).
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import InferenceError
from ds4_mlx.model.cache import LayerCache, ModelCache, StepAt
from ds4_mlx.model.host import to_host
from ds4_mlx.model.rope import Rope


_compiler_probed = False


def probe_compiler() -> None:
    """Have MLX ask its one-time CPU question now: is there a C++ compiler for fused kernels?

    MLX answers it at the first ``mx.compile`` call on the CPU with ``system("g++ --version")``, and
    C's ``system()`` ignores SIGINT while the child runs: a Ctrl-C landing then is discarded, not
    deferred. Unprobed, that moment is the first compiled decode step, i.e. right when the first
    token appears and a user (or a test) presses Ctrl-C; the loader calls this instead, so the window
    falls inside the load. (Kernel builds use ``popen()``, which leaves signals alone.) Once per
    process; a tiny elementwise function, its kernel cached on disk by MLX after the first build."""
    global _compiler_probed
    if _compiler_probed:
        return
    _compiler_probed = True
    with mx.stream(mx.cpu):
        mx.eval(mx.compile(lambda x: x * 2.0 + 1.0)(mx.zeros((1,), dtype=mx.float32)))


class _RopeRows:
    """cos/sin rows of one RoPE parameter set at single positions, computed a block at a time.

    The block's tables stay MLX arrays and a position's rows are slices of them (views, no copy),
    memoised for the block: the layers sharing these parameters, and the steps after, reuse them
    instead of creating two arrays from host data per layer and step.
    """

    BLOCK = 256

    def __init__(self, rope: Rope, ops):
        self.rope, self.ops = rope, ops
        self._b0 = -1
        self._cos = self._sin = None
        self._rows: dict[int, tuple[mx.array, mx.array]] = {}

    def at(self, p: int) -> tuple[mx.array, mx.array]:
        b0 = p - p % self.BLOCK
        if b0 != self._b0:
            self._cos, self._sin = self.ops.rope_tables(self.rope, np.arange(b0, b0 + self.BLOCK))
            mx.eval(self._cos, self._sin)
            self._rows = {}
            self._b0 = b0
        i = p - b0
        rows = self._rows.get(i)
        if rows is None:
            rows = self._rows[i] = (self._cos[i: i + 1], self._sin[i: i + 1])
        return rows


def _rope_key(rope: Rope) -> tuple:
    return float(rope.base), float(rope.freq_scale), bool(rope.yarn), int(rope.half)


class _Counter:
    n = 0


def _finish_ffn(carry: list[mx.array], prev) -> mx.array:
    """carry = [H] (layer 0, or after a layer routed on the device) or [routed, shared, H, post, C]
    (the pending FFN of block ``prev``) -> H."""
    if len(carry) == 1:
        return carry[0]
    return prev.ffn_post(*carry)


def _mixer_input(block, prev, counter: _Counter):
    """The previous layer's FFN tail, then layer ``block``'s attention mixer logits: [H, mix]."""
    def body(carry):
        counter.n += 1
        H = _finish_ffn(carry, prev)
        return [H, block.attention_mix(H)]

    return body


def _host_routed_layer(block, template: LayerCache, counter: _Counter, closes: bool):
    """Layer ``block`` from its input H and its attention mixer's logits and combine matrix (the
    latter computed on the host) up to its router, whose FFN mixer logits it returns in place of
    the combine matrix (``Block.ffn_pre(comb_on_host=True)``). ``closes``: the step closes the
    layer's compressor windows (``StepAt.closes``)."""
    def body(H, mix, comb, pos, tables, arrays):
        counter.n += 1
        cache = template.view(arrays, StepAt(pos, *tables, closes=closes))
        H = block.attention_part(H, cache, mix, comb)
        xn, post, ffn_mix, prob, shared, choice = block.ffn_pre(H, comb_on_host=True)
        out = [H, xn, post, ffn_mix, prob, shared] + ([] if choice is None else [choice])
        return out, cache.arrays()

    return body


def _device_routed_layer(block, prev, template: LayerCache, counter: _Counter, closes: bool):
    """The whole layer (``Block.__call__``): its MoE routes on the device."""
    def body(carry, token, pos, tables, arrays):
        counter.n += 1
        cache = template.view(arrays, StepAt(pos, *tables, closes=closes))
        return [block(_finish_ffn(carry, prev), token, cache)], cache.arrays()

    return body


def _finish_body(last, counter: _Counter):
    def body(carry):
        counter.n += 1
        return _finish_ffn(carry, last)

    return body


def _head_body(model_ref, last, counter: _Counter, part: str = "head"):
    """The last FFN's tail, then ``Model.<part>``: "head" (the logits) or "head_hidden" (the normed
    hidden state a pipeline's last rank sends rank 0)."""
    def body(carry):
        counter.n += 1
        return getattr(model_ref(), part)(_finish_ffn(carry, last))[0]

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
        wrap = mx.compile if compile else (lambda f: f)
        blocks = model.blocks
        # The structure of each layer's cache (which lanes, their sizes) for the views built inside
        # the traces; its arrays are never read.
        templates = model.empty_cache().layers
        self._device_routed = [b.ffn.routes_on_device for b in blocks]
        self._any_device_routed = any(self._device_routed)
        # each block's RoPE rows, looked up once here, not per layer and step (blocks with the same
        # RoPE parameters share one ``_RopeRows``)
        shared: dict[tuple, _RopeRows] = {}
        self._block_rows = []
        for b in blocks:
            key = _rope_key(b.attn.rope)
            if key not in shared:
                shared[key] = _RopeRows(b.attn.rope, model.ops)
            self._block_rows.append(shared[key])
        self._layer_fns = []
        # ``blocks`` may be a contiguous range of the layers (a pipeline stage, ``pipeline.PipelineModel``):
        # each block finds its cache by its own index ``il``, and the first one starts from H.
        self._mixer_fns = []
        for i, b in enumerate(blocks):
            prev, template = blocks[i - 1] if i else None, templates[b.il]
            variants = (False, True) if b.attn.ratio else (False,)
            # a layer with compressors: one function for the steps that close a window (pool it into
            # its row), one for the others (only the frontier takes the token)
            if self._device_routed[i]:
                self._layer_fns.append({c: wrap(_device_routed_layer(b, prev, template, self._counter, c))
                                        for c in variants})
                self._mixer_fns.append(None)
            else:
                self._layer_fns.append({c: wrap(_host_routed_layer(b, template, self._counter, c))
                                        for c in variants})
                self._mixer_fns.append(wrap(_mixer_input(b, prev, self._counter)))
        self._head_fn = wrap(_head_body(self._model, blocks[-1], self._counter))
        self._finish_fn = wrap(_finish_body(blocks[-1], self._counter))
        self._hidden_fn = wrap(_head_body(self._model, blocks[-1], self._counter, "head_hidden"))

    @property
    def model(self):
        return self._model()

    @property
    def traces(self) -> int:
        """How many times a function body has run under tracing (or at all, with compile=False)."""
        return self._counter.n

    # -- one step -----------------------------------------------------------------------------------

    def step(self, token: int, cache: ModelCache, *, evaluate: bool = True) -> mx.array:
        """Feed ``token`` at position ``cache.n_tokens``; updates ``cache`` in place (evaluated) and
        returns the next-token logits [n_vocab], lazily: a caller that never reads them (all but the
        last token of a decoded suffix) skips the output projection, as the chunk path does.
        ``evaluate=False`` leaves the new cache arrays lazy too: the caller evaluates them with what
        it reads (e.g. ``mx.depends(next_token, cache.arrays())``), one sync for the whole token.
        A model whose output matrix is multiplied on the host (``Model.host_head``) returns them
        evaluated (its input read to the host is the step's one wait): the engine reads every decoded
        token's logits anyway (a suffix of one token decodes, longer ones prefill)."""
        return self.run(self.model.embed(np.array([token], dtype=np.int64)), token, cache, evaluate=evaluate)

    def run(self, H: mx.array, token: int, cache: ModelCache, *, until: str = "logits",
            evaluate: bool = True) -> mx.array:
        """This decoder's blocks on H [1, n_hc, n_embd] (``token``'s embedding, or the previous
        pipeline stage's output) at position ``cache.n_tokens``, then, lazily, ``until``:
        "logits", the head (the next-token logits [n_vocab]); "hidden", the head's normed hidden
        state [n_embd] (``Model.head_hidden``: a pipeline's last rank, which shares the output
        rows with rank 0); "H", only the last block's FFN tail (H for the next pipeline stage).
        Updates and advances ``cache`` like ``step``."""
        fn = {"logits": self._head_fn, "hidden": self._hidden_fn, "H": self._finish_fn}.get(until)
        if fn is None:
            raise InferenceError(f"CompiledDecoder.run: until must be 'logits', 'hidden' or 'H', got {until!r}")
        model = self.model
        host_head = until == "logits" and model.host_head
        if host_head:
            fn = self._hidden_fn  # the output matrix is multiplied on the host, outside the trace
        p = cache.n_tokens
        carry = self._layers(H, token, cache)
        out = fn(carry)
        cache.advance(p + 1)
        if host_head:
            # its input is read to the host now: the wait for the step (the cache arrays are the
            # layer functions' sibling outputs, computed with it, evaluated as ``evaluate`` says)
            out = model.head_logits(out[None])[0]
        if evaluate:
            mx.eval(*cache.arrays())
        return out

    def _layers(self, H: mx.array, token: int, cache: ModelCache) -> list[mx.array]:
        """The blocks on H at position ``cache.n_tokens`` (the cache's layer arrays are replaced, its
        position is not advanced): the carry for the head or the finish function."""
        p = cache.n_tokens
        cache.reserve(p)
        pos = mx.array(p, dtype=mx.int32)
        tokens = np.array([token], dtype=np.int64)
        # the id as an MLX array only for layers that route on the device (one host array per step)
        token_arr = mx.array(tokens.astype(np.int32)) if self._any_device_routed else None
        carry = [H]
        for il, block in enumerate(self.model.blocks):
            attn, ffn = block.attn, block.ffn
            rows = self._block_rows[il]
            tables = list(rows.at(p))
            if attn.ratio:
                tables += list(rows.at(p - p % attn.ratio))
            lc = cache.layers[block.il]
            fn = self._layer_fns[il][bool(attn.ratio) and p % attn.ratio == attn.ratio - 1]
            if self._device_routed[il]:
                carry, arrays = fn(carry, token_arr, pos, tables, lc.arrays())
                # drop the old buffers before anything is evaluated, so MLX may update them in place
                lc.set_arrays(arrays)
                del arrays
                continue
            # The mixers' Sinkhorn balancing runs on the host (``Block.attention_comb``/``ffn_comb``): a
            # chain of ~100 tiny graph nodes each, against reading 24 logits; the attention mixer's
            # is read here (its own wait), the FFN mixer's with the router's scores.
            H, mix = self._mixer_fns[il](carry)
            comb = mx.array(block.attention_comb(to_host(mix, np.float32)))
            out, arrays = fn(H, mix, comb, pos, tables, lc.arrays())
            lc.set_arrays(arrays)  # as above: before the router's scores are read
            H, xn, post, ffn_mix, prob, shared = out[:6]
            sel = ffn.select(out[6] if len(out) > 6 else None, tokens)
            comb = mx.array(block.ffn_comb(to_host(ffn_mix, np.float32)))
            # The router's scores are read (on routed layers; hash layers wait for their mixer's
            # logits): what the choice did not need (the shared expert, the cache's lanes) runs
            # on MLX's stream while the host multiplies the routed experts, not after them.
            mx.async_eval(shared, *arrays)
            del arrays
            carry = [ffn.routed_experts(xn, sel, ffn.route_weights(prob, sel)), shared, H, post, comb]
        return carry
