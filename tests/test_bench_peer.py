"""benchmarks/bench_peer.py without the peer: its GGUF -> mlx-lm PR #1192 weight mapping, on the tiny model and
on the real model's tensor schedule, and its one-line refusal when no peer checkout is given.

The mapping's numerical correctness needs the peer itself (the script's aligned logit check: agreement to
float32 rounding); what is checked here is that no tensor is lost, duplicated or given a wrong size.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds4_mlx.formats.config import REAL_FLASH, ds4_compress_ratio
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.formats.layout import expected_tensors, load_model_file

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_peer.py"


@pytest.fixture(scope="module")
def bench_peer():
    spec = importlib.util.spec_from_file_location("bench_peer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while being defined
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    gguf, cfg, _ = load_model_file(tiny_model_path)
    yield gguf, cfg
    gguf.close()


def check_mapping(mapping, unused, tensors: dict[str, tuple[tuple[int, ...], int]], cfg):
    """Every tensor placed exactly once, distinct targets, the element count kept, the GGUF's row-major
    shape kept but for the one documented reshape (wo_a into (groups, o_lora_rank, in))."""
    assert set(mapping) | set(unused) == set(tensors)
    assert not set(mapping) & set(unused)
    targets = [t.name for t in mapping.values()]
    assert len(targets) == len(set(targets))
    for name, dst in mapping.items():
        shape, n = tensors[name]
        assert math.prod(dst.shape) == n, name
        if name.endswith("attn_output_a.weight"):
            assert dst.shape == (cfg.n_out_group, cfg.o_lora_rank, shape[-1]), name
        else:
            assert dst.shape == shape, name
        assert dst.int32 == name.endswith("tid2eid.weight"), name
    # the hash tables and the router bias go where the peer's gate reads them
    for il in range(cfg.n_layer):
        gate = f"model.layers.{il}.ffn.gate."
        names = {t.name for t in mapping.values() if t.name.startswith(gate)}
        if cfg.is_hash_layer(il):
            assert gate + "tid2eid" in names and gate + "e_score_correction_bias" not in names
        else:
            assert gate + "tid2eid" not in names


def test_tiny_model_every_tensor_mapped_once(bench_peer, tiny):
    gguf, cfg = tiny
    mapping, unused = bench_peer.peer_weight_map(cfg, gguf.tensors)
    check_mapping(mapping, unused, {n: (t.shape, t.n_elements) for n, t in gguf.tensors.items()}, cfg)
    assert len(mapping) == len(gguf.tensors)  # the tiny model has no bias on its hash layers


def test_real_model_schedule_every_tensor_mapped_once(bench_peer, tiny):
    """The 43-layer schedule (hash layers 0-2, ratios 4/128 alternating), every optional tensor present:
    the router bias of a hash layer is the only one no side reads."""
    _, tiny_cfg = tiny
    cfg = dataclasses.replace(
        tiny_cfg, **{k: v for k, v in REAL_FLASH.items() if k in {f.name for f in dataclasses.fields(tiny_cfg)}},
        compress_ratios=tuple(ds4_compress_ratio(i) for i in range(REAL_FLASH["n_layer"])),
        swiglu_clamp=(tiny_cfg.swiglu_clamp[0],) * REAL_FLASH["n_layer"])
    tensors = {t.name: (t.shape, math.prod(t.ne)) for t in expected_tensors(cfg)}
    mapping, unused = bench_peer.peer_weight_map(cfg, tensors)
    check_mapping(mapping, unused, tensors, cfg)
    assert unused == sorted(f"blk.{il}.exp_probs_b.bias" for il in range(cfg.n_hash_layer))


@pytest.mark.parametrize("extra", ["blk.0.attn_q_c.weight", "mtp.0.e_proj.weight", "blk.99.attn_norm.weight", ""])
def test_unknown_tensor_is_refused(bench_peer, tiny, extra):
    gguf, cfg = tiny
    with pytest.raises(ValueError, match="no place in the peer's model"):
        bench_peer.peer_weight_map(cfg, [*gguf.tensors, extra])


def test_peer_args_follow_the_gguf(bench_peer, tiny):
    _, cfg = tiny
    a = bench_peer.peer_args(cfg)
    assert a["compress_ratios"] == list(cfg.compress_ratios)
    assert (a["num_hidden_layers"], a["hidden_size"], a["head_dim"]) == (cfg.n_layer, cfg.n_embd, cfg.head_dim)
    assert (a["sliding_window"], a["index_topk"], a["num_hash_layers"]) == (cfg.n_swa, cfg.indexer_top_k,
                                                                             cfg.n_hash_layer)


def run_script(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "DS4_MLX_PEER"}
    env["PYTHONPATH"] = str(REPO)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("peer_args", [[], ["--peer", "/nonexistent/mlx-lm"], ["--peer", str(REPO)]])
def test_without_a_peer_it_says_how_to_get_one(tiny_model_path, peer_args):
    r = run_script("--model", str(tiny_model_path), *peer_args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "pull/1192/head" in lines[0] and "git clone https://github.com/ml-explore/mlx-lm" in lines[0]


@pytest.mark.parametrize("bad, what", [(["--rounds", "0"], "--rounds must be >= 1"),
                                        (["--decode", "-3"], "--decode must be >= 1"),
                                        (["--check-decode", "-1"], "must be >= 0")])
def test_bad_counts_get_one_line(tiny_model_path, bad, what):
    r = run_script("--model", str(tiny_model_path), "--peer", "/nonexistent", *bad)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_peer: ") and what in lines[0], r.stderr


def test_the_default_prompt_is_the_novels_first_993_tokens(tiny_model_path, bench_peer):
    """The issue's figure is on a 993-token prompt: the default text holds that many with BOS, and the
    prefix the script encodes gives exactly the whole text's first tokens."""
    from ds4_mlx.tokenizer import Tokenizer

    with GGUFFile(tiny_model_path) as g:
        tok = Tokenizer.from_gguf(g)
    text = bench_peer.read_prompt(bench_peer.DEFAULT_PROMPT)
    whole = [0] + tok.encode(text)
    for n in (24, 993, 5000):
        assert bench_peer.prompt_ids(tok, 0, text, n) == whole[:n]
    assert bench_peer.prompt_ids(tok, 0, text[:2000], 993) is None  # too short: refused, not truncated
