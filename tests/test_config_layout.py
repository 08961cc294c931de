"""Config from metadata and the tensor layout, checked against independent descriptions: the oracle
generator's own summary of what it wrote, its README, and the spec's tensor table for the real model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4_mlx.errors import LayoutError
from ds4_mlx.formats.config import REAL_FLASH, ModelConfig
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.formats.layout import (
    ExpectedTensor,
    expected_tensors,
    load_model_file,
    routed_quant_bits,
    validate_layout,
)
from small_model import build_small_model, rewrite_gguf


def test_config_matches_generator_summary(small_model_no_tokenizer):
    path, summary = small_model_no_tokenizer
    with GGUFFile(path) as f:
        cfg = ModelConfig.from_gguf(f)
    for key, want in summary["config"].items():
        if key == "seed":
            continue
        assert getattr(cfg, key) == want, key
    assert cfg.compress_ratios == (0, 0, 4, 128)
    assert cfg.swiglu_clamp == (10.0,) * 4


def test_expected_tensors_match_generator_table(small_model_no_tokenizer):
    """Every tensor the generator wrote is expected with its type and dims, and every required
    expectation was written: layout.py and the oracle generator describe the same layout."""
    path, summary = small_model_no_tokenizer
    with GGUFFile(path) as f:
        cfg = ModelConfig.from_gguf(f)
    expected = {e.name: e for e in expected_tensors(cfg)}
    assert len(expected) == len(expected_tensors(cfg))  # no name twice
    written = {t["name"]: t for t in summary["tensors"]}
    for name, t in written.items():
        e = expected[name]
        assert GGMLType[t["type"]] in e.ggml_types, name
        assert list(e.ne) == t["dims"], name
    assert {n for n, e in expected.items() if e.required} <= set(written)
    assert set(expected) - set(written) == {f"blk.{il}.exp_probs_b.bias" for il in range(3)}


def test_small_model_validates(small_model_no_tokenizer):
    path, _ = small_model_no_tokenizer
    f, cfg, report = load_model_file(path)
    with f:
        assert report.n_checked == len(f.tensors) == 116
        assert report.routed_quant_bits == 2 and routed_quant_bits(f) == 2
        assert report.routed_types == {"gate": "IQ2_XXS", "up": "IQ2_XXS", "down": "Q2_K"}
        assert report.missing_optional == [f"blk.{il}.exp_probs_b.bias" for il in range(3)]
        assert report.extra_tensors == [] and report.warnings == []


def test_bias_on_every_layer_is_accepted(tmp_path):
    path = build_small_model(tmp_path / "b.gguf", tokenizer=False,
                             extra_args=["--exp-probs-b-all-layers"])
    f, _, report = load_model_file(path)
    f.close()
    assert report.missing_optional == [] and report.n_checked == 119


def test_tiny_oracle_model_validates(tiny_model_path):
    """The configuration the oracle README states for its tiny model."""
    f, cfg, report = load_model_file(tiny_model_path)
    with f:
        assert (cfg.n_layer, cfg.n_embd, cfg.n_vocab, cfg.n_head, cfg.n_head_kv) == (6, 512, 129280, 16, 1)
        assert (cfg.head_dim, cfg.value_dim, cfg.n_rot, cfg.n_out_group) == (256, 256, 64, 8)
        assert (cfg.q_lora_rank, cfg.o_lora_rank) == (384, 96)
        assert (cfg.n_expert, cfg.n_expert_used, cfg.n_expert_shared, cfg.n_ff_exp) == (16, 4, 1, 256)
        assert (cfg.n_swa, cfg.n_indexer_head, cfg.indexer_head_dim, cfg.indexer_top_k) == (32, 8, 128, 16)
        assert (cfg.n_hc, cfg.hc_sinkhorn_iter, cfg.n_hash_layer) == (4, 20, 3)
        assert cfg.compress_ratios == (0, 0, 4, 128, 4, 128)
        assert report.n_checked == len(f.tensors) == 178
        assert report.routed_quant_bits == 2
        assert report.routed_types == {"gate": "IQ2_XXS", "up": "IQ2_XXS", "down": "Q2_K"}
        assert report.extra_tensors == [] and report.warnings == []


def _random_blocks(shape_rows, row_bytes, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(*shape_rows, row_bytes), dtype=np.uint8)


def _routed(cfg, kind: str, qtype) -> tuple[np.ndarray, QT]:
    """Random routed expert bytes of a given type (n_expert, rows, row_bytes)."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    if kind == "down":
        rows, n_in = cfg.n_embd, cfg.n_ff_exp
    else:
        rows, n_in = cfg.n_ff_exp, cfg.n_embd
    return _random_blocks((cfg.n_expert, rows), n_in // elems * nbytes), qtype


@pytest.fixture(scope="module")
def small_cfg(small_model_no_tokenizer):
    with GGUFFile(small_model_no_tokenizer[0]) as f:
        return ModelConfig.from_gguf(f)


def test_q4_routed_experts_give_4_bits(small_model_no_tokenizer, small_cfg, tmp_path):
    path, _ = small_model_no_tokenizer
    replace = {}
    for il in range(small_cfg.n_layer):
        for kind in ("gate", "up", "down"):
            replace[f"blk.{il}.ffn_{kind}_exps.weight"] = _routed(small_cfg, kind, QT.Q4_K)
    out = rewrite_gguf(path, tmp_path / "q4.gguf", replace=replace)
    f, _, report = load_model_file(out)
    f.close()
    assert report.routed_quant_bits == 4
    assert report.routed_types == {"gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"}
    assert report.warnings == []


@pytest.mark.parametrize("gate_up,down,bits", [(QT.IQ2_XXS, QT.Q4_K, 2), (QT.Q2_K, QT.Q2_K, 2),
                                               (QT.Q4_K, QT.Q2_K, 4), (QT.MXFP4, QT.MXFP4, 2),
                                               (QT.MXFP4, QT.Q2_K, 2)])
def test_ds4_accepts_any_routed_type_pairing(small_model_no_tokenizer, small_cfg, tmp_path, gate_up, down, bits):
    """ds4 takes IQ2_XXS, Q2_K, Q4_K or MXFP4 for each routed tensor (gate and up equal); the bit width
    follows layer 0's gate alone (2 for MXFP4, as ds4_engine_routed_quant_bits says)."""
    path, _ = small_model_no_tokenizer
    replace = {}
    for il in range(small_cfg.n_layer):
        replace[f"blk.{il}.ffn_gate_exps.weight"] = _routed(small_cfg, "gate", gate_up)
        replace[f"blk.{il}.ffn_up_exps.weight"] = _routed(small_cfg, "up", gate_up)
        replace[f"blk.{il}.ffn_down_exps.weight"] = _routed(small_cfg, "down", down)
    out = rewrite_gguf(path, tmp_path / "m.gguf", replace=replace)
    f, _, report = load_model_file(out)
    f.close()
    assert report.routed_quant_bits == bits
    assert report.routed_types == {"gate": gate_up.name, "up": gate_up.name, "down": down.name}


def test_routed_types_may_differ_per_layer(small_model_no_tokenizer, small_cfg, tmp_path):
    """ds4f-q2-q4's shape on the small model: Q4_K in the last layer, the q2 pair before; per-layer types
    in the report, ds4's layer-0 bits (2), no warning."""
    path, _ = small_model_no_tokenizer
    replace = {f"blk.3.ffn_{k}_exps.weight": _routed(small_cfg, k, QT.Q4_K) for k in ("gate", "up", "down")}
    replace["blk.1.ffn_down_exps.weight"] = _routed(small_cfg, "down", QT.MXFP4)
    out = rewrite_gguf(path, tmp_path / "mix.gguf", replace=replace)
    f, _, report = load_model_file(out)
    f.close()
    assert report.routed_by_layer == [("IQ2_XXS", "Q2_K"), ("IQ2_XXS", "MXFP4"), ("IQ2_XXS", "Q2_K"),
                                      ("Q4_K", "Q4_K")]
    assert report.to_dict()["routed_mix"] == "IQ2_XXS/Q2_K layers 0, 2, IQ2_XXS/MXFP4 layer 1, Q4_K layer 3"
    assert report.routed_quant_bits == 2 and report.warnings == []


@pytest.mark.parametrize("qtype", [QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q3_K])
def test_routed_type_ds4_mlx_does_not_implement_names_layer_and_tensor(small_model_no_tokenizer, small_cfg,
                                                                       tmp_path, qtype):
    path, _ = small_model_no_tokenizer
    out = rewrite_gguf(path, tmp_path / "bad.gguf", replace={"blk.2.ffn_down_exps.weight":
                                                             _routed(small_cfg, "down", qtype)})
    with pytest.raises(LayoutError) as info:
        load_model_file(out)
    msg = str(info.value)
    assert (f"layer 2: tensor 'blk.2.ffn_down_exps.weight' has type {qtype.name}, expected IQ2_XXS or Q2_K or "
            "Q4_K or MXFP4 (a routed-expert type)") in msg
    # ds4 itself takes Q5_K/Q6_K/Q8_0 routed experts (not Q3_K): the message says which case this is
    assert ("ds4 also takes" in msg) == (qtype != QT.Q3_K) and "\n" not in msg


def test_extra_tensors_and_missing_bias_are_warnings(small_model_no_tokenizer, small_cfg, tmp_path):
    path, _ = small_model_no_tokenizer
    extra = {"mtp.0.e_proj.weight": (np.zeros((4, 8), np.float32), QT.F32)}
    out = rewrite_gguf(path, tmp_path / "x.gguf", add=extra, drop={"blk.3.exp_probs_b.bias"},
                       replace={"blk.3.ffn_down_exps.weight": _routed(small_cfg, "down", QT.Q4_K)})
    f, _, report = load_model_file(out)
    f.close()
    assert report.extra_tensors == ["mtp.0.e_proj.weight"]
    assert "blk.3.exp_probs_b.bias" in report.missing_optional
    assert any("1 tensor(s) ds4 does not use" in w and "mtp.0.e_proj.weight" in w for w in report.warnings)
    assert any("without exp_probs_b.bias" in w and "[3]" in w for w in report.warnings)
    # a layer whose down type differs is reported in the mix, not warned about (ds4f-q2-q4 is published so)
    assert len(report.warnings) == 2
    assert report.to_dict()["routed_mix"] == "IQ2_XXS/Q2_K layers 0-2, IQ2_XXS/Q4_K layer 3"


def _real_flash_metadata() -> dict:
    md = {f"deepseek4.{k}": v for k, v in {
        "block_count": 43, "embedding_length": 4096, "vocab_size": 129280, "attention.head_count": 64,
        "attention.head_count_kv": 1, "attention.key_length": 512, "attention.value_length": 512,
        "rope.dimension_count": 64, "attention.q_lora_rank": 1024, "attention.output_lora_rank": 1024,
        "attention.output_group_count": 8, "expert_count": 256, "expert_used_count": 6,
        "expert_shared_count": 1, "expert_feed_forward_length": 2048, "hash_layer_count": 3,
        "attention.sliding_window": 128, "attention.indexer.head_count": 64,
        "attention.indexer.key_length": 128, "attention.indexer.top_k": 512, "hyper_connection.count": 4,
        "hyper_connection.sinkhorn_iterations": 20, "rope.scaling.original_context_length": 65536,
        "rope.freq_base": 10000.0, "attention.compress_rope_freq_base": 160000.0, "rope.scaling.factor": 16.0,
        "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0, "expert_weights_scale": 1.5,
        "attention.layer_norm_rms_epsilon": 1e-6, "hyper_connection.epsilon": 1e-6,
        "expert_weights_norm": True,
        # the HF config's 44 entries (last one the MTP placeholder); ds4 reads the first 43
        "attention.compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)] + [0],
        "swiglu_clamp_exp": [10.0] * 43,
    }.items()}
    md["general.architecture"] = "deepseek4"
    return md


def test_real_flash_layout_matches_spec_table():
    cfg = ModelConfig.from_metadata(_real_flash_metadata(), "real")
    assert cfg.to_dict()["n_layer"] == 43 and all(getattr(cfg, k) == v for k, v in REAL_FLASH.items())
    ex = {e.name: e for e in expected_tensors(cfg)}
    # 6 global + 24 per layer + 4 compressor tensors on 41 layers + 6 indexer tensors on 21 + 3 tid2eid
    assert len(ex) == 6 + 43 * 24 + 41 * 4 + 21 * 6 + 3
    # dims from the spec's §2 tables (GGUF order)
    spec = {
        "token_embd.weight": ("F16", [4096, 129280]),
        "output_hc_fn.weight": ("F16", [16384, 4]),
        "output.weight": ("Q8_0", [4096, 129280]),
        "blk.0.hc_attn_fn.weight": ("F16", [16384, 24]),
        "blk.0.attn_q_b.weight": ("Q8_0", [1024, 32768]),
        "blk.0.attn_kv.weight": ("Q8_0", [4096, 512]),
        "blk.0.attn_output_a.weight": ("Q8_0", [4096, 8192]),
        "blk.0.attn_output_b.weight": ("Q8_0", [8192, 4096]),
        "blk.5.ffn_gate_inp.weight": ("F16", [4096, 256]),
        "blk.5.exp_probs_b.bias": ("F32", [256]),
        "blk.7.ffn_gate_exps.weight": ("IQ2_XXS", [4096, 2048, 256]),
        "blk.7.ffn_down_exps.weight": ("Q2_K", [2048, 4096, 256]),
        "blk.7.ffn_down_shexp.weight": ("Q8_0", [2048, 4096]),
        "blk.2.ffn_gate_tid2eid.weight": ("I32", [6, 129280]),
        "blk.2.attn_compressor_ape.weight": ("F16", [1024, 4]),
        "blk.3.attn_compressor_ape.weight": ("F16", [512, 128]),
        "blk.3.attn_compressor_kv.weight": ("F16", [4096, 512]),
        "blk.4.indexer.attn_q_b.weight": ("F16", [1024, 8192]),
        "blk.4.indexer.proj.weight": ("F16", [4096, 64]),
        "blk.4.indexer_compressor_ape.weight": ("F16", [256, 4]),
        "blk.4.indexer_compressor_norm.weight": ("F32", [128]),
    }
    for name, (typ, dims) in spec.items():
        assert GGMLType[typ] in ex[name].ggml_types and list(ex[name].ne) == dims, name
    assert "blk.3.ffn_gate_tid2eid.weight" not in ex and "blk.3.indexer.proj.weight" not in ex
    assert "blk.1.attn_compressor_kv.weight" not in ex
    assert not ex["blk.5.exp_probs_b.bias"].required
    assert ex["blk.0.attn_q_b.weight"].shape == (32768, 1024)


def test_float_constants_use_ds4_tolerance_and_config_holds_ds4_values():
    md = _real_flash_metadata()
    md["deepseek4.attention.layer_norm_rms_epsilon"] = 1.5e-6  # within ds4's absolute 1e-6 below 1
    md["deepseek4.rope.freq_base"] = 10000.005  # within relative 1e-6
    cfg = ModelConfig.from_metadata(md, "m")
    assert cfg.rms_eps == 1e-6 and cfg.rope_freq_base == 10000.0
    md["deepseek4.attention.layer_norm_rms_epsilon"] = 2.5e-6
    with pytest.raises(LayoutError, match="layer_norm_rms_epsilon' is 2.5e-06, expected 1e-06"):
        ModelConfig.from_metadata(md, "m")


def test_declared_types_follow_ds4(small_model_no_tokenizer, tmp_path):
    """Floats may be declared f32, f64, u32 or i32 and original_context_length u32 or u64 (ds4's
    readers); the compress ratios may be an i32 array."""
    path, _ = small_model_no_tokenizer
    VT = gguf.GGUFValueType
    out = rewrite_gguf(path, tmp_path / "t.gguf", metadata={
        "deepseek4.rope.freq_base": (10000.0, VT.FLOAT64, None),
        "deepseek4.expert_weights_scale": (1.5, VT.FLOAT32, None),
        "deepseek4.rope.scaling.factor": (16, VT.UINT32, None),
        "deepseek4.rope.scaling.yarn_beta_fast": (32, VT.INT32, None),
        "deepseek4.rope.scaling.original_context_length": (65536, VT.UINT64, None),
        "deepseek4.attention.compress_ratios": ([0, 0, 4, 128], VT.ARRAY, VT.INT32),
        "deepseek4.swiglu_clamp_exp": ([10.0] * 4, VT.ARRAY, VT.FLOAT64),
    })
    f, cfg, _ = load_model_file(out)
    f.close()
    assert cfg.rope_scaling_factor == 16.0 and cfg.compress_ratios == (0, 0, 4, 128)


def test_expected_tensor_describe():
    e = ExpectedTensor("x", (GGMLType.IQ2_XXS, GGMLType.Q4_K), (256, 64, 4))
    assert e.describe() == "IQ2_XXS/Q4_K [256, 64, 4]" and e.shape == (4, 64, 256) and e.required


def test_validate_layout_reports_first_problem_in_binding_order(small_model_no_tokenizer, tmp_path):
    """Missing tensors are found before misshaped ones, as in ds4 (bind, then validate)."""
    path, _ = small_model_no_tokenizer
    cfg_src = GGUFFile(path)
    cfg = ModelConfig.from_gguf(cfg_src)
    cfg_src.close()
    out = rewrite_gguf(path, tmp_path / "two.gguf", drop={"blk.3.ffn_up_shexp.weight"},
                       replace={"blk.0.attn_norm.weight": (np.ones(cfg.n_embd, np.float16), QT.F16)})
    with GGUFFile(out) as f, pytest.raises(LayoutError, match="blk.3.ffn_up_shexp.weight' is missing"):
        validate_layout(f, cfg)


# -- tensors the metadata does not account for (issue #26 item 8) ---------------------------------


def _patched(src, dst, key: str, value: int):
    """``src`` with the u32 metadata ``key`` set to ``value``, patched in place by byte offset."""
    from small_model import kv_value_pos, patch

    data = src.read_bytes()
    dst.write_bytes(patch(data, kv_value_pos(data, key), "<I", value))
    return dst


def test_tensors_of_a_layer_beyond_block_count_are_refused(tmp_path):
    """block_count 5 in a file holding blk.0..blk.5: it used to pass as "layout: OK" and run five
    layers, silently leaving the sixth trained layer out."""
    six = build_small_model(tmp_path / "six.gguf", tokenizer=False, extra_args=["--n-layer", "6"])
    load_model_file(six)[0].close()  # as written, consistent
    bad = _patched(six, tmp_path / "five.gguf", "deepseek4.block_count", 5)
    with GGUFFile(bad) as f:
        first_stray = next(n for n in f.tensors if n.startswith("blk.5."))
        cfg = ModelConfig.from_gguf(f)
        assert cfg.n_layer == 5  # the config alone is fine: compress_ratios etc. cover 5 layers
    with pytest.raises(LayoutError) as ei:
        load_model_file(bad)
    msg = str(ei.value)
    assert str(bad) in msg and f"tensor {first_stray!r}" in msg
    assert "deepseek4.block_count is 5" in msg and "layer 5" in msg


def test_block_count_below_the_layers_of_the_small_model_is_refused(small_model_no_tokenizer, tmp_path):
    path, _ = small_model_no_tokenizer
    bad = _patched(path, tmp_path / "three.gguf", "deepseek4.block_count", 3)
    with pytest.raises(LayoutError, match=r"tensor 'blk\.3\.[\w.]+' belongs to layer 3, but "
                                          r"deepseek4\.block_count is 3"):
        load_model_file(bad)


def test_missing_layer_below_block_count_is_still_refused(small_model_no_tokenizer, tmp_path):
    path, _ = small_model_no_tokenizer
    with GGUFFile(path) as f:
        layer3 = {n for n in f.tensors if n.startswith("blk.3.")}
    out = rewrite_gguf(path, tmp_path / "no3.gguf", drop=layer3)
    with pytest.raises(LayoutError, match=r"required tensor 'blk\.3\.[\w.]+' is missing"):
        load_model_file(out)


def test_hash_routing_table_on_a_non_hash_layer_is_refused(small_model_no_tokenizer, tmp_path):
    """hash_layer_count 2 while layer 2 holds its ffn_gate_tid2eid table: layer 2 would route by
    scores and the file's table for it be ignored."""
    path, _ = small_model_no_tokenizer
    bad = _patched(path, tmp_path / "hash2.gguf", "deepseek4.hash_layer_count", 2)
    with pytest.raises(LayoutError) as ei:
        load_model_file(bad)
    msg = str(ei.value)
    assert "tensor 'blk.2.ffn_gate_tid2eid.weight'" in msg
    assert "deepseek4.hash_layer_count is 2" in msg and "not a hash layer" in msg


@pytest.mark.parametrize("name,ne,why", [
    # a dense layer (compress ratio 0) has no compressor
    ("blk.0.attn_compressor_norm.weight", "head_dim", r"compress_ratios\[0\] is 0"),
    # a ratio-128 layer has a compressor but no indexer
    ("blk.3.indexer.proj.weight", "indexer", r"compress_ratios\[3\] is 128"),
])
def test_compressor_or_indexer_on_a_layer_without_one_is_refused(small_model_no_tokenizer, small_cfg, tmp_path,
                                                                 name, ne, why):
    path, _ = small_model_no_tokenizer
    shape = (small_cfg.head_dim,) if ne == "head_dim" else (small_cfg.n_indexer_head, small_cfg.n_embd)
    out = rewrite_gguf(path, tmp_path / "x.gguf", add={name: (np.zeros(shape, np.float32), QT.F32)})
    with pytest.raises(LayoutError, match=rf"tensor {name!r}.*{why}"):
        load_model_file(out)


def test_unknown_names_stay_warnings(small_model_no_tokenizer, tmp_path):
    """Names ds4 does not know at all are ignored by ds4 and only listed; leading zeros or a
    non-ASCII digit make a name that is not a layer's."""
    path, _ = small_model_no_tokenizer
    names = ["blk.1.my_probe.weight", "blk.03.attn_norm.weight", "blk.\u0663.attn_norm.weight", "mtp.0.x.weight"]
    out = rewrite_gguf(path, tmp_path / "u.gguf", add={n: (np.zeros(4, np.float32), QT.F32) for n in names})
    f, _, report = load_model_file(out)
    f.close()
    assert report.extra_tensors == names
    assert any("4 tensor(s) ds4 does not use" in w for w in report.warnings)


# Every u32 metadata count or width that sizes a tensor, each of which a file can contradict. No
# tensor carries the others (rope.dimension_count, sliding_window, indexer.top_k,
# sinkhorn_iterations, context_length): only their ranges and the config's own rules check them.
_TENSOR_SIZING_KEYS = [
    "block_count", "embedding_length", "vocab_size", "attention.head_count", "attention.key_length",
    "attention.q_lora_rank", "attention.output_lora_rank", "attention.output_group_count", "expert_count",
    "expert_used_count", "expert_feed_forward_length", "hash_layer_count", "attention.indexer.head_count",
]


@pytest.mark.parametrize("key", _TENSOR_SIZING_KEYS)
@pytest.mark.parametrize("step", [-1, 1])
def test_every_count_that_sizes_a_tensor_is_cross_checked(small_model_no_tokenizer, tmp_path, key, step):
    """One more or one less than the tensors hold is refused, by the config or by the layout."""
    path, _ = small_model_no_tokenizer
    with GGUFFile(path) as f:
        value = f.metadata[f"deepseek4.{key}"]
    bad = _patched(path, tmp_path / "m.gguf", f"deepseek4.{key}", value + step)
    with pytest.raises(LayoutError):
        load_model_file(bad)
