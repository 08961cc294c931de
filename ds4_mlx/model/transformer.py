"""DS4 Flash blocks and the whole stack.

    H  = embed(token) copied to the n_hc streams                                  [T, n_hc, n_embd]
    per layer:  (x, post, C) = HC_attn.pre(H);  a = Attention(x);  H = HC.post(a, H, post, C)
                (x, post, C) = HC_ffn.pre(H);   f = MoE(x);        H = HC.post(f, H, post, C)
    logits = W_out · RMSNorm(OutputHC(H), output_norm)

``Model.forward_chunk`` runs a chunk of tokens layer-major (all tokens through layer 0, then
layer 1, …) from a ``ModelCache`` and returns the cache after them (a copy: the caller's cache is
never changed). ``Model.step`` feeds one token through the compiled decode step
(``compiled_decode``: ``mx.compile`` over ``Block.__call__``; ``host_step`` for MoEs routed on the
host), updating the cache in place.
``Model.forward_verify`` is the chunk path for a speculative verify: every position's logits and H
after the last block (what an MTP drafter reads), and a cache that can roll back into the chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ds4_mlx import allocator
from ds4_mlx.errors import InferenceError, NonFiniteError
from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.model.attention import Attention
from ds4_mlx.model.cache import ChunkAt, LayerCache, ModelCache
from ds4_mlx.model.compiled_decode import CompiledDecoder
from ds4_mlx.model.host import to_host
from ds4_mlx.model.hyper_connection import HyperConnection, OutputHC
from ds4_mlx.model.linear import DenseWeight
from ds4_mlx.model.moe import MoE
from ds4_mlx.model.ops import DefaultOps, Numerics


class Block:
    """One transformer layer: HC-wrapped attention, then HC-wrapped MoE. ``__call__`` is the only way
    through it, for prefill chunks, decode steps (compiled or not) and every distributed mode
    (``host_step`` alone takes a block apart, for MoEs that route on the host inside a compiled step)."""

    def __init__(self, il: int, hc_attn: HyperConnection, attn: Attention, hc_ffn: HyperConnection, ffn: MoE):
        self.il, self.hc_attn, self.attn, self.hc_ffn, self.ffn = il, hc_attn, attn, hc_ffn, ffn

    def __call__(self, H: mx.array, tokens, cache: LayerCache) -> mx.array:
        """H [T, n_hc, n_embd] at the cache's bound positions -> H after the layer (``cache`` takes
        the tokens; ``tokens``: these positions' input ids, numpy or an int32 MLX array, for hash
        routing)."""
        x, post, comb = self.hc_attn.pre(H)
        H = self.hc_attn.post(self.attn(x, cache), H, post, comb)
        x, post, comb = self.hc_ffn.pre(H)
        return self.hc_ffn.post(self.ffn(x, tokens), H, post, comb)


class Model:
    """The network of one process (or the blocks of one pipeline stage, wrapped by
    ``pipeline.PipelineModel``): embed, ``Block.__call__`` over its blocks, the head."""

    # a speculative verify can roll this model's cache back (``ModelCache.rollback``)
    can_verify = True

    def __init__(self, cfg: ModelConfig, ops: DefaultOps, *, embedding: np.ndarray, blocks: list[Block],
                 output_hc: OutputHC, output_norm: mx.array, output: DenseWeight, source=None,
                 host_head: bool = False, decoder=CompiledDecoder):
        self.config, self.ops = cfg, ops
        self.embedding = embedding  # [n_vocab, n_embd] float16 (mmap view), rows gathered per token
        self.blocks, self.output_hc, self.output_norm, self.output = blocks, output_hc, output_norm, output
        self.source = source  # the GGUFFile the weights map (kept open while the model lives)
        # The output matrix multiplied on the host by the native library, read from its Q8_0 blocks
        # (``DenseWeight.host_product``; the loader decides: ``loader.host_head``), not by MLX as float32.
        self.host_head = bool(host_head) and output is not None
        # The decode step's class, chosen by the loader with the MoEs' routing: ``CompiledDecoder``
        # (device routing: each layer is ``Block.__call__``) or ``host_step.HostStepDecoder``.
        self._decoder_cls = decoder
        self._decoders: dict[bool, object] = {}
        # The bounded device expert cache (``expert_cache.ExpertCacheSet``; the loader sets it), or
        # None: every routed expert resident (device strategy) or read per call (host strategy).
        self.expert_cache = None
        # What the loader resolved and planned (``load_plan.LoadPlan``, ``memory_plan.MemoryPlan``); it
        # sets them once the model is built.
        self.load_plan = None
        self.memory_plan = None

    @property
    def numerics(self) -> Numerics:
        """The numerics mode the model was loaded with (its ``ops``)."""
        return self.ops.numerics

    @property
    def expert_strategy(self) -> str:
        """The routed-expert strategy the blocks were built with (``device_experts``), as the load plan
        resolved it: "device" (every expert resident, or a bounded cache of them) or "host"."""
        return self.load_plan.experts

    def embed(self, tokens: np.ndarray) -> mx.array:
        """[T] ids -> H [T, n_hc, n_embd]: the F16 row in every stream."""
        e = mx.array(np.asarray(self.embedding[tokens], dtype=np.float32))
        return mx.broadcast_to(e[:, None, :], (e.shape[0], self.config.n_hc, e.shape[1]))

    def head(self, H: mx.array) -> mx.array:
        """H [T, n_hc, n_embd] -> logits [T, n_vocab]."""
        return self.head_logits(self.head_hidden(H))

    # The head in two halves, so a pipeline can share the output matrix's rows between ranks: the
    # last rank mixes and norms (``head_hidden``), each rank multiplies its own rows (``head_logits``).

    def head_hidden(self, H: mx.array) -> mx.array:
        """H [T, n_hc, n_embd] -> the output mix, RMS-normed: [T, n_embd], what the output matrix multiplies."""
        return self.ops.rms_norm(self.output_hc(H), self.output_norm, self.config.rms_eps)

    def head_logits(self, x: mx.array) -> mx.array:
        """``head_hidden``'s [T, n_embd] -> the logits of the output rows this model holds [T, rows].
        With ``host_head`` x is read to the host here (an evaluation) and the logits come back as an
        evaluated array, so this is never called inside ``mx.compile`` then (``CompiledDecoder.run``)."""
        if self.host_head:
            x = to_host(x, np.float32)
            if self.source is not None:
                self.source.check_intact()  # the native code reads the mapping: a truncated file is an error
            return mx.array(self.output.host_product(x))
        return self.ops.linear(self.output, x)

    def decoder(self, compile: bool = True):
        """The (cached) ``CompiledDecoder`` of this model; ``compile=False``: the same fixed-shape
        step run eagerly."""
        if compile not in self._decoders:
            self._decoders[compile] = self._decoder_cls(self, compile=compile)
        return self._decoders[compile]

    def empty_cache(self) -> ModelCache:
        """An empty cache of the layers this model runs (all of them; a pipeline rank: its own)."""
        return ModelCache.empty(self.config)

    def step(self, token: int, cache: ModelCache, *, evaluate: bool = True) -> mx.array:
        """Feed one token through the compiled decode step (DEFAULT numerics): the decoder's ``run``
        (``CompiledDecoder.run``); updates ``cache`` in place and returns the next-token logits, lazily
        (``evaluate=False``: the cache's new arrays too)."""
        return self.decoder().run(token, cache, evaluate=evaluate)

    def forward_chunk(self, tokens: np.ndarray, cache: ModelCache, want_logits: bool | str = True, *,
                      logits_from=None) -> tuple[mx.array | None, ModelCache]:
        """Run tokens (positions cache.n_tokens..) layer-major; logits of the last token if asked
        ([n_vocab]), or with ``want_logits="all"`` of every position ([T, n_vocab]: teacher-forced
        scoring, ``engine.perplexity``; a single-process model only, pipeline ranks send the last
        row). Returns the cache after them; ``cache`` itself is left as it was. ``logits_from``:
        ``(H, tokens, p0, cache, want_logits) -> logits`` after this model's blocks, when they come
        from elsewhere (a pipeline's rank 0: the later ranks, ``PipelineModel``); default this
        model's own head (``chunk_logits``)."""
        if self.source is not None:
            self.source.check_intact()  # weights are about to be read: a truncated file is an error, not SIGBUS
        with self.ops.stream():
            return self._forward_chunk(tokens, cache, want_logits, logits_from=logits_from)[:2]

    def forward_verify(self, tokens: np.ndarray, cache: ModelCache,
                       taps: Sequence[int] | None = None) -> tuple[mx.array, mx.array, ModelCache]:
        """A speculative verify chunk (at most n_swa tokens at cache.n_tokens..): (logits of every
        position [T, n_vocab], H after the last block [T, n_hc, n_embd] — the rows before the output
        HC mix, evaluated —, the cache after them, which ``ModelCache.rollback`` can cut back to any
        prefix of the chunk). The same computation as ``forward_chunk``; ``cache`` is left as it was.
        ``taps``: layer indices whose outputs a drafter reads instead (DSpark): the second value is
        then those layers' HC-mean rows [T, len(taps), n_embd] (``tap_rows``), from the same forward.
        A single-process model only."""
        if taps is not None:
            taps = self.check_taps(taps)
        if self.source is not None:
            self.source.check_intact()
        with self.ops.stream():
            tapped = None if taps is None else dict.fromkeys(taps)
            logits, out, H = self._forward_chunk(tokens, cache, "all", record=True, tapped=tapped)
            if taps is not None:
                H = mx.stack([tapped[il] for il in taps], axis=1)
                mx.eval(H)
        return logits, H, out

    def check_taps(self, taps: Sequence[int]) -> tuple[int, ...]:
        """``taps`` as a tuple of distinct layer indices of this model (InferenceError otherwise)."""
        out = tuple(int(il) for il in taps)
        n = self.config.n_layer
        if not out or len(set(out)) != len(out) or any(not 0 <= il < n for il in out):
            raise InferenceError(f"tap layers {list(out)}: need distinct layer indices in 0..{n - 1}")
        return out

    def tap_rows(self, H: mx.array) -> mx.array:
        """A layer output H [T, n_hc, n_embd] -> its HC-stream mean [T, n_embd] (ds4's
        ds4_gpu_dspark_hc_mean_reduce: weights 1/n_hc, in the HC pre-mix's summation order)."""
        T, n_hc = H.shape[0], H.shape[1]
        return self.ops.weighted_streams(H, mx.full((T, n_hc), 1.0 / n_hc, dtype=mx.float32))

    def _forward_chunk(self, tokens: np.ndarray, cache: ModelCache, want_logits: bool | str,
                       record: bool = False, tapped: dict | None = None, logits_from=None
                       ) -> tuple[mx.array | None, ModelCache, mx.array]:
        tokens = np.asarray(tokens, dtype=np.int64)
        p0 = cache.n_tokens
        cache = cache.copy()  # on an error the caller keeps its cache untouched
        H = self.embed(tokens)
        # the embedding's finiteness rides with the first layer's evaluation
        H = self.run_blocks(H, tokens, cache, [("the token embedding", all_finite(H))], record=record,
                            tapped=tapped)
        logits = (logits_from or self.chunk_logits)(H, tokens, p0, cache, want_logits)
        if logits is not None:
            ok = all_finite(logits)
            mx.eval(logits, ok)
            raise_nonfinite([("the output head", ok)], f"positions {p0}..{p0 + len(tokens) - 1}", self.source)
        if len(tokens) > 1:
            allocator.release_file_pages(self.embedding)  # the output matrix, on its first use
        return logits, cache, H

    def chunk_logits(self, H: mx.array, tokens: np.ndarray, p0: int, cache: ModelCache,
                     want_logits: bool | str) -> mx.array | None:
        """The last token's logits (lazy) from H after the blocks of a chunk at p0.. (``cache``:
        the cache after it), every token's for "all", or None when not wanted, from this model's head."""
        if want_logits == "all":
            return self.head(H)
        return self.head(H[-1:])[0] if want_logits else None

    def run_blocks(self, H: mx.array, tokens: np.ndarray, cache: ModelCache,
                   pending: list[tuple[str, mx.array]] | None = None, *, record: bool = False,
                   tapped: dict | None = None) -> mx.array:
        """This model's blocks (all of them, or a pipeline rank's range) on a chunk H at positions
        ``cache.n_tokens``..; fills ``cache`` in place and advances it. ``pending``: earlier stages'
        finiteness flags, checked with the first layer's. ``record``: a verify chunk (``ChunkAt``).
        ``tapped``: a dict keyed by layer indices, its values set to ``tap_rows`` of those layers'
        outputs (evaluated with the layer)."""
        p0 = cache.n_tokens
        cache.reserve(p0 + len(tokens) - 1)
        at = ChunkAt(p0, len(tokens), self.ops, record=record)
        where = f"positions {p0}..{p0 + len(tokens) - 1}"
        # Each stage's finiteness is a scalar evaluated in the layer's own mx.eval, so the checks add
        # no synchronisation.
        pending = list(pending or [])
        # A chunk of many tokens reads nearly every expert slab of a layer out of the mapping; those
        # clean file pages are released layer by layer (the whole GGUF mapping, found through the
        # embedding's view) so they never pile up; one-token chunks (decode steps) keep theirs.
        release = len(tokens) > 1
        for block in self.blocks:
            if self.source is not None and block.il:
                self.source.check_intact()  # and before each further layer's weights
            lc = cache.layers[block.il]
            lc.bind(at)
            H = block(H, tokens, lc)
            pending.append((f"layer {block.il}", all_finite(H)))
            extra = []
            if tapped is not None and block.il in tapped:
                tapped[block.il] = self.tap_rows(H)
                extra.append(tapped[block.il])
            mx.eval(H, *lc.arrays(), *(ok for _, ok in pending), *extra)
            raise_nonfinite(pending, where, self.source)
            pending = []
            if release:
                allocator.release_file_pages(self.embedding)
        cache.advance(p0 + len(tokens))
        return H


def all_finite(x: mx.array) -> mx.array:
    """A lazy boolean scalar: no NaN/Inf in ``x``."""
    return mx.all(mx.isfinite(x))


def raise_nonfinite(checks: list[tuple[str, mx.array]], where: str, source) -> None:
    """Raise ``NonFiniteError`` naming the first stage in ``checks`` ((what, evaluated flag) in
    order) whose output holds NaN/Inf.

    Checked after every layer of a chunk, so a damaged file is named at the prompt's prefill and the
    caller's state is left as it was (the new state is never returned). Decode steps of the compiled
    path are checked on their logits by the session."""
    for what, ok in checks:
        if not ok.item():
            path = getattr(source, "path", None)
            hint = f" (non-finite weights in {path}?)" if path else ""
            raise NonFiniteError(f"{what} produced non-finite values (NaN/Inf) at {where}{hint}")

