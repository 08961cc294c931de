"""Non-finite numbers in the weights: the forward pass names the first stage that went NaN/Inf
instead of letting generation sample from garbage (issue #8, 6f)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from ds4_mlx.errors import NonFiniteError
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.model.loader import load as load_network
from ds4_mlx.model.cache import ModelCache


def _poison(src, dst, tensor: str, value: float) -> None:
    """Copy the model and overwrite every element of one F32 or F16 tensor with ``value``."""
    shutil.copyfile(src, dst)
    with GGUFFile(src) as f:
        t = f.tensor(tensor)
        offset, count, dtype = t.offset, t.n_elements, f.tensor_array(tensor).dtype
    assert dtype in (np.float32, np.float16), dtype
    with open(dst, "r+b") as fh:
        fh.seek(offset)
        fh.write(np.full(count, value, dtype=dtype).tobytes())


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_layer_is_named_and_state_untouched(small_model_path, tmp_path, value):
    bad = tmp_path / "bad.gguf"
    _poison(small_model_path, bad, "blk.1.attn_norm.weight", value)
    net = load_network(bad)
    state = ModelCache.empty(net.config)
    with pytest.raises(NonFiniteError, match=r"layer 1 produced non-finite values .* at positions 0\.\.4 "
                                             r"\(non-finite weights in .*bad\.gguf\?\)"):
        net.forward_chunk(np.arange(1, 6), state)
    assert state.n_tokens == 0  # the caller's state is left as it was


def test_nonfinite_embedding_is_named_before_any_layer(small_model_path, tmp_path):
    # the embedding's flag is evaluated together with layer 0's: the embedding must still be named
    bad = tmp_path / "bad_embd.gguf"
    _poison(small_model_path, bad, "token_embd.weight", np.inf)
    net = load_network(bad)
    with pytest.raises(NonFiniteError, match="the token embedding produced non-finite values"):
        net.forward_chunk(np.arange(1, 4), ModelCache.empty(net.config))


def test_nonfinite_output_head_is_named(small_model_path, tmp_path):
    bad = tmp_path / "bad_head.gguf"
    _poison(small_model_path, bad, "output_norm.weight", np.nan)
    net = load_network(bad)
    with pytest.raises(NonFiniteError, match="the output head produced non-finite values"):
        net.forward_chunk(np.arange(1, 4), ModelCache.empty(net.config))


def test_finite_model_passes(small_model_path):
    net = load_network(small_model_path)
    logits, state = net.forward_chunk(np.arange(1, 4), ModelCache.empty(net.config))
    assert state.n_tokens == 3 and np.isfinite(np.array(logits)).all()
