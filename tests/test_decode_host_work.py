"""Host work per decoded token (issue #13, point 7): what a steady compiled decode step creates
from host data, and that the leaner host paths compute the same bits as the ones they replace."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import ds4_mlx
from ds4_mlx.model import experts as ex
from ds4_mlx.model import metal_kernels
from ds4_mlx.model.host_step import HostStepDecoder
from ds4_mlx.synth import q2_k_random_blocks
from ds4_mlx.engine.session import Session

from host_traffic import HostTraffic  # benchmarks/, on the path by conftest


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return ds4_mlx.load(tiny_model_path, numerics="default").network


def test_steady_decode_step_builds_no_rope_or_expert_index_arrays(model):
    """RoPE rows are slices of per-block tables (not two host arrays per layer and step), and the
    host expert path multiplies a decode step's pairs in pair order (no gather index from the host).
    Before: 20 RoPE arrays and ~17 gather indices per token on the tiny model."""
    s = Session(model, 600, compile=True)
    s.append(list(range(1, 40)))
    for t in (5, 6, 7):  # enter decode; traces; the RoPE block of these positions
        s.eval(t)
    steps = 6
    with HostTraffic() as traffic:
        for t in range(steps):
            s.eval(100 + t)
            s.logits()
    per_token = {k: v / steps for k, v in traffic.by_site.items()}
    # the position scalar, and per host-routed layer the two mixers' combine matrices (computed on
    # the host, ``host_step.HostMixer``); no RoPE rows, no index arrays
    assert isinstance(model.decoder(), HostStepDecoder)  # the CPU's host strategy: every layer host-routed
    mixers = 2 * len(model.blocks)
    made = per_token.get(("compiled_decode.py", "mx.array"), 0) + per_token.get(("host_step.py", "mx.array"), 0)
    assert made <= 1 + mixers, per_token
    assert per_token.get(("metal_kernels.py", "mx.array"), 0) == 0, per_token
    # (experts.py copies slabs into MLX on expert-cache misses only: host data that must come in)


def test_rope_rows_are_reused_within_a_block(model):
    dec = model.decoder()
    attn = model.blocks[2].attn
    rows = dec._block_rows[2]  # the RoPE rows of block 2
    a = rows.at(300)
    assert rows.at(300)[0] is a[0] and rows.at(300)[1] is a[1]
    c, s_ = model.ops.rope_tables(attn.rope, np.arange(300, 301))
    assert np.array_equal(np.array(a[0]), np.array(c)) and np.array_equal(np.array(a[1]), np.array(s_))
    b = rows.at(256 + 255)
    c, s_ = model.ops.rope_tables(attn.rope, np.arange(511, 512))
    assert np.array_equal(np.array(b[0]), np.array(c)) and np.array_equal(np.array(b[1]), np.array(s_))
    nxt = rows.at(512)  # the next block
    c, _ = model.ops.rope_tables(attn.rope, np.arange(512, 513))
    assert np.array_equal(np.array(nxt[0]), np.array(c))


@pytest.mark.parametrize("kx", [1, 4])
def test_pair_order_expert_path_is_bit_identical(kx):
    """One token's k distinct experts: the pair-order products equal expert_matmul_dense's grouped
    products followed by the un-grouping gather, bit for bit."""
    rng = np.random.default_rng(9 + kx)
    n_exp, out_dim, n_in, k = 10, 64, 256, 4
    raw = q2_k_random_blocks(rng, n_exp * out_dim, 0.05).reshape(n_exp, out_dim, -1)
    w = ex.ExpertWeights("t.ffn_gate_exps.weight", ex.GGMLType.Q2_K, raw, n_in, backend="cpu", use_kernels=False,
                          native=False)  # the MLX path's grouping (native: tests/test_native_experts.py)
    w.cache = ex.ExpertCache(1 << 24)
    for trial in range(6):
        ids = rng.choice(n_exp, (1, k), replace=False)  # unsorted: grouping permutes the pairs
        x = mx.array(rng.standard_normal((1, kx, n_in)).astype(np.float32))
        got = np.array(w(x, ids))
        uniq, slot = np.unique(ids.reshape(-1), return_inverse=True)
        rows = np.arange(k) if kx == k else np.zeros(k, np.int64)
        want = np.array(metal_kernels.expert_matmul_dense(w.dense_experts(uniq), x.reshape(kx, n_in),
                                                          slot.reshape(-1), rows)).reshape(1, k, out_dim)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), trial
