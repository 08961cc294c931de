"""The pipeline's split by resident bytes (``loader.resident_split``): what each tensor will hold in
memory for the numerics, backend and expert strategy, checked against what ``DenseWeight`` and
``ExpertWeights`` actually allocate; and the split the loader uses, on the tiny model and on a
generated model whose GGUF-byte and resident-byte splits differ. No launch needed (the launched
ranks' layers are checked in test_bench_distributed.py)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.model import load_plan
from ds4_mlx import native
from ds4_mlx.errors import DistributedError, LayoutError
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.layout import load_model_file
from ds4_mlx.model import loader, pipeline
from ds4_mlx.model.device_experts import DeviceExpertWeights
from ds4_mlx.model.experts import ExpertCache, ExpertWeights, routed_resident_nbytes
from ds4_mlx.model.linear import DenseWeight, dense_ds4_cpu_resident_nbytes, dense_resident_nbytes
from fp_bounds import assert_within_matmul_bound
from test_linear import random_blocks

OUT, IN = 96, 256  # nb = 8 Q8_0 blocks per row


def _dense_raw(rng, qtype: GGMLType) -> np.ndarray:
    if qtype == GGMLType.Q8_0:
        return random_blocks(rng, qtype, (OUT,), IN)
    dtype = np.float16 if qtype == GGMLType.F16 else np.float32
    return rng.standard_normal((OUT, IN)).astype(dtype)


def _built(w: DenseWeight) -> int:
    """Bytes of every cached form the weight holds now."""
    forms = [w._dense, w._dense_t, w._blocks, w._half, *(w._affine or ()),
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


@pytest.mark.parametrize("numerics", ["default", "ds4-cpu", "default-host-head"])
def test_dense_estimate_of_a_row_range(tiny_model_path, numerics, monkeypatch):
    """A pipeline rank's share of the output head, ``from_gguf(..., rows=)``: a view of only those
    rows' bytes in the mapping, whose cached forms hold those rows only, as ``_Weights`` weighs them.
    A head multiplied on the host (``loader.host_head``) builds no form and is weighed as its GGUF
    bytes (read whole every token); "default" here is MLX's float32 head (the native library absent)."""
    host = numerics == "default-host-head"
    if host and not native.available():
        pytest.skip(f"no native library: {native.status()['reason']}")
    if not host:
        monkeypatch.setattr(loader, "host_head", lambda *a: False)
    numerics = "default" if host else numerics
    f, cfg, _ = load_model_file(tiny_model_path)
    try:
        rows = range(1000, 1700)
        w = DenseWeight.from_gguf(f, "output.weight", backend="cpu", rows=rows)
        assert w.shape == (len(rows), cfg.n_embd) and w.raw.base is not None  # a view, not a copy
        assert np.shares_memory(w.raw, f.tensor_array("output.weight"))
        x_np = np.random.default_rng(3).standard_normal((2, cfg.n_embd)).astype(np.float32)
        x = mx.array(x_np)
        if host:
            assert w.host_product(x_np).shape == (2, len(rows))
            assert _built(w) == 0
        else:
            mx.eval(w(x) if numerics == "default" else w.ds4_cpu(x))
        weights = loader._Weights(f, load_plan.resolve("default", "cpu", "host"))
        if host:
            assert weights.resident_nbytes("output.weight", numerics, rows=rows) == w.nbytes
            assert weights.resident_nbytes("output.weight", "ds4-cpu") > 0  # ds4-cpu keeps its own form
        estimate = weights.resident_nbytes("output.weight", numerics, rows=rows)
        built = w.nbytes if host else _built(w)
        assert built == estimate == weights.resident_nbytes("output.weight", numerics) * len(rows) // cfg.n_vocab
        for bad in (range(5, 5), range(0, cfg.n_vocab + 1), range(0, 10, 2)):
            with pytest.raises(LayoutError, match="row range"):
                DenseWeight.from_gguf(f, "output.weight", backend="cpu", rows=bad)
    finally:
        f.close()


@pytest.mark.parametrize("numerics", ["default", "ds4-cpu"])
def test_row_ranges_of_the_head_give_the_whole_heads_logits(tiny_model_path, numerics):
    """The pipeline's logits are rank 0's rows and the last rank's, each multiplied on its own, at cuts
    of every kind (the splits' and odd ones: BLAS's edge kernels). ds4-cpu: its per-row integer block
    sums, bit for bit the whole head's. Default numerics on MLX's float32 head (``DS4_MLX_NATIVE=off``):
    a row slice is another GEMM shape, whose summation order OpenBLAS picks (the same bits on one
    machine's kernels, not on every machine's), so it is held to the float32 bound against the whole
    head eager (a chunk's logits) and compiled (the decode step's head function is ``mx.compile``d).
    The native Q8_0 head, the default on the CPU, is bit-exact by rows by construction
    (``test_native_dense``)."""
    f, cfg, _ = load_model_file(tiny_model_path)
    try:
        whole = DenseWeight.from_gguf(f, "output.weight", backend="cpu")
        x = mx.array(np.random.default_rng(4).standard_normal((1, cfg.n_embd)).astype(np.float32))
        if numerics == "default":
            expected = [np.array(whole(x)), np.array(mx.compile(lambda v: whole(v))(x))]
            w = np.array(whole.dense())
        else:
            expected = [np.array(whole.ds4_cpu(x))]
        del whole
        for cut in (1, 7, 25299, 64937, cfg.n_vocab - 33):
            parts = [DenseWeight.from_gguf(f, "output.weight", backend="cpu", rows=r)
                     for r in (range(0, cut), range(cut, cfg.n_vocab))]
            got = np.concatenate([np.array(p(x) if numerics == "default" else p.ds4_cpu(x)) for p in parts], axis=1)
            for e in expected:
                if numerics == "default":
                    assert_within_matmul_bound(got, e, x, w, f"cut {cut}")
                else:
                    assert got.tobytes() == e.tobytes(), cut
    finally:
        f.close()


@pytest.mark.parametrize("use_kernels", [False, True])
def test_dense_estimate_of_the_metal_forms(use_kernels):
    """On a GPU (Metal, CUDA) a Q8_0 weight is kept as MLX's affine 8-bit form, or as its raw blocks for
    the kernel, and an F16 one as float16; the forms are built here on any machine."""
    rng = np.random.default_rng(2)
    w = DenseWeight("w", GGMLType.Q8_0, _dense_raw(rng, GGMLType.Q8_0), IN, backend="metal",
                    use_kernels=use_kernels)
    mx.eval(w.blocks() if use_kernels else w.affine())
    assert w.resident_nbytes() == _built(w)
    for backend in ("metal", "cuda"):
        f16 = DenseWeight("w", GGMLType.F16, _dense_raw(rng, GGMLType.F16), IN, backend=backend)
        x = mx.array(rng.standard_normal((3, IN)).astype(np.float32))
        y = f16(x)  # builds the form its product multiplies: float16, promoted exactly in the matmul
        assert f16.resident_nbytes() == _built(f16) == 2 * OUT * IN
        ref = np.asarray(x) @ np.asarray(f16.raw, dtype=np.float32).T
        np.testing.assert_allclose(np.array(y), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.MXFP4])
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


# -- the split with the head's rows shared --------------------------------------------------------------


def _split_loads(split, sizes, first, last, row_bytes):
    loads = [sum(sizes[i] for i in r) for r in split.layers]
    for rank in range(len(loads)):
        loads[rank] += len(split.head_rows(rank)) * row_bytes
    loads[0] += first
    loads[-1] += last
    return loads


@pytest.mark.parametrize("sizes,n,first,last,row_bytes,n_vocab", [
    ([10] * 6, 2, 0, 0, 3, 20), ([10] * 6, 3, 0, 5, 3, 20), ([5, 1, 1, 1, 1, 5], 2, 0, 0, 1, 9),
    ([1, 2, 3, 4, 5, 6, 7], 3, 4, 9, 2, 15), ([10, 10], 2, 100, 0, 1, 30), ([3] * 5, 4, 1, 1, 1, 7),
    ([8, 1, 1, 1, 8], 3, 0, 0, 5, 11), ([2] * 6, 2, 0, 40, 1, 10), ([4, 4, 4], 3, 0, 0, 7, 1),
])
def test_split_pipeline_is_optimal_over_layers_and_head_rows(sizes, n, first, last, row_bytes, n_vocab):
    split = pipeline.split_pipeline(sizes, n, first, last, row_bytes, n_vocab)
    assert len(split.layers) == n and split.layers[0].start == 0 and split.layers[-1].stop == len(sizes)
    assert all(a.stop == b.start for a, b in zip(split.layers, split.layers[1:]))
    assert all(len(r) >= 1 for r in split.layers) and 0 <= split.head_cut <= n_vocab
    rows = [split.head_rows(r) for r in range(n)]
    assert rows[0] == range(0, split.head_cut) and rows[-1] == range(split.head_cut, n_vocab)
    assert all(len(r) == 0 for r in rows[1:-1])  # the head's rows: rank 0 and the last rank only
    best = min(
        max(_split_loads(pipeline.PipelineSplit(tuple(range(a, b) for a, b in zip((0,) + cuts, cuts + (len(sizes),))),
                                                c, n_vocab), sizes, first, last, row_bytes))
        for cuts in itertools.combinations(range(1, len(sizes)), n - 1) for c in range(n_vocab + 1))
    assert max(_split_loads(split, sizes, first, last, row_bytes)) == best
    assert pipeline.split_pipeline(sizes, n, first, last, row_bytes, n_vocab) == split  # deterministic


def test_split_pipeline_edge_cases():
    # no head rows to share: the plain split, the head (none) on the last rank
    assert pipeline.split_pipeline([1, 1, 1, 8], 2, 0, 0) == pipeline.PipelineSplit((range(0, 3), range(3, 4)), 0, 0)
    one = pipeline.split_pipeline([5, 5], 1, 0, 0, 2, 10)  # one rank holds everything
    assert one.layers == (range(0, 2),) and one.head_rows(0) == range(0, 10)
    # a head that outweighs every layer: shared about evenly, the layers follow
    big = pipeline.split_pipeline([1] * 4, 2, 0, 0, 10, 100)
    assert big.layers == (range(0, 2), range(2, 4)) and big.head_cut == 50
    with pytest.raises(DistributedError, match="5 ranks but the model has only 4 layers"):
        pipeline.split_pipeline([1] * 4, 5, 0, 0, 1, 10)


def test_the_split_travels_as_ints():
    split = pipeline.PipelineSplit((range(0, 2), range(2, 3), range(3, 6)), 77, 1000)
    assert split.to_ints() == [0, 2, 3, 6, 77]
    assert pipeline.PipelineSplit.from_ints(split.to_ints(), 1000) == split


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
            loader._build(f, cfg, load_plan.resolve("default", "cpu", "host"))
        finally:
            loader._Weights = real
        assert set(seen) == set(f.tensors)  # the model takes every tensor of the file
        assert {n: loader.tensor_kind(n) for n in f.tensors} == seen
    finally:
        f.close()


def _resident_loads(f, cfg, split, numerics):
    """Each rank's resident bytes under ``split`` (host strategy, no expert LRU: ds4-cpu keeps none)."""
    w = loader._Weights(f, load_plan.resolve("default", "cpu", "host"))
    loads = []
    for rank, layers in enumerate(split.layers):
        b = sum(w.resident_nbytes(n, numerics) for n in f.tensors
                if n.startswith("blk.") and int(n.split(".")[1]) in layers)
        if rank == len(split.layers) - 1:
            b += sum(w.resident_nbytes(n, numerics) for n in f.tensors if n.startswith("output_"))
        rows = split.head_rows(rank)
        loads.append(b + (w.resident_nbytes("output.weight", numerics, rows=rows) if len(rows) else 0))
    return loads


def test_the_tiny_model_split(tiny_model_path):
    """The tiny model's float32 head (252 MiB against ~13 MiB of dense weights a layer) outweighs
    the layers: whole on the last rank (the split before the head's rows were shared) that rank held
    one layer and the head; shared, rank 0 takes part of the head and the ranks come out even."""
    f, cfg, _ = load_model_file(tiny_model_path)
    try:
        for numerics in ("default", "ds4-cpu"):
            for strategy in ("host", "device"):
                split = loader.resident_split(f, cfg, 2, load_plan.resolve(numerics, "cpu", strategy))
                assert 0 < split.head_cut < cfg.n_vocab, (numerics, strategy, split)
        split = loader.resident_split(f, cfg, 2, load_plan.resolve("ds4-cpu", "cpu", "host"))
        assert split.layers == (range(0, 2), range(2, 6)) and split.head_cut == 73677
        whole = pipeline.PipelineSplit((range(0, 5), range(5, 6)), 0, cfg.n_vocab)  # the best with the head whole
        loads, before = _resident_loads(f, cfg, split, "ds4-cpu"), _resident_loads(f, cfg, whole, "ds4-cpu")
        assert max(loads) < 0.7 * max(before) and abs(loads[0] - loads[1]) < 0.01 * max(loads), (loads, before)
        w = loader._Weights(f, load_plan.resolve("default", "cpu", "host"))
        # default numerics: the float32 head MLX multiplies, or its Q8_0 blocks when the native library
        # multiplies it on the host (``loader.host_head``)
        q8_0_bytes = cfg.n_vocab * cfg.n_embd // 32 * 34
        expect = q8_0_bytes if native.available() else 4 * cfg.n_vocab * cfg.n_embd
        assert w.resident_nbytes("output.weight", "default") == expect
        device = loader._Weights(f, load_plan.resolve("default", "cpu", "device"))
        assert device.resident_nbytes("output.weight", "default") == \
            4 * cfg.n_vocab * cfg.n_embd
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
        # ds4-cpu on the host strategy: the experts stay in the mapping, the head is float32 + scales,
        # and most of it goes to rank 0, which then takes one layer
        by_resident = loader.resident_split(f, cfg, 2, load_plan.resolve("ds4-cpu", "cpu", "host"))
        assert by_gguf == [range(0, 2), range(2, 4)]
        assert by_resident == pipeline.PipelineSplit((range(0, 1), range(1, 4)), 7264, cfg.n_vocab)
        # and it holds less on the largest rank than the GGUF split (the head whole on the last rank)
        gguf_split = pipeline.PipelineSplit(tuple(by_gguf), 0, cfg.n_vocab)
        loads = _resident_loads(f, cfg, by_resident, "ds4-cpu")
        assert max(loads) < max(_resident_loads(f, cfg, gguf_split, "ds4-cpu"))
        again = loader.resident_split(f, cfg, 2, load_plan.resolve("ds4-cpu", "cpu", "host"))
        assert again == by_resident  # deterministic
    finally:
        f.close()


def test_load_builds_the_resident_split(skewed_model, monkeypatch):
    """``load(..., distributed="pipeline")`` builds the rank's share of ``resident_split``: its
    layers, and its rows of the head, read from the mapping as a matrix of those rows alone (the
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

    def fake_model(model, *, group, layers, head_rows):
        out = model.output
        built.append((group.rank(), layers, [b.il for b in model.blocks], head_rows,
                      None if out is None else out.shape, model.output_hc is not None))
        return type("M", (), {})()

    monkeypatch.setattr(loader.pipeline, "PipelineModel", fake_model)
    for rank in (0, 1):
        monkeypatch.setattr(dist, "join", lambda timeout, mode, checks=(), rank=rank: Group(rank))
        monkeypatch.setattr(dist, "rank0s", lambda group, values: list(values))  # each computes the same here
        loader.load(skewed_model, numerics="ds4-cpu", backend="cpu", experts="host", distributed="pipeline")
    n_embd = 256
    assert built == [(0, range(0, 1), [0], range(0, 7264), (7264, n_embd), False),
                     (1, range(1, 4), [1, 2, 3], range(7264, 8000), (8000 - 7264, n_embd), True)]


def test_tensors_the_model_does_not_take_weigh_nothing(tiny_model_path):
    """A file with extra tensors (odd names, shapes or types) splits like the file without them:
    one process ignores them, so a pipeline must not fail on them or count them."""
    from ds4_mlx.formats.layout import load_model_file as open_model

    class Info:
        def __init__(self, shape, ggml_type, nbytes):
            self.shape, self.ggml_type, self.nbytes = shape, ggml_type, nbytes

    f, cfg, _ = open_model(tiny_model_path)
    try:
        expected = loader.resident_split(f, cfg, 2, load_plan.resolve())
        real_tensor, real_array, extra = f.tensor, f.tensor_array, {
            "blk.x.attn_q_a.weight": (Info((512, 64), GGMLType.F32, 1 << 30), np.zeros((64, 512), np.float32)),
            "blk.99.attn_q_a.weight": (Info((512, 64), GGMLType.F32, 1 << 30), np.zeros((64, 512), np.float32)),
            "blk.0.odd.weight": (Info((7,), GGMLType.F32, 1 << 30), np.zeros(7, np.float32)),
            "blk.1.odd_exps.weight": (Info((8, 8), GGMLType.F16, 1 << 30), np.zeros((8, 8), np.float16)),
        }
        f.tensors = {**f.tensors, **{n: v[0] for n, v in extra.items()}}
        f.tensor = lambda n: extra[n][0] if n in extra else real_tensor(n)
        f.tensor_array = lambda n: extra[n][1] if n in extra else real_array(n)
        assert loader.resident_split(f, cfg, 2, load_plan.resolve()) == expected
        w = loader._Weights(f, load_plan.resolve("default", "cpu", "host"))
        assert [w.resident_nbytes(n, "default") for n in extra][2:] == [0, 0]  # not a dense / expert tensor
    finally:
        f.close()
