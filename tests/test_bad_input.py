"""Malformed and wrong files: each raises a Ds4Error subclass whose message names the problem.

Files are made by patching bytes of a small valid model (locations found by searching the encoded
names, not with the reader under test) or by rewriting it with gguf-py.
"""

from __future__ import annotations

import re
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4_mlx.errors import Ds4Error, GGUFError, LayoutError
from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.formats.layout import load_model_file
from small_model import kv_key_pos, kv_type_pos, kv_value_pos, patch, rewrite_gguf, \
    tensor_info_fields, tensor_info_pos


@pytest.fixture(scope="module")
def data(small_model_path) -> bytes:
    return small_model_path.read_bytes()


def _fail(tmp_path, content: bytes, error=GGUFError) -> Ds4Error:
    """Write ``content``, load it the way the engine does, return the error (asserting its type)."""
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(error) as e:
        f, _, _ = load_model_file(p)
        f.close()
    assert isinstance(e.value, Ds4Error)
    assert str(p) in str(e.value), "the message names the file"
    return e.value


def _rewrite(small, tmp_path, **changes) -> bytes:
    return rewrite_gguf(small, tmp_path / "rewritten.gguf", **changes).read_bytes()


def _u64(data, pos, v):
    return patch(data, pos, "<Q", v)


def _u32(data, pos, v):
    return patch(data, pos, "<I", v)


def _info(data, name):
    return tensor_info_fields(data, name)


# -- container -------------------------------------------------------------------------------


def test_truncated_in_header(tmp_path, data):
    e = _fail(tmp_path, data[:10])
    assert "tensor count: needs 8 bytes but only 2 remain" in str(e) and e.offset == 8
    e = _fail(tmp_path, data[:3])
    assert "magic: needs 4 bytes but only 3 remain" in str(e)


def test_truncated_in_metadata(tmp_path, data):
    # inside the merges, late enough that the tensor directory could still fit in what is left
    cut = kv_value_pos(data, "tokenizer.ggml.merges") + 12 + 4003
    e = _fail(tmp_path, data[:cut])
    assert re.search(r"metadata 'tokenizer\.ggml\.merges'\[\d+\]", str(e)), str(e)
    assert "remain" in str(e)


def test_truncated_early_is_reported_from_the_counts(tmp_path, data):
    cut = kv_value_pos(data, "tokenizer.ggml.tokens") + 300
    e = _fail(tmp_path, data[:cut])
    assert "tensor count 116 is impossible: it needs at least 3712 bytes" in str(e)
    assert "or the file is truncated" in str(e)


def test_truncated_in_tensor_infos(tmp_path, data):
    cut = _info(data, "blk.2.attn_q_b.weight")["type"] + 2
    e = _fail(tmp_path, data[:cut])
    assert "tensor 'blk.2.attn_q_b.weight' type: needs 4 bytes but only 2 remain" in str(e)


@pytest.mark.parametrize("keep", ["all_but_one", "half"])
def test_truncated_in_tensor_data(tmp_path, data, keep):
    cut = len(data) - 1 if keep == "all_but_one" else len(data) // 2
    e = _fail(tmp_path, data[:cut])
    assert re.search(r"tensor '[\w.]+': data \[\d+, \d+\) runs past the end of the file", str(e)), str(e)
    assert f"({cut} bytes; truncated" in str(e)


def test_wrong_magic(tmp_path, data):
    e = _fail(tmp_path, b"GGML" + data[4:])
    assert "bad magic b'GGML'" in str(e) and e.offset == 0


@pytest.mark.parametrize("version", [1, 2, 4])
def test_unsupported_version(tmp_path, data, version):
    e = _fail(tmp_path, _u32(data, 4, version))
    assert f"unsupported GGUF version {version}" in str(e) and e.offset == 4


def test_absurd_tensor_count(tmp_path, data):
    e = _fail(tmp_path, _u64(data, 8, 1 << 40))
    assert f"tensor count {1 << 40} is impossible: it needs at least {32 << 40} bytes" in str(e) and e.offset == 8


def test_absurd_metadata_count(tmp_path, data):
    e = _fail(tmp_path, _u64(data, 16, (1 << 64) - 1))
    assert f"metadata count {(1 << 64) - 1} is impossible" in str(e) and e.offset == 16


def test_string_length_beyond_file(tmp_path, data):
    pos = kv_value_pos(data, "general.name")
    e = _fail(tmp_path, _u64(data, pos, 1 << 40))
    assert f"metadata 'general.name' string ({1 << 40} bytes): needs" in str(e) and e.offset == pos + 8


def test_string_array_element_length_beyond_file(tmp_path, data):
    first = kv_value_pos(data, "tokenizer.ggml.merges") + 12
    e = _fail(tmp_path, _u64(data, first, 1 << 33))
    assert f"metadata 'tokenizer.ggml.merges'[0]: string length {1 << 33} runs past the end" in str(e)
    assert e.offset == first


@pytest.mark.parametrize("key,kind", [("tokenizer.ggml.tokens", "STRING"), ("tokenizer.ggml.token_type", "INT32"),
                                      ("deepseek4.attention.compress_ratios", "UINT32")])
def test_array_length_beyond_file(tmp_path, data, key, kind):
    pos = kv_value_pos(data, key) + 4
    e = _fail(tmp_path, _u64(data, pos, 1 << 50))
    assert f"metadata '{key}' array of {1 << 50} {kind}: needs" in str(e)


def test_tensor_data_beyond_file(tmp_path, data):
    pos = _info(data, "blk.1.ffn_norm.weight")["offset"]
    e = _fail(tmp_path, _u64(data, pos, (len(data) // 32 + 1) * 32))
    assert "tensor 'blk.1.ffn_norm.weight': data [" in str(e) and "runs past the end of the file" in str(e)


def test_misaligned_tensor_offset(tmp_path, data):
    pos = _info(data, "blk.1.ffn_norm.weight")["offset"]
    (rel,) = struct.unpack_from("<Q", data, pos)
    e = _fail(tmp_path, _u64(data, pos, rel + 8))
    assert f"tensor 'blk.1.ffn_norm.weight': data offset {rel + 8} is not a multiple of the alignment 32" in str(e)


def test_overlapping_tensors(tmp_path, data):
    (rel,) = struct.unpack_from("<Q", data, _info(data, "blk.0.attn_norm.weight")["offset"])
    e = _fail(tmp_path, _u64(data, _info(data, "blk.0.attn_sinks.weight")["offset"], rel))
    assert "overlaps tensor" in str(e) and "blk.0.attn_sinks.weight" in str(e) and "blk.0.attn_norm.weight" in str(e)


@pytest.mark.parametrize("type_id", [99, 4, 31])  # 4 (Q4_2) and 31 (Q4_0_4_4) were removed from ggml
def test_unknown_tensor_type(tmp_path, data, type_id):
    pos = _info(data, "output_norm.weight")["type"]
    e = _fail(tmp_path, _u32(data, pos, type_id))
    assert f"tensor 'output_norm.weight' has unknown GGML type id {type_id}" in str(e) and e.offset == pos


def test_unknown_metadata_value_type(tmp_path, data):
    pos = kv_type_pos(data, "deepseek4.expert_count")
    e = _fail(tmp_path, _u32(data, pos, 13))
    assert "metadata 'deepseek4.expert_count' has unknown value type 13" in str(e) and e.offset == pos


def test_unknown_array_element_type(tmp_path, data):
    pos = kv_value_pos(data, "deepseek4.swiglu_clamp_exp")
    e = _fail(tmp_path, _u32(data, pos, 77))
    assert "metadata 'deepseek4.swiglu_clamp_exp' array element has unknown value type 77" in str(e)


@pytest.mark.parametrize("n_dims", [5, 0])
def test_bad_dimension_count(tmp_path, data, n_dims):
    pos = _info(data, "blk.0.attn_q_a.weight")["n_dims"]
    e = _fail(tmp_path, _u32(data, pos, n_dims))
    assert f"tensor 'blk.0.attn_q_a.weight' has {n_dims} dimensions (1..4 allowed)" in str(e) and e.offset == pos


def test_zero_dimension(tmp_path, data):
    pos = _info(data, "blk.0.attn_q_a.weight")["dims"] + 8
    e = _fail(tmp_path, _u64(data, pos, 0))
    assert "tensor 'blk.0.attn_q_a.weight' has a zero dimension, ne=[256, 0]" in str(e)


def test_row_not_whole_blocks(tmp_path, data):
    pos = _info(data, "blk.0.attn_q_a.weight")["dims"]
    e = _fail(tmp_path, _u64(data, pos, 250))
    assert "row length ne[0]=250 is not a multiple of the Q8_0 block size 32" in str(e)


def test_duplicate_tensor_name(tmp_path, data):
    pos = tensor_info_pos(data, "blk.1.attn_norm.weight") + 8
    e = _fail(tmp_path, data[:pos] + b"blk.0" + data[pos + 5:])
    assert "duplicate tensor name 'blk.0.attn_norm.weight'" in str(e) and e.offset == pos - 8


def test_duplicate_metadata_key(tmp_path, data):
    pos = kv_key_pos(data, "tokenizer.ggml.bos_token_id") + 8
    e = _fail(tmp_path, data[:pos] + b"tokenizer.ggml.eos" + data[pos + 18:])
    assert f"duplicate metadata key 'tokenizer.ggml.eos_token_id' (first at byte offset {pos - 8})" in str(e)
    assert e.offset == kv_key_pos(data, "tokenizer.ggml.eos_token_id")


def test_invalid_utf8_key(tmp_path, data):
    pos = kv_key_pos(data, "deepseek4.block_count")
    bad = bytearray(data)
    bad[pos + 8 + 3] = 0xFF
    e = _fail(tmp_path, bytes(bad))
    assert re.search(r"metadata key #\d+ is not valid UTF-8 \(invalid start byte at byte 3", str(e)), str(e)
    assert e.offset == pos


def test_invalid_utf8_in_string_array(tmp_path, data):
    first = kv_value_pos(data, "tokenizer.ggml.tokens") + 12
    # element 0 is "<｜begin▁of▁sentence｜>": its second byte starts the 3-byte "｜"
    bad = bytearray(data)
    bad[first + 8 + 1] = 0xC0
    e = _fail(tmp_path, bytes(bad))
    assert "metadata 'tokenizer.ggml.tokens'[0] is not valid UTF-8" in str(e) and e.offset == first


def test_bool_byte_not_0_or_1(tmp_path, data):
    pos = kv_value_pos(data, "deepseek4.expert_weights_norm")
    e = _fail(tmp_path, patch(data, pos, "<B", 2))
    assert "metadata 'deepseek4.expert_weights_norm': bool byte is 2, expected 0 or 1" in str(e)


def test_arrays_nested_too_deep(tmp_path):
    inner = struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)  # [7] as a u32 array
    for _ in range(9):
        inner = struct.pack("<IQ", 9, 1) + inner
    key = b"deep"
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 9) + inner
    e = _fail(tmp_path, raw)
    assert "metadata 'deep'[0][0][0][0][0][0][0][0]: arrays nested deeper than 8 levels" in str(e)


def test_missing_empty_and_directory_paths(tmp_path):
    with pytest.raises(GGUFError, match="cannot open: No such file or directory"):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="cannot open: Is a directory"):
        GGUFFile(tmp_path)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="empty file, not a GGUF"):
        GGUFFile(tmp_path / "empty.gguf")


# -- layout ------------------------------------------------------------------------------------


def test_missing_tensor(tmp_path, data):
    pos = tensor_info_pos(data, "blk.1.attn_sinks.weight") + 8
    renamed = data[:pos] + b"blk.1.attn_sinkX.weight" + data[pos + 23:]
    e = _fail(tmp_path, renamed, LayoutError)
    assert "required tensor 'blk.1.attn_sinks.weight' is missing (expected F32 [2])" in str(e)


def test_misshaped_tensor(tmp_path, data):
    dims = _info(data, "blk.2.attn_q_a.weight")["dims"]  # Q8_0 [256, 64]: swapping keeps the size
    swapped = _u64(_u64(data, dims, 64), dims + 8, 256)
    e = _fail(tmp_path, swapped, LayoutError)
    assert "tensor 'blk.2.attn_q_a.weight' has GGUF dims [64, 256], expected [256, 64]" in str(e)


def test_wrong_dimension_count(tmp_path, small_model_path):
    # the routed gate as 2-D (all experts stacked in one matrix): same bytes, ds4 refuses it
    cfg_rows = 4 * 256
    rows = np.random.default_rng(1).integers(0, 256, size=(cfg_rows, 66), dtype=np.uint8)
    content = _rewrite(small_model_path, tmp_path, replace={"blk.0.ffn_gate_exps.weight": (rows, QT.IQ2_XXS)})
    e = _fail(tmp_path, content, LayoutError)
    assert "tensor 'blk.0.ffn_gate_exps.weight' has GGUF dims [256, 1024], expected [256, 256, 4]" in str(e)


def test_wrongly_typed_tensor(tmp_path, data):
    pos = _info(data, "blk.0.attn_norm.weight")["type"]  # F32 -> I32: same size
    e = _fail(tmp_path, _u32(data, pos, 26), LayoutError)
    assert "tensor 'blk.0.attn_norm.weight' has type I32, expected F32" in str(e)


def test_routed_tensor_of_a_type_ds4_mlx_refuses(tmp_path, small_model_path):
    # Q8_0 routed experts: ds4 (b0309611) takes them, ds4-mlx implements no such product
    rows = np.random.default_rng(2).integers(0, 256, size=(4, 256, 8 * 34), dtype=np.uint8)
    content = _rewrite(small_model_path, tmp_path, replace={"blk.2.ffn_up_exps.weight": (rows, QT.Q8_0)})
    e = _fail(tmp_path, content, LayoutError)
    assert "layer 2: tensor 'blk.2.ffn_up_exps.weight' has type Q8_0, expected IQ2_XXS or Q2_K or Q4_K or " \
           "MXFP4 (a routed-expert type); ds4 also takes Q8_0 routed experts" in str(e)


def test_gate_up_type_mismatch(tmp_path, small_model_path):
    rows = np.random.default_rng(3).integers(0, 256, size=(4, 256, 144), dtype=np.uint8)
    content = _rewrite(small_model_path, tmp_path, replace={"blk.3.ffn_up_exps.weight": (rows, QT.Q4_K)})
    e = _fail(tmp_path, content, LayoutError)
    assert "layer 3: routed gate/up experts use different quant types (ffn_gate_exps is IQ2_XXS, " \
           "ffn_up_exps is Q4_K)" in str(e)


# -- metadata / config ---------------------------------------------------------------------------


def test_metadata_constant_off(tmp_path, data):
    pos = kv_value_pos(data, "deepseek4.rope.freq_base")
    e = _fail(tmp_path, patch(data, pos, "<f", 10001.0), LayoutError)
    assert "metadata 'deepseek4.rope.freq_base' is 10001.0, expected 10000.0" in str(e)


def test_compress_ratios_wrong(tmp_path, data):
    first = kv_value_pos(data, "deepseek4.attention.compress_ratios") + 12
    e = _fail(tmp_path, _u32(data, first + 3 * 4, 4), LayoutError)
    assert "deepseek4.attention.compress_ratios[3] is 4, ds4's fixed schedule needs 128" in str(e)


def test_compress_ratios_too_short(tmp_path, small_model_path):
    VT = gguf.GGUFValueType
    short = ([0, 0, 4], VT.ARRAY, VT.UINT32)
    content = _rewrite(small_model_path, tmp_path, metadata={"deepseek4.attention.compress_ratios": short})
    e = _fail(tmp_path, content, LayoutError)
    assert "compress_ratios has 3 entries, needs at least block_count=4" in str(e)


def test_missing_required_key(tmp_path, data):
    pos = kv_key_pos(data, "deepseek4.expert_count") + 8
    renamed = data[:pos] + b"deepseek4.expert_counX" + data[pos + 22:]
    e = _fail(tmp_path, renamed, LayoutError)
    assert "required metadata key 'deepseek4.expert_count' is missing" in str(e)


def test_missing_expert_weights_norm(tmp_path, small_model_path):
    content = _rewrite(small_model_path, tmp_path, metadata={"deepseek4.expert_weights_norm": None})
    e = _fail(tmp_path, content, LayoutError)
    assert "required metadata key 'deepseek4.expert_weights_norm' is missing" in str(e)


def test_group_limited_routing_refused(tmp_path, data):
    pos = kv_value_pos(data, "deepseek4.expert_group_count")
    e = _fail(tmp_path, _u32(data, pos, 1), LayoutError)
    assert "metadata 'deepseek4.expert_group_count' is 1, expected 0" in str(e)


def test_shape_key_declared_with_a_type_ds4_does_not_read(tmp_path, small_model_path):
    VT = gguf.GGUFValueType
    content = _rewrite(small_model_path, tmp_path, metadata={"deepseek4.expert_count": (4, VT.UINT64, None)})
    e = _fail(tmp_path, content, LayoutError)
    assert "metadata 'deepseek4.expert_count' is declared UINT64; ds4 reads it only as UINT32" in str(e)


def test_wrong_architecture(tmp_path, data):
    pos = kv_value_pos(data, "general.architecture") + 8
    e = _fail(tmp_path, data[:pos] + b"deepseek3" + data[pos + 9:], LayoutError)
    assert "general.architecture is 'deepseek3', expected 'deepseek4'" in str(e)


def test_real_flash_claim_with_wrong_dims(tmp_path, small_model_path):
    VT = gguf.GGUFValueType
    ratios = [0, 0] + [4 if il % 2 == 0 else 128 for il in range(2, 43)]
    content = _rewrite(small_model_path, tmp_path, metadata={
        "deepseek4.block_count": (43, VT.UINT32, None),
        "deepseek4.attention.compress_ratios": (ratios, VT.ARRAY, VT.UINT32),
        "deepseek4.swiglu_clamp_exp": ([10.0] * 43, VT.ARRAY, VT.FLOAT32),
    })
    e = _fail(tmp_path, content, LayoutError)
    assert "claims the real DS4 Flash (43 layers) but n_embd is 256, expected 4096" in str(e)


def test_huge_corrupt_names_are_cut_short_in_messages(tmp_path):
    key = b"k" * 100_000
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 77)
    e = _fail(tmp_path, raw)
    assert "has unknown value type 77" in str(e) and "(100000 characters)" in str(e) and len(str(e)) < 400


def test_huge_value_where_a_number_belongs_is_cut_short(tmp_path, small_model_path):
    VT = gguf.GGUFValueType
    huge = (list(range(50_000)), VT.ARRAY, VT.UINT32)
    content = _rewrite(small_model_path, tmp_path, metadata={"deepseek4.expert_count": huge})
    e = _fail(tmp_path, content, LayoutError)  # with declared types known, the type is named
    assert "metadata 'deepseek4.expert_count' is declared ARRAY of UINT32; ds4 reads it only as UINT32" in str(e)
    (tmp_path / "v.gguf").write_bytes(content)
    with GGUFFile(tmp_path / "v.gguf") as f, pytest.raises(LayoutError) as e:
        ModelConfig.from_metadata(f.metadata, "plain")  # values only: the value is quoted, cut short
    assert "metadata 'deepseek4.expert_count' must be a non-negative integer, found [0, 1, 2" in str(e.value)
    assert "(list of 50000)" in str(e.value) and len(str(e.value)) < 300
