"""The hyper-connection mixers' Sinkhorn balancing on the host (``host_step.HostMixer``,
``ds4_mlx/native/hc.c``), which the host-routed decode step runs instead of ~100 tiny graph nodes per mixer.

Against MLX's ops (``HyperConnection.comb``, what the chunk path computes) and the numpy twin (the
fallback without the native library): the same matrix up to expf's and a 4-term sum's last bits, on
typical, extreme and non-finite logits; the decoder calls it for both mixers of every host-routed
layer; and what it does to decoded logits: within float noise of the MLX-balanced step (ds4's oracle
bands are checked on this path by test_oracle_logits, which decodes through it)."""

from __future__ import annotations

import ds4_mlx
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx import native
from ds4_mlx.engine.session import Session
from ds4_mlx.model.host_step import HostMixer, sinkhorn_numpy
from ds4_mlx.model.hyper_connection import HyperConnection


@pytest.fixture(scope="module")
def net(tiny_model_path):
    return ds4_mlx.load(tiny_model_path).network


def _mixes(rng, hc: HyperConnection, T: int, spread: float) -> np.ndarray:
    return (rng.standard_normal((T, 2 * hc.n_hc + hc.n_hc ** 2)) * spread).astype(np.float32)


def _mlx(hc: HyperConnection, mix: np.ndarray) -> np.ndarray:
    return np.array(hc.comb(mx.array(mix)))


@pytest.mark.parametrize("spread", [0.1, 1.0, 30.0, 3000.0])
def test_native_numpy_and_mlx_agree(net, spread):
    rng = np.random.default_rng(int(spread * 10))
    for block in net.blocks[:3]:
        for hc in (block.hc_attn, block.hc_ffn):
            mix = _mixes(rng, hc, 64, spread)
            host = HostMixer(hc)
            got = host.comb(mix)
            assert got.shape == (64, hc.n_hc, hc.n_hc) and got.dtype == np.float32
            ref = _mlx(hc, mix)
            twin = sinkhorn_numpy(mix, hc.n_hc, host.scale, host.base, hc.iters, hc.hc_eps)
            assert np.allclose(got, ref, rtol=2e-5, atol=1e-7), np.abs(got - ref).max()
            assert np.allclose(twin, ref, rtol=2e-5, atol=1e-7), np.abs(twin - ref).max()
            # balanced: columns sum to ~1 after the last (column) pass
            assert np.allclose(got.sum(axis=1), 1.0, atol=1e-3)


def test_non_finite_logits_give_non_finite_rows_where_mlx_does(net):
    hc = net.blocks[0].hc_attn
    rng = np.random.default_rng(3)
    mix = _mixes(rng, hc, 4, 1.0)
    mix[1, 2 * hc.n_hc + 5] = np.nan
    mix[2, 2 * hc.n_hc:] = np.inf
    mix[3, 2 * hc.n_hc + 1] = -np.inf
    with np.errstate(all="ignore"):
        got, ref = HostMixer(hc).comb(mix), _mlx(hc, mix)
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all()
    ok = np.isfinite(ref)
    assert np.allclose(got[ok], ref[ok], rtol=2e-5, atol=1e-7)


def test_without_the_native_library_numpy_computes_it(net, monkeypatch):
    hc = net.blocks[1].hc_ffn
    mix = _mixes(np.random.default_rng(5), hc, 8, 2.0)
    with_native = HostMixer(hc).comb(mix)
    monkeypatch.setattr(native, "library", lambda: None)
    without = HostMixer(hc).comb(mix)
    assert np.allclose(without, with_native, rtol=2e-5, atol=1e-7)


def test_native_arguments_are_checked():
    lib = native.library()
    if lib is None:
        pytest.skip(f"no native library: {native.status()['reason']}")
    mix, scale, base = np.zeros((2, 24), np.float32), np.ones(3, np.float32), np.zeros(24, np.float32)
    assert native.hc_sinkhorn(lib, mix, 4, scale, base, 20, 1e-6).shape == (2, 4, 4)
    for bad in (dict(mix=np.zeros((2, 23), np.float32)), dict(scale=np.ones(2, np.float32)),
                dict(base=np.zeros(20, np.float32)), dict(n=0), dict(n=17), dict(iters=0)):
        args = dict(mix=mix, n=4, scale=scale, base=base, iters=20, eps=1e-6) | bad
        with pytest.raises(ValueError, match="native Sinkhorn"):
            native.hc_sinkhorn(lib, **args)


def test_the_decode_step_balances_both_mixers_of_every_layer_on_the_host(net, monkeypatch):
    calls = []
    orig = HostMixer.comb

    def spy(self, mix):
        calls.append(self.hc)
        return orig(self, mix)

    monkeypatch.setattr(HostMixer, "comb", spy)
    s = Session(net, 256)
    s.append(list(range(300, 340)))
    assert not calls  # a prefill chunk balances with MLX's ops
    s.eval(7)
    s.logits()
    assert calls == [hc for b in net.blocks for hc in (b.hc_attn, b.hc_ffn)]


def test_decoded_logits_stay_within_float_noise_of_mlx_balancing(net, monkeypatch):
    """40 teacher-forced steps from a 100-token prompt, the mixers balanced on the host vs with MLX's
    ops: the same argmax and rms differences of float noise (FP8 rounding of the KV rows can turn a
    last-bit difference into one quantum, so not bit-identical)."""
    tokens = [int(t) for t in np.random.default_rng(9).integers(1000, 60000, 140)]

    def run():
        s = Session(net, 256)
        s.append(tokens[:100])
        out = []
        for t in tokens[100:]:
            s.eval(t)
            out.append(s.logits())
        return out

    host = run()
    monkeypatch.setattr(HostMixer, "comb", lambda self, mix: _mlx(self.hc, mix))
    ref = run()
    rms = np.array([np.sqrt(np.mean(np.square(a - b, dtype=np.float64))) for a, b in zip(host, ref)])
    assert np.median(rms) <= 5e-3 and rms.max() <= 0.1, rms
    assert np.mean([np.argmax(a) == np.argmax(b) for a, b in zip(host, ref)]) >= 0.95
