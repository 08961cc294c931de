"""Path invariants of the forward pass on the oracle's tiny model: cold one-shot prefill, chunked
prefill, prefill-then-decode and resumed prefill must compute the same function.

In ``ds4-cpu`` numerics every path runs the same per-token arithmetic (the matmuls emulate ds4's
row-wise CPU kernels, the attention/pooling sums run in ds4's order), so the logits and the
state must be bit-identical. In ``default`` numerics a batched BLAS product and a per-token one
round differently in the last bit; FP8 KV rounding, Q8-free but still discrete top-k routing and
indexer selection turn a few of those bits into visible flips that compound over 700 tokens.
Measured on dev_long (733 tokens), against one-shot prefill: chunk 64 rms 0.013 / max 0.056,
chunk 7 rms 0.009 / max 0.041, chunk 1 rms 0.009 / max 0.041, prefill 633 + 100 decode steps
rms 0.0025 / max 0.011. The default-mode bound below (rms 0.05, max 0.25) is ~4x those and still
well below both the oracle's own build-to-build noise on long prompts (rms 0.07-0.23, README) and
the O(0.1-1) error of a real bug (e.g. a lost ratio-4 previous window or an off-by-one RoPE
position); the exact ds4-cpu checks are the sharp ones.
"""

from __future__ import annotations

import json

import ds4_mlx
import numpy as np
import pytest

from ds4_mlx.errors import Ds4Error
from ds4_mlx.errors import InferenceError
from ds4_mlx.model.cache import ModelCache
from ds4_mlx.engine.session import Session, Snapshot

DEFAULT_RMS, DEFAULT_MAX = 0.05, 0.25
N_DS4 = 200  # ds4-cpu checks: window sliding (32), indexer selection (from p=67), a ratio-128 row (p=127)


@pytest.fixture(scope="module")
def tokens(oracle_dir) -> list[int]:
    return json.loads((oracle_dir / "golden" / "dev_long.json").read_text())["prompt_tokens"]


@pytest.fixture(scope="module")
def model_default(tiny_model_path):
    return ds4_mlx.load(tiny_model_path, numerics="default").network


@pytest.fixture(scope="module")
def model_ds4(tiny_model_path):
    return ds4_mlx.load(tiny_model_path, numerics="ds4-cpu").network


@pytest.fixture(scope="module")
def ref_default(model_default, tokens):
    s = Session(model_default, 4096)
    s.append(tokens)
    return s.logits()


@pytest.fixture(scope="module")
def ref_ds4(model_ds4, tokens):
    s = Session(model_ds4, 4096)
    s.append(tokens[:N_DS4])
    return s.logits(), s.state.to_numpy()


def _assert_close_default(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    d = got - ref
    rms, mx_ = float(np.sqrt(np.mean(d * d))), float(np.abs(d).max())
    assert rms <= DEFAULT_RMS and mx_ <= DEFAULT_MAX, f"{what}: rms {rms:.4g} max {mx_:.4g}"
    # The argmax is a discrete decision: required equal only when the reference's top-1/top-2 margin
    # clears the noise (4x the rms); otherwise it must stay among the reference's top 3.
    top = np.argsort(-ref)[:3]
    if ref[top[0]] - ref[top[1]] > 4 * rms:
        assert got.argmax() == top[0], what
    else:
        assert got.argmax() in top, what


@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_prefill_default(model_default, tokens, ref_default, chunk):
    s = Session(model_default, 4096, chunk=chunk)
    s.append(tokens)
    _assert_close_default(s.logits(), ref_default, f"chunk {chunk}")


@pytest.mark.slow
def test_one_token_chunks_prefill_default(model_default, tokens):
    """Chunks of one token (each a forward pass of its own) over the first N_DS4 tokens, which pass
    every lane's boundaries (window 32, the indexer from 67, a ratio-128 row at 127), against one
    default-chunk prefill of the same tokens. (The whole 733-token prompt took 97 s of suite time.)"""
    ref = Session(model_default, 4096)
    ref.append(tokens[:N_DS4])
    s = Session(model_default, 4096, chunk=1)
    s.append(tokens[:N_DS4])
    _assert_close_default(s.logits(), ref.logits(), "chunk 1")


def test_prefill_then_decode_default(model_default, tokens, ref_default):
    s = Session(model_default, 4096)
    s.append(tokens[:633])
    for t in tokens[633:]:
        s.eval(t)
    _assert_close_default(s.logits(), ref_default, "prefill 633 + 100 decode steps")


@pytest.mark.parametrize("how", ["chunk7", "chunk64", "decode"])
def test_paths_bit_identical_ds4(model_ds4, tokens, ref_ds4, how):
    ref_logits, ref_state = ref_ds4
    toks = tokens[:N_DS4]
    if how == "decode":
        s = Session(model_ds4, 4096)
        s.append(toks[:N_DS4 - 12])
        for t in toks[N_DS4 - 12:]:
            s.eval(t)
    else:
        s = Session(model_ds4, 4096, chunk=int(how[5:]))
        s.append(toks)
    np.testing.assert_array_equal(s.logits(), ref_logits)
    # the state is the canonical one whatever the path (spec §6.3)
    got = s.state.to_numpy()
    assert got.keys() == ref_state.keys()
    for k in got:
        np.testing.assert_array_equal(got[k], ref_state[k], err_msg=k)


def test_resume_from_serialized_state(model_default, tokens):
    """A session restored from to_numpy/from_numpy continues exactly like the live one."""
    a = Session(model_default, 4096)
    a.append(tokens[:301])
    saved = a.state.to_numpy()
    a.append(tokens[301:420])
    b = Session(model_default, 4096)
    b.restore(Snapshot(tuple(tokens[:301]), ModelCache.from_numpy(model_default.config, saved), None))
    b.append(tokens[301:420])
    np.testing.assert_array_equal(a.logits(), b.logits())
    # state sizes follow spec §9.2
    cfg = model_default.config
    for il, lay in enumerate(b.state.layers):
        r = cfg.compress_ratio(il)
        st = lay.state  # canonical: raw, then each lane's rows / kst / gst
        assert st[0].shape == (cfg.n_swa, cfg.head_dim)
        if r:
            assert st[1].shape == (420 // r, cfg.head_dim)
        if r == 4:
            assert st[4].shape == (420 // 4, cfg.indexer_head_dim)


def test_chunk_boundaries_are_absolute(model_default, tokens, monkeypatch):
    calls = []
    orig = model_default.forward_chunk

    def spy(toks, state, want_logits=True):
        calls.append((state.n_tokens, len(toks), want_logits))
        return orig(toks, state, want_logits)

    orig_step = model_default.step

    def spy_step(token, cache, **kw):  # a compiled decode step: one token, logits
        calls.append((cache.n_tokens, 1, True))
        return orig_step(token, cache, **kw)

    monkeypatch.setattr(model_default, "forward_chunk", spy)
    monkeypatch.setattr(model_default, "step", spy_step)
    s = Session(model_default, 4096, chunk=64)
    s.append(tokens[:10])
    s.append(tokens[10:150])
    s.eval(tokens[150])
    # every chunk computes its logits: the state at its end may be kept (an automatic checkpoint, a
    # sync abandoned there) and must carry its own
    assert calls == [(0, 10, True), (10, 54, True), (64, 64, True), (128, 22, True), (150, 1, True)]


def test_session_api_and_errors(model_default):
    cfg = model_default.config
    s = Session(model_default, 8)
    with pytest.raises(InferenceError, match="no logits"):
        s.logits()
    with pytest.raises(InferenceError, match="outside the vocabulary"):
        s.append([1, cfg.n_vocab])
    with pytest.raises(InferenceError, match="context overflow"):
        s.append(list(range(9)))
    s.append([0, 5, 7])
    s.eval(9)
    lg = s.logits()
    assert lg.dtype == np.float32 and lg.shape == (cfg.n_vocab,) and np.isfinite(lg).all()
    assert s.tokens == [0, 5, 7, 9] and s.n_tokens == 4
    assert model_default.numerics.value == "default" and model_default.config.n_layer == cfg.n_layer


def test_load_rejects_unknown_numerics(tiny_model_path):
    with pytest.raises(Ds4Error, match="numerics"):
        ds4_mlx.load(tiny_model_path, numerics="fast-math").network
