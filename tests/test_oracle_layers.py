"""Per-layer fidelity against ds4's own hyper-connection states (oracle ``<case>.layers.npz``).

Each layer is fed ds4's ``layer_in[i]`` (all prompt tokens, cold state, position 0) and its
``after_attn[i]`` and output are compared with the dumps (rel-rms = rms(diff) / rms(ds4)).

ds4-cpu numerics: the README's bands (after attention <= 1e-3, layer output <= 3e-3 on short
prompts, <= 5e-3 on dev_long). Where the oracle was produced — glibc on x86_64, whose expf this
mode emulates bit for bit and whose sinf/cosf/log1pf it calls — the port reproduces every dumped
value exactly (measured: all layers, all tokens of all three cases), so there the comparison is
exact equality.

default numerics (float activations, no Q8 activation rounding): measured after-attention rel-rms
3.8e-3 .. 2.1e-2 and layer-output 5.9e-3 .. 3.9e-2 (the larger values on ratio-4 layers, where a
changed indexer or expert choice moves a whole token); bound 6e-2. A wrong function is O(1).
"""

from __future__ import annotations

import platform

import ds4_mlx
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.model.state import ModelState

CASES = {"raw_short": range(6), "chat_nothink": range(6), "dev_long": (2, 3)}
PARAMS = [(c, i) for c, layers in CASES.items() for i in layers]
EXACT_PLATFORM = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") \
    and platform.libc_ver()[0] == "glibc"
DEFAULT_BAND = 6e-2

_dumps: dict[str, dict[str, np.ndarray]] = {}


def _dump(oracle_dir, case: str) -> dict[str, np.ndarray]:
    if case not in _dumps:
        z = np.load(oracle_dir / "golden" / f"{case}.layers.npz")
        d = {k: z[k] for k in z.files}
        if "layer_in" in d:  # stacked form -> per-layer keys
            for i in range(d["layer_in"].shape[0]):
                d[f"layer_in_{i}"] = d["layer_in"][i]
            for i in range(d["after_attn"].shape[0]):
                d[f"after_attn_{i}"] = d["after_attn"][i]
        _dumps[case] = d
    return _dumps[case]


@pytest.fixture(scope="module")
def models(tiny_model_path):
    return {mode: ds4_mlx.load(tiny_model_path, numerics=mode).network for mode in ("ds4-cpu", "default")}


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - ref) ** 2)) / np.sqrt(np.mean(ref ** 2)))


def _run_layer(model, d: dict[str, np.ndarray], il: int) -> tuple[np.ndarray, np.ndarray]:
    block = model.blocks[il]
    state = ModelState.empty(model.config).layers[il]
    with model.ops.stream():
        after, _ = block.attention_part(mx.array(d[f"layer_in_{il}"]), 0, state)
        out = block.ffn_part(after, d["prompt_tokens"].astype(np.int64))
    return np.array(after), np.array(out)


@pytest.mark.parametrize("case,il", PARAMS)
def test_layer_ds4_cpu(models, oracle_dir, case, il):
    d = _dump(oracle_dir, case)
    after, out = _run_layer(models["ds4-cpu"], d, il)
    ref_after, ref_out = d[f"after_attn_{il}"], d[f"layer_in_{il + 1}"]
    assert after.shape == ref_after.shape == out.shape
    r_after, r_out = _rel(after, ref_after), _rel(out, ref_out)
    assert r_after <= 1e-3, f"{case} layer {il}: after-attention rel-rms {r_after:.3g}"
    assert r_out <= (5e-3 if case == "dev_long" else 3e-3), f"{case} layer {il}: output rel-rms {r_out:.3g}"
    if EXACT_PLATFORM:
        np.testing.assert_array_equal(after, ref_after, err_msg=f"{case} layer {il} after attention")
        np.testing.assert_array_equal(out, ref_out, err_msg=f"{case} layer {il} output")


@pytest.mark.parametrize("case,il", PARAMS)
def test_layer_default(models, oracle_dir, case, il):
    d = _dump(oracle_dir, case)
    after, out = _run_layer(models["default"], d, il)
    r_after, r_out = _rel(after, d[f"after_attn_{il}"]), _rel(out, d[f"layer_in_{il + 1}"])
    assert r_after <= DEFAULT_BAND and r_out <= DEFAULT_BAND, \
        f"{case} layer {il}: rel-rms after attention {r_after:.3g}, output {r_out:.3g}"
