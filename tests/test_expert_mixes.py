"""Whole models with the routed-expert mixes of the published 0731 files (issue #22), generated at the
small model's dims (4 layers, the last score-routed): ``q2-q4`` (ds4f-q2-q4's shape: Q4_K in the last
layer, IQ2_XXS/Q2_K before), ``mxfp4`` (ds4f-mxfp4: MXFP4 everywhere) and ``q4``.

For each: ``inspect`` reports the mix; each layer's expert tensors carry that layer's type in both
strategies; ds4-cpu is one function whatever the path (one-shot, chunked and prefill-then-decode
prefill, device and host strategies, the native products and their MLX twins: all bit-identical);
default numerics generates and stays within the default-numerics band of ds4-cpu and of itself
chunked; and a two-rank pipeline of the q2-q4 mix (its Q4_K layer on the last rank) is ds4-cpu's
bits of one process."""

from __future__ import annotations

import json

import ds4_mlx
import numpy as np
import pytest

from ds4_mlx.model import load_plan
from ds4_mlx import native, synth
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.layout import load_model_file
from ds4_mlx.frontends import cli
from ds4_mlx.model import loader
from ds4_mlx.synth import DS4_REQUIRED_TOKENS
from ds4_mlx.tokenizer.byte_map import BYTE_TO_UNICODE
from ds4_mlx.engine.session import Session
from test_distributed import CLI, LAUNCH, PROMPT, _generate_args, _run

MIXES = ["q2-q4", "mxfp4", "q4"]
Q2 = ("IQ2_XXS", "IQ2_XXS", "Q2_K")
LAYER_TYPES = {"q2-q4": [Q2, Q2, Q2, ("Q4_K",) * 3], "mxfp4": [("MXFP4",) * 3] * 4, "q4": [("Q4_K",) * 3] * 4}
INSPECT_LINE = {
    "q2-q4": "routed experts: IQ2_XXS/Q2_K layers 0-2, Q4_K layer 3 (KV-cache quant bits 2, from layer 0 as ds4)",
    "mxfp4": "routed experts: MXFP4 layers 0-3 (KV-cache quant bits 2, from layer 0 as ds4)",
    "q4": "routed experts: 4-bit (gate/up Q4_K, down Q4_K)",
}
TOKENS = [int(t) for t in np.random.default_rng(22).integers(7, 512, size=40)]  # past the window (8) and ratio 4
# default numerics against itself on another path: test_model_invariants' band (rms 0.05, max 0.25)
DEFAULT_RMS, DEFAULT_MAX = 0.05, 0.25
# default against ds4-cpu: measured rms 0.022 (q2-q4), 0.047 (q4), 0.105 (mxfp4), max 0.37, at these
# random weights; the difference is not the experts' (ds4-cpu with the default expert products: rms
# 0.014 on mxfp4), and a wrong decode of a layer's experts is O(1). Bound: ~2.5x the worst measured.
VS_DS4_RMS, VS_DS4_MAX = 0.25, 1.0


def _byte_tokenizer(path) -> str:
    """A 512-id byte-level BPE tokenizer.json: ds4's special tokens, the 256 byte symbols and merges of
    byte pairs (the engine needs every byte; the real vocabulary would make each model 100 MB)."""
    added = [{"id": i, "content": t, "special": True} for i, t in enumerate(DS4_REQUIRED_TOKENS)]
    vocab = {ch: len(added) + i for i, ch in enumerate(BYTE_TO_UNICODE)}
    merges = []
    for a in "etaoinsrhl":
        for b in "etaoinsrhl Ġ":
            b = BYTE_TO_UNICODE[ord(" ")] if b == " " else b
            if len(vocab) + len(added) < 512 and a + b not in vocab:
                vocab[a + b] = len(vocab) + len(added)
                merges.append(f"{a} {b}")
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": merges},
                                "added_tokens": added}, ensure_ascii=False), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixes")
    tok = _byte_tokenizer(d / "tokenizer.json")
    out = {}
    for experts in MIXES:
        cfg = synth.preset_config("tiny", n_vocab=512, n_layer=4, n_embd=256, n_head=2, head_dim=192,
                                  n_out_group=1, q_lora=64, o_lora=32, n_expert=4, n_expert_used=2, n_ff_exp=256,
                                  n_indexer_head=2, indexer_top_k=4, swa=8, experts=experts,
                                  tokenizer_json=str(tok), name=f"mix-{experts}")
        out[experts] = d / f"{experts}.gguf"
        synth.write_tiny_model(cfg, out[experts], compute_sha256=False)
    return out


def _logits_and_state(engine, how: str):
    s = Session(engine.network, 256, **({"chunk": 7} if how == "chunk7" else {}))
    if how == "decode":
        s.append(TOKENS[:30])
        for t in TOKENS[30:]:
            s.eval(t)
    else:
        s.append(TOKENS)
    return s.logits(), s.state.to_numpy()


@pytest.mark.parametrize("experts", MIXES)
def test_inspect_reports_the_mix(models, experts, capsys):
    assert cli.main(["inspect", str(models[experts]), "--no-tensors"]) == 0
    out = capsys.readouterr().out
    assert "layout: OK" in out and INSPECT_LINE[experts] in out.splitlines()
    assert cli.main(["inspect", str(models[experts]), "--json"]) == 0
    lay = json.loads(capsys.readouterr().out)["layout"]
    assert [tuple(t) for t in lay["routed_by_layer"]] == [(g, d) for g, _, d in LAYER_TYPES[experts]]


@pytest.mark.parametrize("experts", MIXES)
def test_ds4_cpu_is_one_function_on_every_path(models, experts, monkeypatch):
    """One-shot prefill on the host strategy is the reference; chunked and decoded prefill, the device
    strategy and (for the routed-expert products) the MLX twins instead of the native code give its
    logits and its whole state bit for bit."""
    host = ds4_mlx.load(models[experts], numerics="ds4-cpu", experts="host")
    device = ds4_mlx.load(models[experts], numerics="ds4-cpu", experts="device")
    for engine in (host, device):
        for il, block in enumerate(engine.network.blocks):
            ffn = block.ffn
            got = tuple(e.qtype.name for e in (ffn.gate_exps, ffn.up_exps, ffn.down_exps))
            assert got == LAYER_TYPES[experts][il], (engine.experts, il)
    ref_logits, ref_state = _logits_and_state(host, "one-shot")
    runs = [(host, "chunk7"), (host, "decode"), (device, "one-shot"), (device, "decode")]
    if native.available():
        monkeypatch.setattr(native, "library", lambda: None)  # as DS4_MLX_NATIVE=off
        runs.append((ds4_mlx.load(models[experts], numerics="ds4-cpu", experts="host"), "one-shot"))
    for engine, how in runs:
        logits, state = _logits_and_state(engine, how)
        assert np.array_equal(logits.view(np.uint32), ref_logits.view(np.uint32)), (engine.experts, how)
        assert state.keys() == ref_state.keys()
        for k in state:
            np.testing.assert_array_equal(state[k], ref_state[k], err_msg=f"{engine.experts} {how} {k}")
    assert np.isfinite(ref_logits).all() and ref_logits.std() > 0.1  # a working model, not zeros


def _close(got, ref, what, band=(DEFAULT_RMS, DEFAULT_MAX)):
    d = got.astype(np.float64) - ref
    rms, worst = float(np.sqrt(np.mean(d * d))), float(np.abs(d).max())
    assert rms <= band[0] and worst <= band[1], f"{what}: rms {rms:.4g} max {worst:.4g}"


@pytest.mark.parametrize("experts", MIXES)
def test_default_numerics_generates_within_the_band(models, experts):
    ds4 = ds4_mlx.load(models[experts], numerics="ds4-cpu", experts="host")
    host = ds4_mlx.load(models[experts], numerics="default", experts="host")
    device = ds4_mlx.load(models[experts], numerics="default", experts="device")
    ref, _ = _logits_and_state(ds4, "one-shot")
    one, _ = _logits_and_state(host, "one-shot")
    _close(one, ref, "default vs ds4-cpu", (VS_DS4_RMS, VS_DS4_MAX))
    _close(_logits_and_state(host, "chunk7")[0], one, "chunk 7")
    _close(_logits_and_state(host, "decode")[0], one, "prefill + decode")
    _close(_logits_and_state(device, "decode")[0], one, "device strategy")
    for engine in (host, ds4):
        r = ds4_mlx.generate(engine, "Hello", max_tokens=4, temperature=0, ctx=256)
        assert len(r.tokens) == 4 or r.finish_reason == "stop", (engine.numerics, r.finish_reason)


def test_resident_split_weighs_each_layer_by_its_own_type(models):
    """The device strategy holds each routed tensor's raw blocks: the Q4_K layer of the q2-q4 mix weighs
    its Q4_K bytes (1.7x a q2 layer's), and the split's estimate is those bytes."""
    f, cfg, _ = load_model_file(models["q2-q4"])
    try:
        w = loader._Weights(f, load_plan.resolve("default", "cpu", "device"))
        per_layer = [sum(w.resident_nbytes(f"blk.{il}.ffn_{k}_exps.weight", "ds4-cpu") for k in ("gate", "up", "down"))
                     for il in range(cfg.n_layer)]
        assert per_layer == [sum(f.tensor(f"blk.{il}.ffn_{k}_exps.weight").nbytes for k in ("gate", "up", "down"))
                             for il in range(cfg.n_layer)]
        assert per_layer[0] == per_layer[1] == per_layer[2] and per_layer[3] > 1.5 * per_layer[0]
        assert f.tensor("blk.3.ffn_down_exps.weight").ggml_type == GGMLType.Q4_K
    finally:
        f.close()


def test_pipeline_of_the_q2_q4_mix_is_one_process(models, tmp_path):
    """Two ranks on loopback (the Q4_K layer and the head's rows on the last), ds4-cpu: the same greedy
    tokens and logprobs, byte for byte, as one process."""
    prompt = tmp_path / "P"
    prompt.write_text(PROMPT)
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    r1 = _run(CLI + _generate_args(models["q2-q4"], prompt, one, "ds4-cpu"))
    assert r1.returncode == 0, r1.stderr
    r2 = _run(LAUNCH + ["-n", "2", "--backend", "ring", "--"] + CLI
              + _generate_args(models["q2-q4"], prompt, two, "ds4-cpu") + ["--distributed", "pipeline"])
    assert two.exists() and "Traceback" not in r2.stderr, r2.stdout + r2.stderr
    assert one.read_bytes() == two.read_bytes()
