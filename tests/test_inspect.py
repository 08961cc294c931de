"""`ds4-mlx inspect`: text and JSON reports, verdicts and exit codes."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import types

import gguf

from ds4_mlx.frontends import cli
from small_model import kv_value_pos, patch, tensor_info_pos

JSON_KEYS = {"checkpoint", "path", "file_size", "gguf_version", "alignment", "data_offset", "n_kv", "n_tensors", "metadata",
             "tensors", "type_totals", "tensor_bytes", "n_params", "config", "verdict", "error",
             "routed_quant_bits", "layout", "blas", "native_experts", "drafter"}


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["inspect", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_text_report_of_a_valid_model(small_model_path, capsys):
    rc, out, err = _run(capsys, small_model_path)
    assert rc == 0 and err == ""
    assert f"file: {small_model_path} ({small_model_path.stat().st_size:,} bytes" in out
    assert "gguf: v3, " in out and "116 tensors, alignment 32" in out
    # the vocabulary is summarized: count and first items, never all of it
    line = next(l for l in out.splitlines() if l.lstrip().startswith("tokenizer.ggml.tokens"))
    assert "STRING[512]" in line and "(504 more)" in line and "'<｜begin▁of▁sentence｜>'" in line
    assert "deepseek4.attention.compress_ratios" in out and "[0, 0, 4, 128]" in out
    assert any(l.split()[:3] == ["blk.0.ffn_gate_exps.weight", "IQ2_XXS", "[256,"] for l in out.splitlines())
    assert "layout: OK (116 tensors checked)" in out
    assert "routed experts: 2-bit (gate/up IQ2_XXS, down Q2_K)" in out
    assert "n_layer=4" in out and "n_embd=256" in out
    rc, out2, _ = _run(capsys, small_model_path, "--no-tensors")
    assert rc == 0 and "blk.0.ffn_gate_exps.weight" not in out2 and "layout: OK" in out2


def test_json_report_of_a_valid_model(small_model_path, capsys):
    rc, out, _ = _run(capsys, small_model_path, "--json")
    assert rc == 0
    info = json.loads(out)
    assert set(info) == JSON_KEYS
    assert info["verdict"] == "OK" and info["error"] is None and info["routed_quant_bits"] == 2
    assert info["n_tensors"] == len(info["tensors"]) == 116
    assert info["config"]["n_layer"] == 4 and info["config"]["compress_ratios"] == [0, 0, 4, 128]
    assert info["layout"]["routed_types"] == {"gate": "IQ2_XXS", "up": "IQ2_XXS", "down": "Q2_K"}
    tok = info["metadata"]["tokenizer.ggml.tokens"]
    assert tok["type"] == "ARRAY" and tok["element_type"] == "STRING" and tok["count"] == 512
    assert len(tok["head"]) == 8 and tok["truncated"] is True
    assert info["metadata"]["deepseek4.block_count"] == {"type": "UINT32", "value": 4}
    assert info["metadata"]["deepseek4.attention.compress_ratios"]["head"] == [0, 0, 4, 128]
    # per-type totals are the sums of the table, and the table agrees with gguf-py
    reader = gguf.GGUFReader(str(small_model_path))
    by_name = {t.name: t for t in reader.tensors}
    sums: dict[str, list[int]] = {}
    for t in info["tensors"]:
        rt = by_name[t["name"]]
        assert t["type"] == rt.tensor_type.name and t["ne"] == [int(d) for d in rt.shape]
        assert t["nbytes"] == rt.n_bytes and t["offset"] == rt.data_offset and t["shape"] == t["ne"][::-1]
        s = sums.setdefault(t["type"], [0, 0])
        s[0] += 1
        s[1] += t["nbytes"]
    assert {k: [v["count"], v["nbytes"]] for k, v in info["type_totals"].items()} == sums
    assert info["tensor_bytes"] == sum(v[1] for v in sums.values())


def test_json_of_the_tiny_model_stays_small(tiny_model_path, capsys):
    rc, out, _ = _run(capsys, tiny_model_path, "--json")
    assert rc == 0 and len(out) < 100_000  # 129k tokens + 128k merges are summarized
    info = json.loads(out)
    assert info["metadata"]["tokenizer.ggml.tokens"]["count"] == 129280
    assert info["metadata"]["tokenizer.ggml.merges"]["count"] == 127741
    assert info["n_tensors"] == 178 and info["verdict"] == "OK"


def test_invalid_layout_prints_report_and_exits_1(small_model_path, tmp_path, capsys):
    data = small_model_path.read_bytes()
    pos = tensor_info_pos(data, "blk.1.attn_sinks.weight") + 8
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:pos] + b"blk.1.attn_sinkX.weight" + data[pos + 23:])
    rc, out, err = _run(capsys, bad)
    assert rc == 1 and err == ""
    assert "layout: INVALID: " in out and "required tensor 'blk.1.attn_sinks.weight' is missing" in out
    assert "blk.1.attn_sinkX.weight" in out  # the table is still printed
    rc, out, _ = _run(capsys, bad, "--json")
    info = json.loads(out)
    assert rc == 1 and set(info) == JSON_KEYS
    assert info["verdict"] == "INVALID" and "blk.1.attn_sinks.weight" in info["error"]
    assert info["config"]["n_layer"] == 4 and info["layout"] is None and info["routed_quant_bits"] == 2


def test_layers_beyond_block_count_make_the_layout_invalid(small_model_path, tmp_path, capsys):
    """block_count 3 in a file holding four layers' tensors was "layout: OK" with blk.3.* listed as
    tensors ds4 does not use, and the model ran three layers (issue #26 item 8)."""
    data = small_model_path.read_bytes()
    bad = tmp_path / "three.gguf"
    bad.write_bytes(patch(data, kv_value_pos(data, "deepseek4.block_count"), "<I", 3))
    rc, out, err = _run(capsys, bad)
    assert rc == 1 and err == ""
    assert "layout: OK" not in out
    line = next(l for l in out.splitlines() if l.startswith("layout: "))
    assert line.startswith("layout: INVALID: ") and "deepseek4.block_count is 3" in line
    assert "tensor 'blk.3." in line and "belongs to layer 3" in line
    rc, out, _ = _run(capsys, bad, "--json")
    info = json.loads(out)
    assert rc == 1 and info["verdict"] == "INVALID" and info["layout"] is None
    assert "deepseek4.block_count is 3" in info["error"] and info["config"]["n_layer"] == 3


def test_invalid_config_exits_1_without_config(small_model_path, tmp_path, capsys):
    data = small_model_path.read_bytes()
    bad = tmp_path / "rope.gguf"
    bad.write_bytes(patch(data, kv_value_pos(data, "deepseek4.rope.freq_base"), "<f", 10001.0))
    rc, out, _ = _run(capsys, bad, "--json")
    info = json.loads(out)
    assert rc == 1 and info["verdict"] == "INVALID" and info["config"] is None
    assert "deepseek4.rope.freq_base' is 10001.0, expected 10000.0" in info["error"]


def test_unreadable_file_is_one_line_and_exit_2(tmp_path, capsys):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"not a gguf at all")
    rc, out, err = _run(capsys, p)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("ds4-mlx inspect: error: ") and "bad magic" in err
    rc, out, err = _run(capsys, tmp_path / "missing.gguf", "--json")
    assert rc == 2 and out == "" and "cannot open" in err


def test_exit_codes_from_a_real_process(small_model_path, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "ds4_mlx.frontends.cli", "inspect", *map(str, args)],
                              capture_output=True, text=True, timeout=120)

    ok = run(small_model_path, "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["verdict"] == "OK"
    junk = tmp_path / "j.gguf"
    junk.write_bytes(b"GGUF" + bytes(4))
    bad = run(junk)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "unsupported GGUF version 0" in bad.stderr


def test_blas_status_is_reported_when_available(small_model_path, capsys, monkeypatch):
    fake = types.ModuleType("ds4_mlx.blas")
    fake.status = lambda: {"blas": "fake", "threads": 3}
    monkeypatch.setitem(sys.modules, "ds4_mlx.blas", fake)
    rc, out, _ = _run(capsys, small_model_path, "--json")
    assert rc == 0 and json.loads(out)["blas"] == {"blas": "fake", "threads": 3}
    rc, out, _ = _run(capsys, small_model_path, "--no-tensors")
    assert 'blas: {"blas": "fake", "threads": 3}' in out

    def broken():
        raise RuntimeError("no library")

    fake.status = broken
    rc, out, _ = _run(capsys, small_model_path, "--json")
    assert rc == 0 and json.loads(out)["blas"] == {"error": "ds4_mlx.blas.status() failed: RuntimeError: no library"}

    monkeypatch.setitem(sys.modules, "ds4_mlx.blas", None)  # as if the module did not exist
    rc, out, _ = _run(capsys, small_model_path, "--json")
    assert rc == 0 and json.loads(out)["blas"] is None


# -- hostile files (issue #8, 6d): output linear in the file, nothing unprintable reaches the terminal


def _s(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def _hostile_gguf(path, keys: list[bytes], strings: dict[bytes, bytes], tensor_name: bytes) -> int:
    """A GGUF (no DS4 layout) with u32 keys ``keys``, string keys ``strings`` and one F32 [1] tensor."""
    kvs = [_s(k) + struct.pack("<II", 4, 7) for k in keys]
    kvs += [_s(k) + struct.pack("<I", 8) + _s(v) for k, v in strings.items()]
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kvs)) + b"".join(kvs)
    head += _s(tensor_name) + struct.pack("<IQIQ", 1, 1, 0, 0)  # 1 dim of 1, F32, offset 0
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + struct.pack("<f", 1.0))
    return len(head) + 4


def test_one_huge_key_keeps_the_text_report_linear(tmp_path, capsys):
    """Padding every line to the longest key made a 480 KB file print 2 GB."""
    p = tmp_path / "wide.gguf"
    size = _hostile_gguf(p, [b"k%d" % i for i in range(200)] + [b"K" * 200_000], {b"s": b"v" * 100_000},
                         b"T" * 100_000)
    rc, out, err = _run(capsys, p)
    assert rc == 1 and err == "" and "layout: INVALID" in out
    assert len(out) <= 2 * size, (len(out), size)
    assert "K" * 160 + "... (200000 chars)" in out and "T" * 160 + "... (100000 chars)" in out
    assert "'" + "v" * 120 + "'... (100000 chars)" in out
    assert max(len(line) for line in out.splitlines() if line.startswith("  k")) < 100


def test_unprintable_characters_are_escaped(tmp_path, capsys):
    p = tmp_path / "esc.gguf"
    _hostile_gguf(p, [b"evil\x1b[2J\x07key", "bidi\u202eyek".encode()],
                  {b"name\\path": "x\x1b]0;title\x07 \u202egnp.exe".encode(), b"s": "\x00\u2028".encode()},
                  b"t\x1b[31mred\r")
    rc, out, _ = _run(capsys, p)
    assert rc == 1
    for raw in ("\x1b", "\x07", "\u202e", "\r", "\x00", "\u2028"):
        assert raw not in out, repr(raw)
    assert "evil\\x1b[2J\\x07key" in out and "bidi\\u202eyek" in out and "name\\\\path" in out
    assert "t\\x1b[31mred\\r" in out and "'x\\x1b]0;title\\x07 \\u202egnp.exe'" in out
    rc, out, _ = _run(capsys, p, "--json")
    assert all(ch == "\n" or " " <= ch < "\x7f" for ch in out), "JSON output is printable ASCII"
    info = json.loads(out)  # and still exact
    assert "evil\x1b[2J\x07key" in info["metadata"] and info["tensors"][0]["name"] == "t\x1b[31mred\r"
    assert info["metadata"]["name\\path"]["value"] == "x\x1b]0;title\x07 \u202egnp.exe"


def test_long_nested_arrays_read_in_place_are_summarized(tmp_path, capsys):
    from ds4_mlx.formats.gguf import LAZY_ARRAY_MIN

    n = LAZY_ARRAY_MIN + 1
    p = tmp_path / "nested.gguf"
    inner = struct.pack("<IQ", 0, n) + bytes(range(256)) * (n // 256) + b"\x07" * (n % 256)  # u8[n]
    kv = _s(b"nested") + struct.pack("<IIQ", 9, 9, 1) + inner
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)
    rc, out, _ = _run(capsys, p, "--json")
    summary = json.loads(out)["metadata"]["nested"]
    assert rc == 1 and summary["count"] == 1 and summary["head"][0]["count"] == n
    assert summary["head"][0]["head"] == list(range(8)) and summary["head"][0]["truncated"] is True
    rc, out, _ = _run(capsys, p)
    assert rc == 1 and f"ARRAY[1]       [[0, 1, 2, 3, 4, 5, 6, 7, ... ({n - 8} more)]]" in out
