"""The streaming tiny-model generator: same layout as the oracle generator, sane content, bounded memory."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from ds4_mlx.errors import LayoutError, TokenizerError
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.formats.quants import dequantize, q4_k_scale_min
from ds4_mlx import synth as tm
from oracle_golden import GENERATOR_CASES, ORACLE_SHA256, generator_sha256

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "make_tiny_model.py"

# Small dims that still exercise every layer kind (ratios 0, 0, 4, 128, 4), option flags included.
SMALL = dict(n_layer=5, n_embd=256, n_vocab=1000, n_head=4, head_dim=192, n_rot=64, n_out_group=2, q_lora=64,
             o_lora=32, n_expert=8, n_expert_used=2, n_ff_exp=256, n_hash_layer=2, swa=16, n_indexer_head=2,
             indexer_head_dim=128, indexer_top_k=8, n_hc=4, sinkhorn_iter=20, seed=7, name="small-random",
             exp_probs_b_all_layers=True, tokenizer=False)


def _oracle_args(cfg: dict) -> list[str]:
    args = []
    for key, value in cfg.items():
        if key == "tokenizer":
            if not value:
                args.append("--no-tokenizer")
        elif isinstance(value, bool):
            if value:
                args.append("--" + key.replace("_", "-"))
        else:
            args += ["--" + key.replace("_", "-"), str(value)]
    return args


def test_small_args_are_the_packed_generator_case():
    assert _oracle_args(SMALL) == GENERATOR_CASES["small_layout"]


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """(oracle file, our file) for the SMALL dims. The oracle file is our generator's oracle_bytes mode,
    checked to be byte for byte what the oracle's make_tiny_gguf.py wrote for these dims (its sha256 is
    in tests/data/oracle/generator_sha256.json)."""
    d = tmp_path_factory.mktemp("small")
    oracle = d / "oracle.gguf"
    info = tm.write_tiny_model(tm.preset_config("tiny", **SMALL, oracle_bytes=True), oracle)
    assert info["sha256"] == generator_sha256("small_layout"), "oracle_bytes no longer writes the oracle's bytes"
    ours = d / "ours.gguf"
    tm.write_tiny_model(tm.preset_config("tiny", **SMALL), ours)
    return oracle, ours


@pytest.fixture(scope="module")
def tiny_ours(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    info = tm.write_tiny_model(tm.preset_config("tiny"), path)
    return path, info


def _header(path: Path) -> bytes:
    with GGUFFile(path) as f:
        n = f.data_offset
    with open(path, "rb") as fh:
        return fh.read(n)


def _assert_same_layout_gguf_py(oracle: Path, ours: Path) -> None:
    """gguf-py's reader: metadata (order, types, values) and the tensor table."""
    a, b = gguf.GGUFReader(oracle), gguf.GGUFReader(ours)
    assert list(a.fields) == list(b.fields)
    for key, fa in a.fields.items():
        fb = b.fields[key]
        assert [int(t) for t in fa.types] == [int(t) for t in fb.types], key
        assert fa.contents() == fb.contents(), key
    ta = [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset, t.n_bytes) for t in a.tensors]
    tb = [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset, t.n_bytes) for t in b.tensors]
    assert ta == tb


def _assert_same_layout(oracle: Path, ours: Path) -> None:
    """Our reader, then the raw header bytes."""
    fa, fb = GGUFFile(oracle), GGUFFile(ours)
    assert [(f.key, f.type, f.sub_type, f.value) for f in fa.fields.values()] == \
           [(f.key, f.type, f.sub_type, f.value) for f in fb.fields.values()]
    assert [(t.name, t.ggml_type, t.ne, t.offset, t.nbytes) for t in fa.tensors.values()] == \
           [(t.name, t.ggml_type, t.ne, t.offset, t.nbytes) for t in fb.tensors.values()]
    assert (fa.alignment, fa.data_offset, fa.file_size) == (fb.alignment, fb.data_offset, fb.file_size)
    # hence the whole header, tensor directory and padding included, is the same bytes
    assert _header(oracle) == _header(ours)


def test_tiny_preset_has_the_oracle_models_exact_layout(tiny_model_path, tiny_ours):
    ours, info = tiny_ours
    _assert_same_layout(tiny_model_path, ours)
    meta = GGUFFile(ours).metadata
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "joyai-llm"
    assert len(meta["tokenizer.ggml.tokens"]) == 129280 and meta["tokenizer.ggml.add_bos_token"] is False
    assert info["file_bytes"] == os.path.getsize(ours)
    assert info["sha256"] == hashlib.sha256(Path(ours).read_bytes()).hexdigest()


def test_packed_tiny_digest_is_the_golden_outputs_model():
    """The conftest builds the oracle's tiny model with oracle_bytes (unless DS4_MLX_TINY_MODEL names a
    copy) and checks it against ORACLE_SHA256, the model the oracle's golden outputs were computed on;
    the oracle generator's digest packed in tests/data must be that same model."""
    assert generator_sha256("tiny") == ORACLE_SHA256


def test_oracle_bytes_mode_refuses_q4_experts():
    with pytest.raises(LayoutError, match="oracle_bytes needs experts='q2'"):
        tm.preset_config("tiny", experts="q4", oracle_bytes=True).validate()


@pytest.mark.slow
def test_tiny_preset_layout_seen_by_gguf_py(tiny_model_path, tiny_ours):
    # gguf-py parses the 257k tokenizer strings one by one (~5-10 s per file), hence slow
    _assert_same_layout_gguf_py(tiny_model_path, tiny_ours[0])


def test_small_dims_have_the_oracle_layout(small_pair):
    _assert_same_layout_gguf_py(*small_pair)
    _assert_same_layout(*small_pair)


def test_tokenizer_tables_match_the_tokenizer_json(tiny_ours, tokenizer_json_path):
    """Independent of the oracle: tokens/merges/types straight from tokenizer.json."""
    tj = json.loads(Path(tokenizer_json_path).read_text(encoding="utf-8"))
    meta = GGUFFile(tiny_ours[0]).metadata
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    added_ids = {t["id"] for t in tj["added_tokens"]}
    for text, idx in list(tj["model"]["vocab"].items())[::997]:
        assert tokens[idx] == text
        assert types[idx] == tm.TOKEN_NORMAL or idx in added_ids
    for added in tj["added_tokens"]:
        assert tokens[added["id"]] == added["content"]
        assert types[added["id"]] == (tm.TOKEN_CONTROL if added["special"] else tm.TOKEN_USER_DEFINED)
    merges = tj["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert meta["tokenizer.ggml.merges"] == merges
    assert tokens[meta["tokenizer.ggml.bos_token_id"]] == "<｜begin▁of▁sentence｜>"
    assert tokens[meta["tokenizer.ggml.eos_token_id"]] == "<｜end▁of▁sentence｜>"
    assert meta["tokenizer.ggml.padding_token_id"] == meta["tokenizer.ggml.eos_token_id"]


def _values(f: GGUFFile, name: str) -> np.ndarray:
    t = f.tensors[name]
    return dequantize(f.tensor_data(name), t.ggml_type, t.n_elements).astype(np.float64)


def test_content_matches_the_oracle_conventions(small_pair):
    """F16/F32/I32 tensors equal the oracle's bit for bit; Q8_0 differ only where the oracle's
    round-half-even and ggml's round-half-away disagree on an exact tie; routed experts have the same
    per-tensor RMS and a mean near zero."""
    oracle, ours = (GGUFFile(p) for p in small_pair)
    n_checked = 0
    for name, t in oracle.tensors.items():
        raw_a, raw_b = oracle.tensor_data(name), ours.tensor_data(name)
        if t.ggml_type in (GGMLType.F16, GGMLType.F32, GGMLType.I32):
            assert np.array_equal(raw_a, raw_b), name
        elif t.ggml_type == GGMLType.Q8_0:
            blocks_a, blocks_b = raw_a.reshape(-1, 34), raw_b.reshape(-1, 34)
            assert np.array_equal(blocks_a[:, :2], blocks_b[:, :2]), name  # same scales
            diff = blocks_a[:, 2:].view(np.int8).astype(int) - blocks_b[:, 2:].view(np.int8).astype(int)
            assert np.abs(diff).max() <= 1 and np.count_nonzero(diff) <= max(2, diff.size // 10000), name
        else:
            va, vb = _values(oracle, name), _values(ours, name)
            rms_a, rms_b = np.sqrt(np.mean(va**2)), np.sqrt(np.mean(vb**2))
            assert abs(rms_b / rms_a - 1) < 0.01, name
            assert abs(vb.mean()) < 0.05 * rms_b, name
            assert np.isfinite(vb).all()
        n_checked += 1
    assert n_checked == len(ours.tensors)


@pytest.mark.parametrize("qtype", [GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q4_K])
def test_random_expert_blocks_hit_the_target_rms_per_block(qtype):
    make = {GGMLType.IQ2_XXS: tm.iq2_xxs_random_blocks, GGMLType.Q2_K: tm.q2_k_random_blocks,
            GGMLType.Q4_K: tm.q4_k_random_blocks}[qtype]
    target = 1.0 / np.sqrt(4096)
    raw = make(np.random.default_rng(3), 3000, target)
    assert raw.shape == (3000, BLOCK_GEOMETRY[qtype][1])
    # measured with gguf-py's dequantizer, independent of the generator's own measurement
    vals = gguf_dequantize(raw.reshape(-1), gguf.GGMLQuantizationType(int(qtype))).reshape(3000, 256)
    rms = np.sqrt(np.mean(vals.astype(np.float64) ** 2, axis=1))
    # the only error left is rounding the block scale to f16 (relative 2^-11)
    np.testing.assert_allclose(rms, target, rtol=6e-4)
    np.testing.assert_array_equal(vals, dequantize(raw.reshape(-1), qtype, vals.size).reshape(vals.shape))
    assert abs(vals.mean()) < 0.02 * target
    # roughly symmetric, not a lopsided distribution that happens to have the right RMS
    assert 0.4 < np.mean(vals > 0) < 0.6


def test_random_mxfp4_blocks_have_the_target_rms_within_a_scale_step():
    """Power-of-two scales: each block's RMS is the target within a factor sqrt(2), measured with gguf-py;
    the scale bytes avoid 0 and 255, the codes are all 16, and the values are centred."""
    target = 1.0 / np.sqrt(4096)
    raw = tm.mxfp4_random_blocks(np.random.default_rng(3), 3000, target)
    assert raw.shape == (3000, 17) and 1 <= raw[:, 0].min() and raw[:, 0].max() <= 254
    vals = gguf_dequantize(raw.reshape(-1), gguf.GGMLQuantizationType.MXFP4).reshape(3000, 32).astype(np.float64)
    ratio = np.sqrt(np.mean(vals ** 2, axis=1)) / target
    assert (ratio >= 2 ** -0.5 - 1e-9).all() and (ratio <= 2 ** 0.5 + 1e-9).all()
    assert set(np.unique(np.concatenate([raw[:, 1:] & 15, raw[:, 1:] >> 4]))) == set(range(16))
    assert abs(vals.mean()) < 0.02 * target and 0.4 < np.mean(vals > 0) < 0.6


def test_expert_mixes_follow_the_published_files():
    """q2-q4: Q4_K in the last n_layer // 7 layers (37-42 of 43, ds4f-q2-q4's), at least one; mxfp4:
    MXFP4 gate, up and down everywhere. Only the routed tensors differ from the q2 plan."""
    types = lambda cfg: {s.name: s.ggml_type for s in tm.tensor_plan(cfg)}  # noqa: E731
    full = types(tm.preset_config("medium", n_layer=43, experts="q2-q4"))
    q2 = types(tm.preset_config("medium", n_layer=43))
    for il in range(43):
        want = (GGMLType.Q4_K,) * 3 if il >= 37 else (GGMLType.IQ2_XXS, GGMLType.IQ2_XXS, GGMLType.Q2_K)
        assert tuple(full[f"blk.{il}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down")) == want, il
    assert {n for n in full if full[n] != q2[n]} == {f"blk.{il}.ffn_{k}_exps.weight" for il in range(37, 43)
                                                     for k in ("gate", "up", "down")}
    assert tm.preset_config("tiny", experts="q2-q4").q4_layers() == range(5, 6)
    assert tm.preset_config("tiny", n_layer=2, experts="q2-q4").q4_layers() == range(1, 2)
    mx4 = {s.name: s for s in tm.tensor_plan(tm.preset_config("medium", experts="mxfp4"))}
    assert {s.ggml_type for n, s in mx4.items() if "_exps." in n} == {GGMLType.MXFP4}
    assert mx4["blk.0.ffn_down_exps.weight"].nbytes == 256 * 4096 * (2048 // 32 * 17)


def test_mxfp4_and_mixed_models_are_written_and_validate(tmp_path):
    from ds4_mlx.formats.layout import load_model_file

    cfg = tm.preset_config("tiny", **SMALL)
    for experts, mix in [("mxfp4", "MXFP4 layers 0-4"), ("q2-q4", "IQ2_XXS/Q2_K layers 0-3, Q4_K layer 4")]:
        out = tmp_path / f"{experts}.gguf"
        tm.write_tiny_model(dataclasses.replace(cfg, experts=experts), out, compute_sha256=False)
        f, _, report = load_model_file(out)
        with f:
            assert report.to_dict()["routed_mix"] == mix and report.warnings == []
            for name, t in f.tensors.items():
                if "_exps." in name:
                    rms = np.sqrt(np.mean(_values(f, name) ** 2))
                    assert 0.5 < rms * np.sqrt(t.ne[0]) < 2, name


def test_q4_k_scale_packing_round_trips():
    rng = np.random.default_rng(5)
    sc, mins = rng.integers(0, 64, size=(500, 8)), rng.integers(0, 64, size=(500, 8))
    packed = tm.pack_q4_k_scales(sc, mins)
    s2, m2 = q4_k_scale_min(packed)
    np.testing.assert_array_equal(s2, sc)
    np.testing.assert_array_equal(m2, mins)
    # and through gguf-py: with every quant q = 1 a sub-block decodes to d*sc - dmin*m
    raw = np.zeros((500, 144), dtype=np.uint8)
    raw[:, 0:2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    raw[:, 2:4] = np.frombuffer(np.float16(1 / 64).tobytes(), np.uint8)
    raw[:, 4:16] = packed
    raw[:, 16:] = 0x11
    vals = gguf_dequantize(raw.reshape(-1), gguf.GGMLQuantizationType.Q4_K).reshape(500, 8, 32)
    np.testing.assert_array_equal(vals, np.broadcast_to((sc - mins / 64)[:, :, None], vals.shape))


def test_q4_experts_layout(tmp_path):
    cfg = tm.preset_config("tiny", **SMALL)
    q2, q4 = tmp_path / "q2.gguf", tmp_path / "q4.gguf"
    tm.write_tiny_model(cfg, q2, compute_sha256=False)
    tm.write_tiny_model(dataclasses.replace(cfg, experts="q4"), q4, compute_sha256=False)
    a, b = GGUFFile(q2), GGUFFile(q4)
    assert a.metadata == b.metadata
    assert list(a.tensors) == list(b.tensors)
    for name, ta in a.tensors.items():
        tb = b.tensors[name]
        assert ta.ne == tb.ne
        if "_exps." in name:
            assert ta.ggml_type == (GGMLType.Q2_K if "down" in name else GGMLType.IQ2_XXS)
            assert tb.ggml_type == GGMLType.Q4_K
            fan_in = tb.ne[0]
            vals = _values(b, name).reshape(-1, 256)
            np.testing.assert_allclose(np.sqrt(np.mean(vals**2, axis=1)), 1 / np.sqrt(fan_in), rtol=6e-4)
        else:
            assert ta.ggml_type == tb.ggml_type
            assert np.array_equal(a.tensor_data(name), b.tensor_data(name)), name


def test_deterministic_and_independent_of_chunk_sizes(tmp_path, monkeypatch, small_pair):
    cfg = tm.preset_config("tiny", **SMALL)
    ref = tm.write_tiny_model(cfg, tmp_path / "a.gguf")
    assert ref["sha256"] == hashlib.sha256(Path(small_pair[1]).read_bytes()).hexdigest()
    monkeypatch.setattr(tm, "_CHUNK_ELEMS", 1000)
    monkeypatch.setattr(tm, "_RMS_BATCH_BLOCKS", 7)
    assert tm.write_tiny_model(cfg, tmp_path / "b.gguf")["sha256"] == ref["sha256"]
    monkeypatch.undo()
    other = tm.write_tiny_model(dataclasses.replace(cfg, seed=8), tmp_path / "c.gguf")
    assert other["sha256"] != ref["sha256"]


def test_presets_follow_the_real_model_dims():
    med = tm.preset_config("medium")
    assert med.n_layer == 4 and med.compress_ratios() == [0, 0, 4, 128]
    plan = {s.name: s for s in tm.tensor_plan(med)}
    # shapes from the spec's tensor tables (ARCHITECTURE.md §2.2-2.5)
    expect = {
        "token_embd.weight": (GGMLType.F16, (4096, 129280)),
        "output.weight": (GGMLType.Q8_0, (4096, 129280)),
        "output_hc_fn.weight": (GGMLType.F16, (16384, 4)),
        "blk.0.hc_attn_fn.weight": (GGMLType.F16, (16384, 24)),
        "blk.0.attn_q_b.weight": (GGMLType.Q8_0, (1024, 32768)),
        "blk.0.attn_output_a.weight": (GGMLType.Q8_0, (4096, 8192)),
        "blk.0.attn_output_b.weight": (GGMLType.Q8_0, (8192, 4096)),
        "blk.0.ffn_gate_exps.weight": (GGMLType.IQ2_XXS, (4096, 2048, 256)),
        "blk.0.ffn_down_exps.weight": (GGMLType.Q2_K, (2048, 4096, 256)),
        "blk.0.ffn_gate_tid2eid.weight": (GGMLType.I32, (6, 129280)),
        "blk.2.attn_compressor_ape.weight": (GGMLType.F16, (1024, 4)),
        "blk.2.indexer.attn_q_b.weight": (GGMLType.F16, (1024, 8192)),
        "blk.2.indexer_compressor_kv.weight": (GGMLType.F16, (4096, 256)),
        "blk.3.attn_compressor_ape.weight": (GGMLType.F16, (512, 128)),
        "blk.3.exp_probs_b.bias": (GGMLType.F32, (256,)),
    }
    for name, (gtype, ne) in expect.items():
        assert (plan[name].ggml_type, plan[name].ne) == (gtype, ne), name
    assert "blk.3.ffn_gate_tid2eid.weight" not in plan and "blk.3.indexer.proj.weight" not in plan
    assert plan["blk.0.ffn_gate_exps.weight"].nbytes == 256 * 2048 * 16 * 66  # 1056 B per row
    q4 = {s.name: s for s in tm.tensor_plan(tm.preset_config("medium", experts="q4"))}
    assert q4["blk.0.ffn_down_exps.weight"].nbytes == 256 * 4096 * 1152
    assert tm.preset_config("real-layer").n_layer == 1
    assert tm.preset_config("medium", n_layer=43).compress_ratios()[-3:] == [4, 128, 4]


def test_bad_configs_raise_layout_errors(tmp_path):
    cases = [
        (dict(n_head=6, n_out_group=4), "multiple of n_out_group"),
        (dict(n_embd=384), "multiples of 256"),
        (dict(head_dim=160), "multiple of 64"),
        (dict(n_expert_used=20), "exceeds n_expert"),
        (dict(experts="q3"), "one of 'q2', 'q4', 'q2-q4', 'mxfp4'"),
        (dict(experts="q2-q4", n_layer=1), "at least 2 layers"),
        (dict(q_lora=40), "Q8_0 rows"),
        (dict(n_layer=0), "positive"),
    ]
    for overrides, msg in cases:
        with pytest.raises(LayoutError, match=msg):
            tm.preset_config("tiny", **overrides).validate()
    with pytest.raises(LayoutError, match="unknown preset"):
        tm.preset_config("huge")
    with pytest.raises(LayoutError, match="unknown config field"):
        tm.preset_config("tiny", n_layers=3)
    with pytest.raises(TokenizerError, match="outside the vocab of 1000"):
        tm.write_tiny_model(tm.preset_config("tiny", **{**SMALL, "tokenizer": True}), tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())  # nothing half-written left behind


def test_cli_writes_model_and_summary(tmp_path, capsys):
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("make_tiny_model", SCRIPT)
    cli = module_from_spec(spec)
    spec.loader.exec_module(cli)
    out, summary = tmp_path / "m.gguf", tmp_path / "m.json"
    args = ["--out", str(out), "--summary-json", str(summary), "--quiet", "--experts", "q4",
            *[a for a in _oracle_args(SMALL)]]
    assert cli.main(args) == 0
    info = json.loads(summary.read_text())
    f = GGUFFile(out)
    assert info["config"]["experts"] == "q4" and info["config"]["n_layer"] == 5
    assert [t["name"] for t in info["tensors"]] == list(f.tensors)
    assert all(t["nbytes"] == f.tensors[t["name"]].nbytes for t in info["tensors"])
    assert info["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert "tokenizer.ggml.tokens" not in f.metadata
    assert cli.main(["--out", str(tmp_path / "bad.gguf"), "--no-tokenizer", "--n-embd", "300"]) == 1
    assert "multiples of 256" in capsys.readouterr().err


def test_runtime_code_does_not_import_gguf_py():
    code = ("import sys; import ds4_mlx.synth, ds4_mlx.formats.gguf_writer; "
            "assert 'gguf' not in sys.modules, 'gguf-py imported at runtime'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _vm_hwm_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def test_peak_memory_stays_bounded_while_streaming(tmp_path):
    """A ~480 MB model (routed experts: 1.6 G values) written by a child process whose peak RSS stays far
    below the file size (measured: ~75 MiB, of which ~40 MiB is Python + numpy): the model is never held
    in memory.

    The child's ``ru_maxrss`` (os.wait4) is no use on Linux: it includes the address space the child had
    before exec, i.e. pytest's own (~1 GB here). The peak of the child's own address space is its
    ``VmHWM``, which the generator reports in its summary (and which we also sample while it runs).
    """
    out, summary = tmp_path / "mid.gguf", tmp_path / "mid.json"
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--summary-json", str(summary), "--quiet",
           "--no-tokenizer", "--no-sha256", "--n-layer", "2", "--n-embd", "1024", "--n-vocab", "8192",
           "--n-expert", "128", "--n-ff-exp", "2048"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampled = 0
    while proc.poll() is None:
        sampled = max(sampled, _vm_hwm_bytes(proc.pid) or 0)
        time.sleep(0.2)
    assert proc.returncode == 0, proc.stderr.read().decode()
    peak = json.loads(summary.read_text())["peak_rss_bytes"]
    size = out.stat().st_size
    assert size > 450e6
    # The child may still allocate a little after writing its summary, so the sampled VmHWM can
    # exceed the reported one by a page or two: judge the larger of the two.
    peak = max(peak, sampled)
    assert peak < 0.4 * size, f"peak RSS {peak / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file"
