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


@pytest.mark.parametrize("tensor,value,part", [
    # the embedding's flag is evaluated together with layer 0's: the embedding must still be named
    ("token_embd.weight", np.inf, "the token embedding"),
    ("output_norm.weight", np.nan, "the output head"),
])
def test_nonfinite_embedding_and_head_are_named(small_model_path, tmp_path, tensor, value, part):
    bad = tmp_path / "bad.gguf"
    _poison(small_model_path, bad, tensor, value)
    net = load_network(bad)
    with pytest.raises(NonFiniteError, match=f"{part} produced non-finite values"):
        net.forward_chunk(np.arange(1, 4), ModelCache.empty(net.config))


def test_finite_model_passes(small_model_path):
    net = load_network(small_model_path)
    logits, state = net.forward_chunk(np.arange(1, 4), ModelCache.empty(net.config))
    assert state.n_tokens == 3 and np.isfinite(np.array(logits)).all()
