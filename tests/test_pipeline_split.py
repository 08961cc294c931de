"""The pipeline's split by resident bytes (``loader.resident_split``): what each tensor will hold in
memory for the numerics, backend and expert strategy, checked against what ``DenseWeight`` and
``ExpertWeights`` actually allocate; and the split the loader uses, on the tiny model and on a
generated model whose GGUF-byte and resident-byte splits differ. No launch needed (the launched
ranks' layers are checked in test_bench_distributed.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx import native
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.layout import load_model_file
from ds4_mlx.model import loader, pipeline
from ds4_mlx.model.device_experts import DeviceExpertWeights
from ds4_mlx.model.experts import ExpertCache, ExpertWeights, routed_resident_nbytes
from ds4_mlx.model.linear import DenseWeight, dense_ds4_cpu_resident_nbytes, dense_resident_nbytes
from test_linear import random_blocks

OUT, IN = 96, 256  # nb = 8 Q8_0 blocks per row


def _dense_raw(rng, qtype: GGMLType) -> np.ndarray:
    if qtype == GGMLType.Q8_0:
        return random_blocks(rng, qtype, (OUT,), IN)
    dtype = np.float16 if qtype == GGMLType.F16 else np.float32
    return rng.standard_normal((OUT, IN)).astype(dtype)


def _built(w: DenseWeight) -> int:
    """Bytes of every cached form the weight holds now."""
    forms = [w._dense, w._dense_t, w._blocks, *(w._affine or ()),
             *(w._ds4 if isinstance(w._ds4, tuple) else (w._ds4,))]
    return sum(int(a.nbytes) for a in forms if a is not None)


# -- the estimate is what the multiplication builds ------------------------------------------------------


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.F16, GGMLType.F32])
@pytest.mark.parametrize("numerics", ["default", "ds4-cpu"])
def test_dense_estimate_is_what_a_product_allocates(qtype, numerics):
    rng = np.random.default_rng(int(qtype) + len(numerics))
    w = DenseWeight("w", qtype, _dense_raw(rng, qtype), IN, backend="cpu")
    assert _built(w) == 0
    x = mx.array(rng.standard_normal((3, IN)).astype(np.float32))
    mx.eval(w(x) if numerics == "default" else w.ds4_cpu(x))
    assert _built(w) > 0
    if numerics == "default":
        assert w.resident_nbytes() == _built(w) == dense_resident_nbytes(qtype, w.shape, "cpu")
    else:
        assert w.ds4_cpu_resident_nbytes() == _built(w) == dense_ds4_cpu_resident_nbytes(qtype, w.shape)
    # the dense float32 forms are 4 bytes a value (Q8_0: ~3.8x its 34/32 bytes a value), ds4-cpu's F32 8
    per_value = 8 if (numerics, qtype) == ("ds4-cpu", GGMLType.F32) else 4
    extra = OUT * (IN // 32) * 4 if (numerics, qtype) == ("ds4-cpu", GGMLType.Q8_0) else 0
    assert _built(w) == per_value * OUT * IN + extra


def test_dense_estimate_of_a_weight_used_by_row_slices():
    """``attn_output_a`` is multiplied through ``rows`` slices, which share the root's ``dense()``:
    the same bytes as the root's ``dense_t``."""
    rng = np.random.default_rng(1)
    w = DenseWeight("w", GGMLType.Q8_0, _dense_raw(rng, GGMLType.Q8_0), IN, backend="cpu")
    x = mx.array(rng.standard_normal((2, IN)).astype(np.float32))
    mx.eval(w.rows(0, OUT // 2)(x), w.rows(OUT // 2, OUT)(x))
    assert _built(w) == w.resident_nbytes()


@pytest.mark.parametrize("use_kernels", [False, True])
def test_dense_estimate_of_the_metal_forms(use_kernels):
    """On Metal a Q8_0 weight is kept as MLX's affine 8-bit form, or as its raw blocks for the
    kernel; both forms are built here on any machine (only the product needs Metal)."""
    rng = np.random.default_rng(2)
    w = DenseWeight("w", GGMLType.Q8_0, _dense_raw(rng, GGMLType.Q8_0), IN, backend="metal",
                    use_kernels=use_kernels)
    mx.eval(w.blocks() if use_kernels else w.affine())
    assert w.resident_nbytes() == _built(w)
    f16 = DenseWeight("w", GGMLType.F16, _dense_raw(rng, GGMLType.F16), IN, backend="metal")
    mx.eval(f16.dense_t())  # what its product multiplies on Metal too
    assert f16.resident_nbytes() == _built(f16) == 4 * OUT * IN


@pytest.mark.parametrize("qtype", [GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q4_K])
def test_expert_estimate_is_what_the_lru_and_the_device_copy_hold(qtype):
    rng = np.random.default_rng(int(qtype))
    n_expert, out_dim, n_in = 4, 32, 256
    raw = random_blocks(rng, qtype, (n_expert, out_dim), n_in)
    x = mx.array(rng.standard_normal((n_expert, 1, n_in)).astype(np.float32))
    ids = np.arange(n_expert).reshape(n_expert, 1)  # every expert once
    f32 = 4 * n_expert * out_dim * n_in

    def estimate(device, lru):
        return routed_resident_nbytes(qtype, (n_expert, out_dim, n_in), device=device, lru_bytes=lru)

    for lru in (f32 + 1, f32 // 2, 0):  # room for all, for half, none
        e = ExpertWeights("e", qtype, raw, n_in, backend="cpu", use_kernels=False, native=False)
        e.cache = ExpertCache(lru)
        mx.eval(e(x, ids))
        assert e.cache.nbytes == estimate(False, lru) == min(lru, f32)
        if native.library() is not None:  # the native products read the blocks in place: resident_split's budget 0
            e = ExpertWeights("e", qtype, raw, n_in, backend="cpu", use_kernels=False, native=True)
            e.cache = ExpertCache(lru)
            mx.eval(e(x, ids))
            assert e.cache.nbytes == estimate(False, 0) == 0
        e.cache = ExpertCache(f32)
        mx.eval(e.ds4_cpu(x, ids))  # re-reads the mapping: keeps nothing
        assert e.cache.nbytes == 0  # the loader passes lru_bytes 0 for ds4-cpu
    d = DeviceExpertWeights("e", qtype, raw, n_in, backend="cpu", use_kernels=False)
    d.cache = ExpertCache(0)
    assert d.resident_nbytes == raw.nbytes == estimate(True, 0)
    assert estimate(True, f32) == raw.nbytes + f32  # a prefill chunk fills the LRU too
    # the Metal kernels read the raw blocks: the loader passes them no LRU share (``_Weights.resident_nbytes``)


# -- the loader's split ------------------------------------------------------------------------------


def test_tensor_kind_is_how_the_loader_takes_each_tensor(tiny_model_path):
    """``tensor_kind`` (what the split assumes) against what ``_Weights`` recorded while building
    every layer and the head of the tiny model (every layer kind: ratios 0/4/128, hash layers)."""
    f, cfg, _ = load_model_file(tiny_model_path)
    try:
        seen = {}
        real = loader._Weights

        class Recording(real):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                self.kinds = seen

        loader._Weights = Recording
        try:
            loader._build(f, cfg, loader.parse_numerics("default"), "cpu", "host")
        finally:
            loader._Weights = real
        assert set(seen) == set(f.tensors)  # the model takes every tensor of the file
        assert {n: loader.tensor_kind(n) for n in f.tensors} == seen
    finally:
        f.close()


def test_the_tiny_model_split(tiny_model_path):
    """The tiny model's float32 head (252 MiB against ~13 MiB a layer) alone outweighs the layers:
    the last rank gets one layer and the head, by resident and by GGUF bytes alike."""
    f, cfg, _ = load_model_file(tiny_model_path)
    try:
        for numerics in ("default", "ds4-cpu"):
            for strategy in ("host", "device"):
                assert loader.resident_split(f, cfg, 2, numerics, "cpu", strategy) == [range(0, 5), range(5, 6)]
        w = loader._Weights(f, "cpu", "host")
        assert w.resident_nbytes("output.weight", "default") == 4 * cfg.n_vocab * cfg.n_embd
        assert w.resident_nbytes("token_embd.weight", "default") == 0  # gathered from the mapping
    finally:
        f.close()


@pytest.fixture(scope="module")
def skewed_model(tmp_path_factory):
    """A 4-layer model whose routed experts dominate its GGUF bytes while its Q8_0 head dominates
    what a rank holds (as the real model's on the CPU backend): the two splits differ."""
    from ds4_mlx import synth

    cfg = synth.preset_config("tiny", n_layer=4, n_embd=256, n_vocab=8000, n_head=4, head_dim=192, n_rot=64,
                              n_out_group=2, q_lora=64, o_lora=32, n_expert=32, n_expert_used=2, n_ff_exp=512,
                              n_hash_layer=1, swa=16, n_indexer_head=2, indexer_head_dim=128, indexer_top_k=8,
                              seed=11, name="skewed-random", tokenizer=False)
    path = tmp_path_factory.mktemp("skewed") / "skewed.gguf"
    synth.write_tiny_model(cfg, path, compute_sha256=False)
    return path


def _loads(ranges, per_layer, first, last):
    loads = [sum(per_layer[i] for i in r) for r in ranges]
    loads[0] += first
    loads[-1] += last
    return loads


def test_the_split_by_resident_bytes_differs_from_gguf_bytes(skewed_model):
    f, cfg, _ = load_model_file(skewed_model)
    try:
        by_gguf = pipeline.gguf_split(f, cfg.n_layer, 2)
        # ds4-cpu on the host strategy: the experts stay in the mapping, the head is float32 + scales
        by_resident = loader.resident_split(f, cfg, 2, "ds4-cpu", "cpu", "host")
        assert by_gguf == [range(0, 2), range(2, 4)]
        assert by_resident == [range(0, 3), range(3, 4)]
        # and it is the best split of the resident bytes, which the GGUF split is not
        w = loader._Weights(f, "cpu", "host")
        per_layer, last = [0] * cfg.n_layer, 0
        for name in f.tensors:
            b = w.resident_nbytes(name, "ds4-cpu")
            if name.startswith("blk."):
                per_layer[int(name.split(".")[1])] += b
            else:
                last += b if name.startswith("output") else 0
        assert max(_loads(by_resident, per_layer, 0, last)) < max(_loads(by_gguf, per_layer, 0, last))
        assert loader.resident_split(f, cfg, 2, "ds4-cpu", "cpu", "host") == by_resident  # deterministic
    finally:
        f.close()


def test_load_builds_the_resident_split(skewed_model, monkeypatch):
    """``load(..., distributed="pipeline")`` builds the rank's range of ``resident_split`` (the
    launcher and the model's transport replaced: only the split is under test)."""
    from ds4_mlx.model import distributed as dist

    class Group:
        def __init__(self, rank):
            self._rank = rank

        def rank(self):
            return self._rank

        def size(self):
            return 2

    built = []

    def fake_model(cfg, ops, *, group, layers, **parts):
        built.append((group.rank(), layers, [b.il for b in parts["blocks"]], parts["output"] is not None))
        return type("M", (), {})()

    monkeypatch.setattr(loader.pipeline, "PipelineModel", fake_model)
    for rank in (0, 1):
        monkeypatch.setattr(dist, "join", lambda timeout, mode, checks=(), rank=rank: Group(rank))
        monkeypatch.setattr(dist, "rank0s", lambda group, values: list(values))  # each computes the same here
        loader.load(skewed_model, numerics="ds4-cpu", backend="cpu", experts="host", distributed="pipeline")
    assert built == [(0, range(0, 3), [0, 1, 2], False), (1, range(3, 4), [3], True)]


def test_tensors_the_model_does_not_take_weigh_nothing(tiny_model_path):
    """A file with extra tensors (odd names, shapes or types) splits like the file without them:
    one process ignores them, so a pipeline must not fail on them or count them."""
    from ds4_mlx.formats.layout import load_model_file as open_model

    class Info:
        def __init__(self, shape, ggml_type, nbytes):
            self.shape, self.ggml_type, self.nbytes = shape, ggml_type, nbytes

    f, cfg, _ = open_model(tiny_model_path)
    try:
        expected = loader.resident_split(f, cfg, 2)
        real_tensor, real_array, extra = f.tensor, f.tensor_array, {
            "blk.x.attn_q_a.weight": (Info((512, 64), GGMLType.F32, 1 << 30), np.zeros((64, 512), np.float32)),
            "blk.99.attn_q_a.weight": (Info((512, 64), GGMLType.F32, 1 << 30), np.zeros((64, 512), np.float32)),
            "blk.0.odd.weight": (Info((7,), GGMLType.F32, 1 << 30), np.zeros(7, np.float32)),
            "blk.1.odd_exps.weight": (Info((8, 8), GGMLType.F16, 1 << 30), np.zeros((8, 8), np.float16)),
        }
        f.tensors = {**f.tensors, **{n: v[0] for n, v in extra.items()}}
        f.tensor = lambda n: extra[n][0] if n in extra else real_tensor(n)
        f.tensor_array = lambda n: extra[n][1] if n in extra else real_array(n)
        assert loader.resident_split(f, cfg, 2) == expected
        w = loader._Weights(f, "cpu", "host")
        assert [w.resident_nbytes(n, "default") for n in extra][2:] == [0, 0]  # not a dense / expert tensor
    finally:
        f.close()
