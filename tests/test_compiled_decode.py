"""The compiled decode step (``compiled_decode`` over the fixed-shape buffers of a ``ModelCache``) on the oracle's
tiny model (ratios 0,0,4,128,4,128; SWA 32; indexer top-k 16).

What is checked, and against what:
* compiled vs the same fixed-shape step run eagerly: bit-identical (compilation changes no bit);
* one step from the same state vs the uncompiled chunk path's one-token step, at positions where
  something happens (raw window filling / full, ratio-4 and ratio-128 emissions, indexer on): max
  |Δlogit| <= 2e-3. Not bit-identical: the fixed shapes pad the raw window and the compressed
  rows with masked keys, and OpenBLAS rounds a row's dot products differently depending on how
  many rows the product has (q[16, 256] · k[n, 256]ᵀ differs in the last bits from the first n
  columns of q · k[32, 256]ᵀ for n = 2, 5, 31 — measured here). Measured over the 340
  positions 0..339: median 2.6e-6, worst 2.4e-4;
* 300 teacher-forced decode steps from BOS, compiled vs uncompiled sessions: the per-step noise
  above compounds through FP8 / routing / indexer decisions. Measured: step rms median 5.9e-4,
  p90 1.2e-3, one isolated step at 0.083 (p = 112; from the same state that step agrees to 1e-5,
  so it is a compounded flip), argmax equal on 298 / 300 steps.
  Bounds: median rms <= 5e-3, p90 <= 1e-2, worst <= 0.3 (the oracle's band for isolated flips),
  argmax equal on >= 97 % of steps; a real bug (mask, emission, RoPE position) is O(0.1-1) at
  most steps;
* no retrace per token (trace counter), conversions exact, snapshot / restore mid-decode exact.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import ds4_mlx
from ds4_mlx.errors import InferenceError
from ds4_mlx.model import cache as model_cache
from ds4_mlx.model.cache import ModelCache, capacity_for
from ds4_mlx.model.compiled_decode import CompiledDecoder
from ds4_mlx.model.device_experts import DEVICE_ROUTING
from ds4_mlx.model.host_step import HOST_ROUTING, HostMixer, HostStepDecoder
from ds4_mlx.model.numerics import EMPTY_SCORE
from ds4_mlx.engine.session import Session

N_LONG = 300  # decode steps of the teacher-forced comparison (positions 1..300)


@pytest.fixture(scope="module")
def tokens(oracle_dir) -> list[int]:
    return json.loads((oracle_dir / "golden" / "dev_long.json").read_text())["prompt_tokens"]


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return ds4_mlx.load(tiny_model_path, numerics="default").network


def mlx_sinkhorn(self, mix):
    """``host_step.HostMixer.comb`` computed with the chunk path's MLX ops (``HyperConnection.comb``),
    for comparisons of what the fixed shapes and compilation change alone (the host's expf differs in
    the last bits, which FP8 rounding of the KV rows then amplifies: ``test_host_sinkhorn.py``
    measures that)."""
    return np.array(self.hc.comb(mx.array(mix)))


@pytest.fixture(scope="module")
def long_run(model, tokens):
    """BOS prefilled, then N_LONG teacher-forced decode steps with and without compilation; the
    trace count after every step of the compiled session. The mixers balanced with MLX's ops."""
    dec = model.decoder()
    a = Session(model, 4096, compile=False)
    b = Session(model, 4096, compile=True)
    a.append(tokens[:1])
    b.append(tokens[:1])
    ref, got, traces = [], [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HostMixer, "comb", mlx_sinkhorn)
        for t in tokens[1: 1 + N_LONG]:
            a.eval(t)
            b.eval(t)
            ref.append(a.logits())
            got.append(b.logits())
            traces.append(dec.traces)
    return {"ref": ref, "got": got, "traces": traces, "a": a, "b": b}


def _compile_available() -> bool:
    """mx.compile falls back to plain calls where it cannot build kernels (no C++ compiler for
    MLX's CPU backend): then every call runs the Python body and traces cannot be counted."""
    count = [0]

    def f(x):
        count[0] += 1
        return x + 1

    cf = mx.compile(f)
    mx.eval(cf(mx.ones(3)))
    mx.eval(cf(mx.ones(3)))
    return count[0] == 1


needs_compile = pytest.mark.skipif(not _compile_available(), reason="mx.compile is unavailable on this device")


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32)


def assert_states_bit_equal(s1: ModelCache, s2: ModelCache) -> None:
    d1, d2 = s1.to_numpy(), s2.to_numpy()
    assert d1.keys() == d2.keys()
    for k in d1:
        assert d1[k].shape == d2[k].shape, k
        np.testing.assert_array_equal(d1[k].view(np.uint32) if d1[k].dtype == np.float32 else d1[k],
                                      d2[k].view(np.uint32) if d2[k].dtype == np.float32 else d2[k], err_msg=k)


# -- the long teacher-forced run ----------------------------------------------------------------------


def test_compiled_decode_matches_uncompiled_over_300_steps(long_run):
    ref, got = long_run["ref"], long_run["got"]
    rms = np.array([np.sqrt(np.mean(np.square(g - r, dtype=np.float64))) for g, r in zip(got, ref)])
    same_top = np.mean([int(np.argmax(g) == np.argmax(r)) for g, r in zip(got, ref)])
    assert np.median(rms) <= 5e-3, f"median step rms {np.median(rms):.3g}"
    assert np.percentile(rms, 90) <= 1e-2, f"p90 step rms {np.percentile(rms, 90):.3g}"
    assert rms.max() <= 0.3, f"worst step rms {rms.max():.3g} at step {int(rms.argmax())}"
    assert same_top >= 0.97, f"argmax equal on {same_top:.1%} of steps"


def _mixers(model) -> int:
    """Layers whose attention mixer's logits get a function of their own (host-routed layers: the
    Sinkhorn runs on the host between it and the layer's function)."""
    return len(model.blocks) if isinstance(model.decoder(), HostStepDecoder) else 0


def _expected_traces(model, positions, capacity_at) -> list[int]:
    """What ``CompiledDecoder.traces`` reads after each step at ``positions``: one trace per function
    the first time it meets a buffer shape, i.e. per (layer, closes-its-window variant, capacity)
    on layers with compressors, per layer on the others, plus the mixer functions and the head once."""
    config = model.config
    seen, out = set(), []
    for p in positions:
        for il in range(config.n_layer):
            r = config.compress_ratio(il)
            seen.add((il, p % r == r - 1, capacity_at(p)) if r else (il,))
        out.append(len(seen) + _mixers(model) + 1)
    return out


@needs_compile
def test_no_retrace_per_token(model, long_run):
    """The Python bodies run only while MLX traces: one trace per layer function and the head at
    the first step, one more per layer with compressors at its first window-closing step (p = 3 for
    ratio 4, p = 127 for ratio 128: the pooling variant), then none across the raw window filling up
    (p = 31), later emissions, the indexer going live (p = 67), ratio-128 emissions (p = 255)."""
    traces = long_run["traces"]
    cap = capacity_for(0)
    assert long_run["b"].state.capacity == cap
    cfg = model.config
    assert traces == _expected_traces(model, range(1, 1 + len(traces)), lambda p: cap)
    n_compressed = sum(1 for il in range(cfg.n_layer) if cfg.compress_ratio(il))
    assert traces[-1] == cfg.n_layer + 1 + n_compressed + _mixers(model)  # two variants of those, no more


@needs_compile
def test_first_step_traces_every_function(model, tokens):
    dec = type(model.decoder())(model)  # a fresh decoder of the model's kind: nothing traced yet
    cache = ModelCache.empty(model.config)
    assert dec.traces == 0
    mx.eval(dec.step(tokens[0], cache))
    assert dec.traces == model.config.n_layer + 1 + _mixers(model)
    mx.eval(dec.step(tokens[1], cache))
    assert dec.traces == model.config.n_layer + 1 + _mixers(model)


@needs_compile
def test_buffer_growth_retraces_once_per_capacity(model, tokens, monkeypatch):
    """Row buffers grow by doubling; each growth is one new shape for the functions of layers
    with compressed rows (one more trace each); dense layers and the head keep theirs."""
    monkeypatch.setattr(model_cache, "MIN_CAPACITY", 128)
    s = Session(model, 4096, compile=False)
    s.append(tokens[:120])
    cache = s.state.copy()
    assert cache.capacity == 128
    dec = type(model.decoder())(model)
    n_fns = model.config.n_layer + 1 + _mixers(model)
    n_grown = sum(1 for il in range(model.config.n_layer) if model.config.compress_ratio(il))
    counts = []
    for t in tokens[120:135]:  # positions 120..134: the step at 127 needs slot 127 // 4 < 32 still
        dec.step(t, cache)
        counts.append((cache.n_tokens, cache.capacity, dec.traces))
    assert [c[1] for c in counts] == [128] * 8 + [256] * 7
    cfg = model.config
    assert [c[2] for c in counts] == _expected_traces(model, range(120, 135), lambda p: 128 if p < 128 else 256)
    # the non-closing variants: traced at the first step, then again only after the growth
    assert counts[0][2] == n_fns and counts[8][2] - counts[7][2] == n_grown
    for il, lc in enumerate(cache.layers):
        r = model.config.compress_ratio(il)
        if r:
            assert lc.attn.rows.shape[0] == 256 // r


# -- tight checks ----------------------------------------------------------------------------------


def test_compiled_bit_identical_to_eager_fixed_shape_step(model, tokens):
    s = Session(model, 4096, compile=False)
    s.append(tokens[:110])
    ca, cb = s.state.copy(), s.state.copy()
    eager, compiled = model.decoder(compile=False), model.decoder(compile=True)
    for t in tokens[110:130]:  # ratio-4 emissions at 111, 115, …; ratio 128 at 127; indexer live
        la, lb = eager.step(t, ca), compiled.step(t, cb)
        assert np.array_equal(bits(la), bits(lb))
    for x, y in zip(ca.arrays(), cb.arrays()):
        assert np.array_equal(bits(x), bits(y))


def test_one_step_matches_chunk_path(model, tokens):
    """From the chunk path's own state at each position, one compiled step vs one chunk-path step."""
    s = Session(model, 4096, compile=False)
    done = 0
    for p in (0, 1, 30, 31, 66, 67, 126, 127, 128, 131, 255, 300):
        s.append(tokens[done:p])
        cache = s.state.copy()
        got = np.array(model.decoder().step(tokens[p], cache))
        s.eval(tokens[p])
        done = p + 1
        ref = s.logits()
        assert np.abs(got - ref).max() <= 2e-3, f"p={p}: max |dlogit| {np.abs(got - ref).max():.3g}"
        # the new state has the chunk path's structure: the same shapes and empty frontier slots
        # (the values differ in the last bits, which FP8 can turn into one quantum)
        mine, theirs = cache.to_numpy(), s.state.to_numpy()
        assert mine.keys() == theirs.keys()
        for k in mine:
            assert mine[k].shape == theirs[k].shape, (p, k)
            if k.endswith("gst"):
                np.testing.assert_array_equal(mine[k] == EMPTY_SCORE, theirs[k] == EMPTY_SCORE, err_msg=f"{p} {k}")
            if k.endswith("kst"):
                np.testing.assert_array_equal(mine[k] == 0, theirs[k] == 0, err_msg=f"{p} {k}")


# -- conversions -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 20, 31, 32, 150, 257])
def test_state_cache_round_trip_exact(model, tokens, n):
    s = Session(model, 4096, compile=False)
    if n:
        s.append(tokens[:n])
    st = s.state
    assert st.capacity == capacity_for(max(n - 1, 0))  # a function of the position only
    cache = ModelCache.from_state(model.config, n, st.state)
    assert cache.n_tokens == n and cache.capacity == st.capacity
    assert_states_bit_equal(cache, st)
    big = cache.copy()
    big.reserve(2 * cache.capacity - 1)
    assert big.capacity == 2 * cache.capacity
    assert_states_bit_equal(big, st)
    assert_states_bit_equal(ModelCache.from_numpy(model.config, st.to_numpy()), st)


def test_cache_state_cache_continues_bit_identically(model, tokens):
    """Decode, rebuild the cache from its canonical state, keep decoding: the same bits as the cache
    that was never rebuilt (the provisional row slot and stale ring slots are never read)."""
    s = Session(model, 4096, compile=False)
    s.append(tokens[:60])
    c1 = s.state.copy()
    dec = model.decoder()
    for t in tokens[60:70]:
        dec.step(t, c1)
    c2 = ModelCache.from_state(model.config, c1.n_tokens, c1.state)
    for t in tokens[70:80]:
        assert np.array_equal(bits(dec.step(t, c1)), bits(dec.step(t, c2)))
    assert_states_bit_equal(c1, c2)


# -- the session ----------------------------------------------------------------------------------


def test_snapshot_restore_mid_decode(model, tokens):
    s = Session(model, 4096)
    assert s.compiled
    s.append(tokens[:50])
    for t in tokens[50:60]:
        s.eval(t)
    snap = s.snapshot()
    saved = snap.state.to_numpy()
    assert snap.state.n_tokens == 60 == s.n_tokens and list(snap.tokens) == tokens[:60]
    want = []
    for t in tokens[60:75]:
        s.eval(t)
        want.append(s.logits())
    # the snapshot was not touched by the steps after it (the cache is updated in place)
    assert_states_bit_equal(snap.state, ModelCache.from_numpy(model.config, saved))
    other = Session(model, 2048)  # another context size: the same shapes, the same bits
    other.append(tokens[300:310])
    other.restore(snap)
    for t, w in zip(tokens[60:75], want):
        other.eval(t)
        assert np.array_equal(bits(other.logits()), bits(w))
    assert_states_bit_equal(other.state, s.state)
    # a multi-token prefill after decoding continues from the decoded cache: as from its snapshot
    s.append(tokens[75:90])
    other.append(tokens[75:90])
    assert s.n_tokens == 90 and np.array_equal(bits(s.logits()), bits(other.logits()))


def test_unread_steps_settle_like_read_ones(model, tokens, monkeypatch):
    """A compiled step leaves the cache lazy until its logits are read (one sync per decoded token);
    feeds whose logits nobody reads are evaluated before the next feed, a snapshot or a chunk, so
    they give the same bits as steps read one by one, and the graph never spans more than one step."""
    read = Session(model, 4096)
    unread = Session(model, 4096)
    for r in (read, unread):
        r.append(tokens[:40])
    # The session's own evaluations (settling a step), apart from host reads (``model.host.to_host``)
    # and the expert path's: the session module's ``mx`` counts its ``eval`` calls.
    from ds4_mlx.engine import session as session_module

    evals = []

    class CountingMx:
        def __getattr__(self, name):
            return getattr(mx, name)

        @staticmethod
        def eval(*a):
            evals.append(len(a))
            return mx.eval(*a)

    monkeypatch.setattr(session_module, "mx", CountingMx())
    for t in tokens[40:50]:
        read.eval(t)
        read.logits()
    assert evals == []  # read every step: the logits' read settles it, nothing else does
    for t in tokens[40:50]:
        unread.eval(t)
    assert len(evals) == 9  # each unread step settled by the next feed
    snap = unread.snapshot()  # settles the last one
    assert len(evals) == 10 and not unread._lazy
    assert np.array_equal(bits(unread.logits()), bits(read.logits()))
    assert_states_bit_equal(snap.state, read.state)
    unread.eval(tokens[50])
    unread.append(tokens[51:60])  # a chunk after an unread step
    read.eval(tokens[50])
    read.logits()
    read.append(tokens[51:60])
    assert np.array_equal(bits(unread.logits()), bits(read.logits()))
    assert_states_bit_equal(unread.state, read.state)


def test_opt_out_and_ds4_cpu_stay_on_the_chunk_path(model, tiny_model_path, tokens, monkeypatch):
    seen = []

    def spy(net):
        orig_chunk, orig_step = net.forward_chunk, net.step

        def spy_chunk(toks, state, want_logits=True):
            seen.append("chunk")
            return orig_chunk(toks, state, want_logits)

        def spy_step(token, cache, **kw):
            seen.append("step")
            return orig_step(token, cache, **kw)

        monkeypatch.setattr(net, "forward_chunk", spy_chunk)
        monkeypatch.setattr(net, "step", spy_step)

    spy(model)
    a = Session(model, 64, compile=False)
    a.append(tokens[:3])
    a.eval(tokens[3])
    b = Session(model, 64)
    b.append(tokens[:3])
    b.eval(tokens[3])
    # DS4_MLX_COMPILE is read once, at load (``LoadPlan.compile``): a session follows its load
    monkeypatch.setenv("DS4_MLX_COMPILE", "0")
    assert Session(model, 64).compiled
    off = ds4_mlx.load(tiny_model_path).network
    assert off.load_plan.compile is False and Session(off, 64, compile=True).compiled
    c = Session(off, 64)
    spy(off)
    c.append(tokens[:3])
    c.eval(tokens[3])
    assert not a.compiled and b.compiled and not c.compiled
    assert seen == ["chunk", "chunk", "chunk", "step", "chunk", "chunk"]
    assert np.array_equal(bits(a.logits()), bits(c.logits()))
    m4 = ds4_mlx.load(tiny_model_path, numerics="ds4-cpu").network
    assert not Session(m4, 64, compile=True).compiled
    with pytest.raises(InferenceError, match="DEFAULT"):
        m4.decoder()


def test_device_routed_moe_compiles_whole_layers(tiny_model_path, tokens, monkeypatch):
    """A MoE that routes on the device (``experts="device"``) gets one function per layer, the whole
    ``Block.__call__`` with no host break; run eagerly, it gives the bits of the same model's
    host-routed wiring (router read on the host, the same expert arithmetic; the host wiring's
    mixers balanced with the MLX ops here, as in the device layer, instead of ``hc.c``)."""
    monkeypatch.setattr(HostMixer, "comb", mlx_sinkhorn)

    model = ds4_mlx.load(tiny_model_path, experts="device").network
    s = Session(model, 4096, compile=False)
    s.append(tokens[:70])
    assert type(model.decoder()) is CompiledDecoder
    whole = CompiledDecoder(model, compile=False)
    host = HostStepDecoder(model, compile=False)
    ca, cb = s.state.copy(), s.state.copy()

    def route(routing):  # where MoE.select chooses the ids, as the loader would have built it
        for block in model.blocks:
            ffn = block.ffn
            ffn.routing, ffn.table = routing, None if ffn.tid2eid is None else routing.table(ffn.tid2eid)

    for t in tokens[70:74]:
        route(HOST_ROUTING)
        la = host.step(t, ca)
        route(DEVICE_ROUTING)
        lb = whole.step(t, cb)
        assert np.array_equal(bits(la), bits(lb))
    assert whole.traces == 4 * (model.config.n_layer + 1)
    assert_states_bit_equal(ca, cb)


# -- the fixed-shape indexer selection ----------------------------------------------------------------


def test_select_fixed_equals_select(model):
    """Against ``Indexer.select`` (ds4's repeated argmax with ties to the lower index), with many
    ties and every visible count regime."""
    idx = model.blocks[2].attn.indexer
    k = idx.top_k
    rng = np.random.default_rng(3)
    C = 64
    for trial in range(40):
        scores = rng.integers(0, 6, size=C).astype(np.float32)  # heavy ties
        if trial % 3 == 0:
            scores = rng.standard_normal(C).astype(np.float32)
        n_vis = int(rng.integers(0, C + 1))
        want = idx.select(mx.array(scores[None]), np.array([n_vis]))[0]
        ids, used = idx.select_fixed(mx.array(scores), mx.array(n_vis, dtype=mx.int32))
        ids, used = np.array(ids), np.array(used)
        n_used = min(n_vis, k)
        assert used.tolist() == [True] * n_used + [False] * (k - n_used)
        np.testing.assert_array_equal(ids[:n_used], want[:n_used][want[:n_used] < n_vis])
