"""The decode step (one token, DEFAULT numerics): ``mx.compile`` over ``Block.__call__``, run on a
``ModelCache`` whose buffers have fixed shapes (``cache.StepAt``).

Nothing here re-assembles a layer: a compiled layer function builds a view of the layer's cache over
its input arrays (``LayerCache.view``) and calls the block — the very code a prefill chunk runs —
with the token id as an int32 array, so with the device routing (``DeviceRouting``: expert ids stay
on the device) a decode step is one graph with no host break, evaluated once (``step(...,
evaluate=False)`` leaves even that to the caller, who can then read the sampled token as the step's
only host sync). A model whose MoEs route on the host (``host_step.HostRouting``) runs
``host_step.HostStepDecoder`` instead, the one place a block is cut at its router.

    compiled  layer_fn[il](H, token, pos, rope tables, layer cache arrays): ``Block.__call__``
              -> H, new layer cache arrays
    compiled  head_fn(H): output HC, norm, output matmul -> logits (or hidden_fn: the same
              without the matmul, for a pipeline's last rank, which shares the output matrix's rows
              with rank 0, and for a model whose output matrix is multiplied on the host,
              ``Model.host_head``, which then follows eagerly; or finish_fn: H for the next rank)

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
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import InferenceError
from ds4_mlx.model.cache import LayerCache, ModelCache, StepAt
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


class Counter:
    """How many times a traced body ran (``CompiledDecoder.traces``)."""

    n = 0


def _layer(block, template: LayerCache, counter: Counter, closes: bool):
    """Layer ``block`` whole (``Block.__call__``) on a view of its cache's arrays. ``closes``: the step
    closes the layer's compressor windows (``StepAt.closes``)."""
    def body(H, token, pos, tables, arrays):
        counter.n += 1
        cache = template.view(arrays, StepAt(pos, *tables, closes=closes))
        return block(H, token, cache), cache.arrays()

    return body


def _tail(model_ref, last, counter: Counter, finish, part: str | None):
    """The carry after the last block -> H (``finish``: ``finish_ffn``), then ``Model.<part>``: "head"
    (the logits), "head_hidden" (the normed hidden state a pipeline's last rank sends rank 0), or
    None (H itself, for the next pipeline stage)."""
    def body(carry):
        counter.n += 1
        H = finish(carry, last)
        return H if part is None else getattr(model_ref(), part)(H)[0]

    return body


def _finish_nothing(carry: list[mx.array], block) -> mx.array:
    return carry[0]


class CompiledDecoder:
    """Decode steps of one DEFAULT-numerics model whose MoEs route on the device. ``compile=False``
    runs the same fixed-shape functions eagerly (to separate what compilation does from what the
    fixed shapes do).

    The traced functions hold the blocks and a weak reference to the model (the model holds its
    decoders), so dropping the model frees its weights without waiting for the cycle collector.
    """

    # The carry the layers leave -> H: nothing to finish here; ``HostStepDecoder`` finishes the last
    # layer's pending FFN.
    finish_ffn = staticmethod(_finish_nothing)

    def __init__(self, model, compile: bool = True):
        model.ops.check_compilable()
        self._model = weakref.ref(model)
        self.compile = compile
        self._counter = Counter()
        wrap = mx.compile if compile else (lambda f: f)
        # ``blocks`` may be a contiguous range of the layers (a pipeline stage): each block finds its
        # cache by its own index ``il``. The templates give each layer's cache structure (which lanes,
        # their sizes) for the views built inside the traces; their arrays are never read.
        blocks = model.blocks
        templates = model.empty_cache().layers
        # each block's RoPE rows, looked up once here, not per layer and step (blocks with the same
        # RoPE parameters share one ``_RopeRows``)
        shared: dict[tuple, _RopeRows] = {}
        self._block_rows = []
        for b in blocks:
            key = _rope_key(b.attn.rope)
            if key not in shared:
                shared[key] = _RopeRows(b.attn.rope, model.ops)
            self._block_rows.append(shared[key])
        self._build_layers(blocks, templates, wrap)
        last = blocks[-1]
        self._tails = {until: wrap(_tail(self._model, last, self._counter, self.finish_ffn, part))
                       for until, part in (("logits", "head"), ("hidden", "head_hidden"), ("H", None))}

    def _build_layers(self, blocks, templates, wrap) -> None:
        # a layer with compressors: one function for the steps that close a window (pool it into its
        # row), one for the others (only the frontier takes the token)
        self._layer_fns = [{c: wrap(_layer(b, templates[b.il], self._counter, c)) for c in self._variants(b)}
                           for b in blocks]

    @staticmethod
    def _variants(block) -> tuple[bool, ...]:
        return (False, True) if block.attn.ratio else (False,)

    @staticmethod
    def _closes(block, p: int) -> bool:
        """Position ``p`` closes ``block``'s compressor window."""
        ratio = block.attn.ratio
        return bool(ratio) and p % ratio == ratio - 1

    def _tables(self, il: int, p: int) -> list[mx.array]:
        """The RoPE rows of block ``il`` at ``p`` (and, with compressors, at its window's start)."""
        rows = self._block_rows[il]
        ratio = self.model.blocks[il].attn.ratio
        return [*rows.at(p), *rows.at(p - p % ratio)] if ratio else list(rows.at(p))

    @property
    def model(self):
        return self._model()

    @property
    def traces(self) -> int:
        """How many times a function body has run under tracing (or at all, with compile=False)."""
        return self._counter.n

    # -- one step -----------------------------------------------------------------------------------

    def run(self, token: int, cache: ModelCache, *, H: mx.array | None = None, until: str = "logits",
            evaluate: bool = True) -> mx.array:
        """Feed ``token`` at position ``cache.n_tokens`` through this decoder's blocks (from its
        embedding, or from ``H`` [1, n_hc, n_embd]: the previous pipeline stage's output); updates and
        advances ``cache`` in place and returns, lazily, ``until``: "logits", the next-token logits
        [n_vocab] (a caller that never reads them — all but the last token of a decoded suffix — skips
        the output projection, as the chunk path does); "hidden", the head's normed hidden state
        [n_embd] (``Model.head_hidden``: a pipeline's last rank, which shares the output rows with rank
        0); "H", H after the last block (for the next pipeline stage).

        ``evaluate=False`` leaves the new cache arrays lazy too: the caller evaluates them with what
        it reads (e.g. ``mx.depends(next_token, cache.arrays())``), one sync for the whole token. A
        model whose output matrix is multiplied on the host (``Model.host_head``) returns the logits
        evaluated (its input read to the host is the step's one wait). ``Model.step`` calls this
        method: the layer loop is here, not one call further down, so a decoded token reaches a layer's
        attention in as few calls as mlx-lm's (``benchmarks/bench_call_depth.py``)."""
        model = self.model
        H, p, pos = self._start(token, cache, H, until)
        token_arr = mx.array(np.array([token], dtype=np.int32))
        for il, block in enumerate(model.blocks):
            lc = cache.layers[block.il]
            H, arrays = self._layer_fns[il][self._closes(block, p)](H, token_arr, pos, self._tables(il, p),
                                                                    lc.arrays())
            # drop the old buffers before anything is evaluated, so MLX may update them in place
            lc.set_arrays(arrays)
            del arrays
        return self._finish([H], cache, until, evaluate)

    def _start(self, token: int, cache: ModelCache, H: mx.array | None, until: str) -> tuple[mx.array, int, mx.array]:
        """A step's inputs: (H, the position, the position as an int32 scalar); ``until`` checked, the
        cache's buffers reserved for the position."""
        if until not in self._tails:
            raise InferenceError(f"{type(self).__name__}.run: until must be 'logits', 'hidden' or 'H', got {until!r}")
        model = self.model
        if H is None:
            if model.source is not None:
                model.source.check_intact()  # weights are about to be read: a truncated file is an error, not SIGBUS
            H = model.embed(np.array([token], dtype=np.int64))
        p = cache.n_tokens
        cache.reserve(p)
        return H, p, mx.array(p, dtype=mx.int32)

    def step(self, token: int, cache: ModelCache, *, evaluate: bool = True) -> mx.array:
        """``run`` from ``token``'s embedding to the logits."""
        return self.run(token, cache, evaluate=evaluate)

    def _finish(self, carry: list[mx.array], cache: ModelCache, until: str, evaluate: bool) -> mx.array:
        """The tail function on the layers' carry; advances the cache's position."""
        model = self.model
        host_head = until == "logits" and model.host_head
        # the output matrix multiplied on the host: outside the trace
        out = self._tails["hidden" if host_head else until](carry)
        cache.advance(cache.n_tokens + 1)
        if host_head:
            # its input is read to the host now: the wait for the step (the cache arrays are the
            # layer functions' sibling outputs, computed with it, evaluated as ``evaluate`` says)
            out = model.head_logits(out[None])[0]
        if evaluate:
            mx.eval(*cache.arrays())
        return out
