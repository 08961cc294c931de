"""The host breaks of a decode step whose MoEs route on the host: the one file that takes a block apart.

Everything here exists because the routed experts are chosen on the host inside a compiled decode
step (the host expert strategy: numpy top-k, expert slabs read out of the mmap by the native
library; the bounded device cache: misses read from the file), which a trace cannot contain. The
day device routing (or a fused mixer kernel) is as fast on every backend, this file goes as a whole:
the loader then always builds ``DeviceRouting`` and ``CompiledDecoder``, whose layers are
``Block.__call__`` itself.

    HostRouting          expert ids in numpy (``MoE.routing`` for host-routed layers)
    HostMixer            a hyper-connection mixer's Sinkhorn balancing on the host (native/hc.c, or
                         numpy): 24 logits read instead of ~100 tiny graph nodes per mixer
    HostStepDecoder      the compiled decode step cut at every router:

    compiled  mixer_fn[il](carry): finish the previous layer's FFN (its HC post), then the
                  attention mixer's logits -> H, mix
    eager     the attention mixer's combine matrix from mix, on the host (``HostMixer``)
    compiled  layer_fn[il](H, mix, C, pos, rope tables, layer cache arrays): the HC-wrapped
                  attention, then the FFN up to its router (HC reduce without the Sinkhorn,
                  ffn_norm, router scores, shared expert)
              -> (H, xn, post, FFN mixer logits, prob, shared[, choice]), new layer cache arrays
    eager     expert ids (``MoE.select``), the FFN mixer's combine matrix (``HostMixer``), the routed
              experts' weights and products (``ExpertWeights``: the native library on the CPU)
    compiled  the head (``CompiledDecoder``'s) finishes the last FFN first (``finish_ffn``)

The pieces are the block's own modules (``HyperConnection.mix/reduce/post``, ``Attention``, the
``MoE``'s router, shared expert, routed experts and combine) called in the order ``Block.__call__``
calls them, so the arithmetic is the chunk path's DEFAULT arithmetic up to the host Sinkhorn's
expf (``tests/test_host_sinkhorn.py``) and the fixed shapes (``compiled_decode``'s Numerics).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ds4_mlx import native
from ds4_mlx.model.cache import LayerCache, ModelCache, StepAt
from ds4_mlx.model.compiled_decode import CompiledDecoder, Counter
from ds4_mlx.model.host import to_host


class HostRouting:
    """Expert ids chosen in numpy (``MoE.routing``): the routed experts then read their slabs on the host."""

    name = "host"

    @staticmethod
    def table(tid2eid: np.ndarray) -> np.ndarray:
        return np.asarray(tid2eid)

    @staticmethod
    def select(choice: mx.array | None, table: np.ndarray | None, tokens, k: int) -> np.ndarray:
        """int32 [T, k]: ``table[tokens]`` on hash layers, else the k best of ``choice`` (a stable
        sort of the negated scores = ds4's insertion top-k with strict '>')."""
        if table is not None:
            sel = table[np.asarray(tokens)]
        else:
            sel = np.argsort(-to_host(choice, np.float32), axis=1, kind="stable")[:, :k]
        return np.ascontiguousarray(sel, dtype=np.int32)


HOST_ROUTING = HostRouting()


class HostMixer:
    """``HyperConnection.comb`` of one mixer computed on the host from its logits."""

    def __init__(self, hc):
        self.hc = hc
        self.n, self.iters, self.eps = hc.n_hc, hc.iters, hc.hc_eps
        self.scale = to_host(hc.scale, np.float32).reshape(-1)
        self.base = to_host(hc.base, np.float32).reshape(-1)

    def comb(self, mix: np.ndarray) -> np.ndarray:
        """float32 logits [T, 2n+n²] -> C [T, n, n]: by the native library (``native/hc.c``), or in
        numpy without it (the same float32 steps in the same order). DEFAULT numerics' arithmetic up
        to expf's last bit; ds4-cpu never decodes here (it is not compiled)."""
        lib = native.library()
        if lib is not None:
            return native.hc_sinkhorn(lib, mix, self.n, self.scale, self.base, self.iters, self.eps)
        return sinkhorn_numpy(mix, self.n, self.scale, self.base, self.iters, self.eps)


def sinkhorn_numpy(mix: np.ndarray, n: int, scale: np.ndarray, base: np.ndarray, iters: int,
                   eps: float) -> np.ndarray:
    """``native.hc_sinkhorn`` in numpy (float32 steps, sums in index order): its fallback and twin."""
    f32 = np.float32
    eps = f32(eps)
    T = mix.shape[0]
    c = (mix[:, 2 * n:].astype(f32) * f32(scale[2]) + base[2 * n:].astype(f32)).reshape(T, n, n)
    c = np.exp(c - c.max(axis=-1, keepdims=True))

    def total(a: np.ndarray, axis: int) -> np.ndarray:
        parts = np.moveaxis(a, axis, 0)
        acc = parts[0].copy()
        for p in parts[1:]:
            acc = acc + p
        return np.expand_dims(acc, axis)

    with np.errstate(all="ignore"):
        c = c * (f32(1) / total(c, -1)) + eps
        c = c * (f32(1) / (total(c, -2) + eps))
        for _ in range(1, iters):
            c = c * (f32(1) / (total(c, -1) + eps))
            c = c * (f32(1) / (total(c, -2) + eps))
    return c.astype(f32)


def finish_ffn(carry: list[mx.array], block) -> mx.array:
    """carry = [H] (layer 0) or [routed, shared, H, post, C] (the pending FFN of ``block``) -> H:
    the MoE's combine and the FFN mixer's post, the tail of ``Block.__call__``."""
    if len(carry) == 1:
        return carry[0]
    routed, shared, H, post, comb = carry
    return block.hc_ffn.post(block.ffn.combine(routed, shared), H, post, comb)


def _mixer_input(block, prev, counter: Counter):
    """The previous layer's FFN tail, then layer ``block``'s attention mixer logits: [H, mix]."""
    def body(carry):
        counter.n += 1
        H = finish_ffn(carry, prev)
        return [H, block.hc_attn.mix(H)]

    return body


def _to_router(block, template: LayerCache, counter: Counter, closes: bool):
    """Layer ``block`` from its input H, its attention mixer's logits and their combine matrix (from
    the host) up to its router; the FFN mixer's logits come back in place of its combine matrix.
    ``closes``: the step closes the layer's compressor windows (``StepAt.closes``)."""
    def body(H, mix, comb, pos, tables, arrays):
        counter.n += 1
        cache = template.view(arrays, StepAt(pos, *tables, closes=closes))
        hc, ffn = block.hc_ffn, block.ffn
        x, post = block.hc_attn.reduce(H, mix)
        H = block.hc_attn.post(block.attn(x, cache), H, post, comb)
        ffn_mix = hc.mix(H)
        x, post = hc.reduce(H, ffn_mix)
        xn = ffn.ops.rms_norm(x, ffn.ffn_norm, ffn.eps)
        prob, choice = ffn.router_scores(xn)
        out = [H, xn, post, ffn_mix, prob, ffn.shared_expert(xn)] + ([] if choice is None else [choice])
        return out, cache.arrays()

    return body


class HostStepDecoder(CompiledDecoder):
    """``CompiledDecoder`` for a model whose MoEs route on the host: each layer cut at its router
    (see the module docstring)."""

    finish_ffn = staticmethod(finish_ffn)

    def _build_layers(self, blocks, templates, wrap) -> None:
        self._mixers = [(HostMixer(b.hc_attn), HostMixer(b.hc_ffn)) for b in blocks]
        self._mixer_fns = [wrap(_mixer_input(b, blocks[i - 1] if i else None, self._counter))
                           for i, b in enumerate(blocks)]
        self._layer_fns = [{c: wrap(_to_router(b, templates[b.il], self._counter, c)) for c in self._variants(b)}
                           for b in blocks]

    def run(self, token: int, cache: ModelCache, *, H: mx.array | None = None, until: str = "logits",
            evaluate: bool = True) -> mx.array:
        """``CompiledDecoder.run`` with every layer cut at its router (the module docstring)."""
        model = self.model
        H, p, pos = self._start(token, cache, H, until)
        tokens = np.array([token], dtype=np.int64)
        carry = [H]
        for il, block in enumerate(model.blocks):
            attn_mixer, ffn_mixer = self._mixers[il]
            lc = cache.layers[block.il]
            # The attention mixer's logits are read here (their own wait) for its Sinkhorn on the host.
            H, mix = self._mixer_fns[il](carry)
            comb = mx.array(attn_mixer.comb(to_host(mix, np.float32)))
            out, arrays = self._layer_fns[il][self._closes(block, p)](H, mix, comb, pos, self._tables(il, p),
                                                                       lc.arrays())
            # drop the old buffers before anything is evaluated, so MLX may update them in place
            lc.set_arrays(arrays)
            H, xn, post, ffn_mix, prob, shared = out[:6]
            ffn = block.ffn
            sel = ffn.select(out[6] if len(out) > 6 else None, tokens)
            comb = mx.array(ffn_mixer.comb(to_host(ffn_mix, np.float32)))
            # The router's scores are read (on routed layers; hash layers wait for their mixer's
            # logits): what the choice did not need (the shared expert, the cache's lanes) runs on
            # MLX's stream while the host multiplies the routed experts, not after them.
            mx.async_eval(shared, *arrays)
            del arrays
            carry = [ffn.routed_experts(xn, sel, ffn.route_weights(prob, sel)), shared, H, post, comb]
        return self._finish(carry, cache, until, evaluate)
