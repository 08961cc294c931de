"""What a pipeline rank holds: caches of its own layers only, and its share of the default
expert-LRU budget (no launch needed: the pieces are checked directly; the launched run's figures are
tests/test_bench_distributed.py's)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4_mlx.model.cache import ModelCache, state_layout
from ds4_mlx.model.experts import ExpertCache, routed_share
from ds4_mlx.engine.session import Session


@pytest.fixture(scope="module")
def tiny_file(tiny_model_path):
    from ds4_mlx.formats.layout import load_model_file

    f, cfg, _ = load_model_file(tiny_model_path)
    yield f, cfg
    f.close()


def _present(cache: ModelCache) -> list[int]:
    return [il for il, lc in enumerate(cache.layers) if lc is not None]


def test_a_rank_cache_holds_only_its_layers(tiny_file):
    _, cfg = tiny_file
    full = ModelCache.empty(cfg)
    part = ModelCache.empty(cfg, range(2, 4))
    assert len(part.layers) == cfg.n_layer  # indexed by layer, as the blocks look it up
    assert _present(full) == list(range(cfg.n_layer)) and _present(part) == [2, 3]
    assert part.nbytes == sum(a.nbytes for il in (2, 3) for a in full.layers[il].arrays())
    assert part.nbytes < full.nbytes / 2
    assert part.n_tokens == 0 and part.state_nbytes == sum(a.nbytes for a in part.state) > 0
    part.reserve(5000)  # grows its own buffers, skips the absent ones
    assert part.capacity == 8192 and all(lc.attn is None or lc.attn.rows.shape[0] == 8192 // lc.attn.ratio
                                         for lc in part.own)
    part.advance(3)
    assert part.n_tokens == 3
    snap = part.copy()
    assert _present(snap) == [2, 3] and snap.n_tokens == 3
    keys = set(part.to_numpy())
    assert keys == {"n_tokens"} | {s.key for s in state_layout(cfg, 3) if s.layer in (2, 3)}
    assert [s.layer for s in part.layout()] == [s.layer for s in state_layout(cfg, 3) if s.layer in (2, 3)]


def test_a_full_cache_serialises_as_before(tiny_file):
    _, cfg = tiny_file
    full = ModelCache.empty(cfg, range(cfg.n_layer))
    assert list(full.to_numpy()) == ["n_tokens"] + [s.key for s in state_layout(cfg, 0)]
    back = ModelCache.from_numpy(cfg, full.to_numpy())
    assert _present(back) == list(range(cfg.n_layer))
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(full.state, back.state))


def test_a_rank_model_starts_and_resets_with_its_own_caches(tiny_model_path, monkeypatch):
    """A new session, the session's reset and the compiled decoder's templates ask the model for an
    empty cache (``empty_cache``: a pipeline rank's has its own layers only); a whole model's has
    every layer."""
    import ds4_mlx
    from ds4_mlx.model.pipeline import PipelineModel

    engine = ds4_mlx.load(tiny_model_path)
    net = engine.network
    n = net.config.n_layer
    assert _present(Session(net, 16).state) == list(range(n))
    # what a PipelineModel of layers 1..2 answers (its method, run on this model)
    net.layers = range(1, 3)
    monkeypatch.setattr(net, "empty_cache", PipelineModel.empty_cache.__get__(net))
    try:
        assert _present(Session(net, 16).state) == [1, 2]
        s = Session(net, 16)
        s.reset()
        assert _present(s.state) == [1, 2]
    finally:
        del net.layers


def test_the_default_expert_budget_scales_with_the_rank_share():
    c = ExpertCache(1000, explicit=False)
    c.scale_default(0.25)
    assert c.limit_bytes == 250
    c.scale_default(1.0)  # from the default, not from the last scaled value
    assert c.limit_bytes == 1000
    c.set_limit(600)  # explicit from now on
    c.scale_default(0.5)
    assert c.limit_bytes == 600
    env = ExpertCache(1000)  # DS4_MLX_EXPERT_CACHE_MB: the user's budget, kept as is
    env.scale_default(0.5)
    assert env.limit_bytes == 1000
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
            c.scale_default(bad)


def test_scaling_down_evicts_the_oldest():
    import mlx.core as mx

    c = ExpertCache(3 * 400, explicit=False)
    for k in range(3):
        c.put((0, k), mx.zeros((100,), dtype=mx.float32))  # 400 bytes each
    c.scale_default(0.5)  # 600 bytes: one expert fits
    assert c.nbytes == 400 and c.get((0, 2)) is not None and c.get((0, 0)) is None


def test_routed_share_of_the_tiny_model(tiny_file):
    from ds4_mlx.model.pipeline import gguf_split

    f, cfg = tiny_file
    assert routed_share(f, range(cfg.n_layer)) == 1.0
    assert routed_share(f, range(0)) == 0.0
    ranges = gguf_split(f, cfg.n_layer, 2)
    shares = [routed_share(f, r) for r in ranges]
    assert sum(shares) == pytest.approx(1.0)
    # every layer of the tiny model has the same expert tensors: the share is the layer count's
    assert shares == pytest.approx([len(r) / cfg.n_layer for r in ranges])


def _rss_file() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="madvise release is Linux-only")
@pytest.mark.parametrize("numerics", ["default", "ds4-cpu"])
def test_building_the_head_leaves_its_gguf_pages_out_of_rss(tiny_model_path, numerics):
    """The rank that holds the head builds its float32 form from the GGUF's Q8_0 pages; those pages
    must not stay resident next to it (on the real model: 536 MiB more at that rank's peak, which
    kept a 2-rank pipeline above 0.6x the one-process peak). The tiny head is 70 MiB of Q8_0."""
    import mlx.core as mx

    from ds4_mlx.formats.layout import load_model_file
    from ds4_mlx.model.linear import DenseWeight

    f, cfg, _ = load_model_file(tiny_model_path)  # a fresh mapping: none of its pages resident yet
    try:
        w = DenseWeight.from_gguf(f, "output.weight", backend="cpu")
        assert w.nbytes > 64 << 20
        before = _rss_file()
        x = mx.zeros((1, cfg.n_embd))
        mx.eval(w(x) if numerics == "default" else w.ds4_cpu(x))
        assert _rss_file() - before < w.nbytes // 4, (before, _rss_file(), w.nbytes)
    finally:
        f.close()
