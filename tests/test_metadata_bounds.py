"""Every integer ``deepseek4.*`` key is range-checked, and the products that size buffers are bounded,
before anything is sized from them: an out-of-range value is one LayoutError naming the key, the value
and the allowed range, never a segfault or an out-of-memory kill later (issue #8, 6c).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ds4_mlx.errors import LayoutError
from ds4_mlx.formats.config import INT_RANGES, PRODUCT_LIMITS, ModelConfig
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.formats.layout import load_model_file
from small_model import kv_value_pos, patch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data(small_model_path) -> bytes:
    return small_model_path.read_bytes()


@pytest.fixture(scope="module")
def metadata(small_model_path) -> dict:
    with GGUFFile(small_model_path) as f:
        return {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in f.metadata.items()
                if k.startswith("deepseek4.")}


def _bad_values(key: str) -> list[int]:
    lo, hi = INT_RANGES[key]
    out = [hi + 1, 0xFFFFFFFF]
    if lo > 0:
        out.append(0)
    return out


@pytest.mark.parametrize("key", sorted(INT_RANGES))
def test_every_bounded_key_out_of_range_is_one_clear_error(tmp_path, data, key):
    full = "deepseek4." + key
    lo, hi = INT_RANGES[key]
    p = tmp_path / "bad.gguf"
    for value in _bad_values(key):
        p.write_bytes(patch(data, kv_value_pos(data, full), "<I", value))  # every key is a u32 in the file
        with pytest.raises(LayoutError) as e:
            f, _, _ = load_model_file(p)
            f.close()
        msg = str(e.value)
        assert str(p) in msg and f"'{full}' is {value}, outside the allowed range {lo}..{hi}" in msg, msg
        assert "\n" not in msg


@pytest.mark.parametrize("key", ["attention.sliding_window", "hyper_connection.sinkhorn_iterations",
                                 "context_length", "attention.indexer.top_k"])
def test_negative_values_are_refused_by_name(metadata, key):
    md = dict(metadata)
    md["deepseek4." + key] = -1
    with pytest.raises(LayoutError, match=rf"'deepseek4\.{key}' must be a non-negative integer, found -1"):
        ModelConfig.from_metadata(md, "X")


def test_ranges_admit_the_real_model():
    from ds4_mlx.formats.config import _ATTR_OF_KEY, REAL_FLASH, REAL_OTHER

    for key, (lo, hi) in INT_RANGES.items():
        real = REAL_FLASH[_ATTR_OF_KEY[key]] if key in _ATTR_OF_KEY else REAL_OTHER[key]
        assert lo <= real <= hi, key


def _scaled(metadata, **changes):
    md = dict(metadata)
    n_layer = changes.pop("block_count", md["deepseek4.block_count"])
    md["deepseek4.block_count"] = n_layer
    md["deepseek4.attention.compress_ratios"] = [0, 0] + [4, 128] * ((n_layer - 1) // 2) + [4] * ((n_layer - 2) % 2)
    md["deepseek4.attention.compress_ratios"] = md["deepseek4.attention.compress_ratios"][:n_layer]
    md["deepseek4.swiglu_clamp_exp"] = [10.0] * n_layer
    for k, v in changes.items():
        md["deepseek4." + k.replace("__", ".")] = v
    return md


def test_products_that_size_buffers_are_bounded(metadata):
    # each value in range, the product not: the message names the product and its factors
    md = _scaled(metadata, block_count=1024, attention__sliding_window=16384, attention__key_length=8192,
                 attention__value_length=8192)
    with pytest.raises(LayoutError, match=r"sliding-window KV rows of all layers would need n_layer 1024 x "
                                          r"n_swa 16384 x head_dim 8192 = .* more than the sanity limit"):
        ModelConfig.from_metadata(md, "X")
    md = _scaled(metadata, block_count=1000, context_length=1 << 24, attention__key_length=8192,
                 attention__value_length=8192)
    with pytest.raises(LayoutError, match=r"KV cache at the full context would need context_length 16777216"):
        ModelConfig.from_metadata(md, "X")
    md = _scaled(metadata, attention__head_count=1024, attention__key_length=8192, attention__value_length=8192,
                 attention__indexer__top_k=65536)
    with pytest.raises(LayoutError, match=r"per-query attention keys x heads x key_length would need n_head 1024"):
        ModelConfig.from_metadata(md, "X")
    assert len(PRODUCT_LIMITS) == 3


def test_huge_sliding_window_does_not_crash_a_session(tmp_path, data):
    """The value that used to reach mx.zeros and segfault (exit 139): in a subprocess, a load, a prefill
    and a decode step end in one error line and exit status 2."""
    p = tmp_path / "swa.gguf"
    p.write_bytes(patch(data, kv_value_pos(data, "deepseek4.attention.sliding_window"), "<I", 2**31 - 1))
    script = textwrap.dedent(f"""
        import sys
        from ds4_mlx.errors import Ds4Error
        from ds4_mlx.engine.session import Session
        from ds4_mlx.model.loader import load
        try:
            model = load({str(p)!r})
            s = Session(model, 64)
            s.append([1, 2, 3])
            s.eval(4)  # the decode step sizes its window ring from n_swa
        except Ds4Error as exc:
            print(f"error: {{exc}}", file=sys.stderr)
            sys.exit(2)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "deepseek4.attention.sliding_window' is 2147483647, outside the allowed range" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
