"""`ds4-mlx kv ls / inspect / prune` through ds4_mlx.frontends.cli.main."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ds4_mlx.engine.kvstore import KVStore
from ds4_mlx.engine.kvstore_format import read_entry
from ds4_mlx.engine.kvstore_scan import LOCK_NAME
from ds4_mlx.frontends.cli import main

MODEL = b"model-fingerprint"
T0 = 1_700_000_000  # 2023-11-14 22:13:20 UTC


class Clock:
    def __init__(self):
        self.t = T0

    def __call__(self):
        return self.t


@pytest.fixture()
def cache(tmp_path):
    clock = Clock()
    store = KVStore(tmp_path, 64, model_id=MODEL, quant_bits=4, ctx=32768, clock=clock)
    rng = np.random.default_rng(0)
    long_text = "<｜User｜>line one\nline\ttwo " + "x" * 200 + " the end\x07"
    a = store.store(rng.integers(0, 1000, 700).tolist(), long_text, bytes(5000), "cold")
    clock.t += 60
    b = store.store(rng.integers(0, 1000, 2048).tolist(), b"short \xff text", bytes(9000), "continued",
                    tool_map={"call_9": "dsml"})
    clock.t += 60
    store.load(b)
    return tmp_path, a, read_entry(b.path), long_text


def test_ls_table(cache, capsys):
    d, a, b, _ = cache
    assert main(["kv", "ls", str(d)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["FILE", "TOKENS", "SIZE", "REASON", "HITS", "LAST", "USE", "(UTC)", "SCORE",
                                "TEXT"]
    assert lines[1].startswith(b.name) and lines[2].startswith(a.name)  # most recent use first
    row_b, row_a = lines[1], lines[2]
    assert "2048" in row_b and "continued" in row_b and " 1 " in row_b and "2023-11-14 22:15:20" in row_b
    assert "short \\xff text" in row_b
    assert "700" in row_a and "cold" in row_a and "2023-11-14 22:13:20" in row_a
    # first and last 40 characters, controls escaped
    assert "<｜User｜>line one\\nline\\ttwo xxxxxxxxx" in row_a and "xxxxx the end\\x07" in row_a
    assert lines[-2].startswith("2 valid, 0 invalid")
    # effective scores (b's hit of 2023 has long decayed to nothing): a is a cold anchor, x2
    assert f" {2 * 700 / a.file_size:.4g}* " in row_a and f" {2048 / b.file_size:.4g} " in row_b
    assert lines[-1].startswith("* score = ")


def test_ls_json_and_invalid_files(cache, capsys):
    d, a, b, long_text = cache
    bad = d / ("0" * 40 + ".kv")
    bad.write_bytes(b"KVC junk")
    assert main(["kv", "ls", str(d), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_file = {r["file"]: r for r in rows}
    ra = by_file[a.name]
    assert (ra["tokens"], ra["size"], ra["reason"], ra["hits"], ra["quant_bits"], ra["ctx_size"]) == \
        (700, a.file_size, "cold", 0, 4, 32768)
    assert ra["text_head"] == long_text[:40].replace("\n", "\\n").replace("\t", "\\t")
    assert ra["text_tail"] == long_text[-40:].replace("\x07", "\\x07")
    assert ra["model_id"] == MODEL.hex() and by_file[b.name]["hits"] == 1
    assert by_file[bad.name]["valid"] is False and "truncated" in by_file[bad.name]["problem"]
    assert ra["base_score"] == pytest.approx(700 / a.file_size)
    assert ra["score"] == pytest.approx(2 * 700 / a.file_size) and ra["score_note"] == "anchor x2"
    assert by_file[b.name]["score"] == pytest.approx(2048 / b.file_size)
    assert by_file[bad.name]["score"] == 0
    assert main(["kv", "ls", str(d)]) == 0
    assert "INVALID: truncated" in capsys.readouterr().out


def test_inspect_valid_file(cache, capsys):
    _, _, b, _ = cache
    assert main(["kv", "inspect", str(b.path)]) == 0
    out = capsys.readouterr().out
    fields = {line[:16].strip(): line[16:].strip() for line in out.splitlines()}
    assert fields["magic"] == "KVC" and fields["quant bits"] == "4" and fields["tokens"] == "2048"
    assert fields["reason"] == "continued (2)" and fields["hits"] == "1" and fields["ctx size"] == "32768"
    assert fields["ext flags"] == "0x81 (tool-map, ds4-mlx)"
    assert fields["payload bytes"] == "9000" and fields["text bytes"] == str(len(b"short \xff text"))
    assert fields["model id"] == MODEL.hex() and fields["tool map"].endswith("1 entries")
    assert fields["header crc"].endswith("(ok)") and fields["file crc"].endswith("(ok)")
    assert fields["verdict"] == "valid"
    assert main(["kv", "inspect", str(b.path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["valid"] and rep["header"]["tokens"] == 2048 and rep["file_crc"] == "ok"
    assert rep["trailer"]["payload_version"] == 1 and rep["tool_map_entries"] == 1


def test_inspect_damaged_file(cache, capsys):
    _, a, _, _ = cache
    raw = bytearray(a.path.read_bytes())
    raw[len(raw) - 68 - 4 * 700 - 100] ^= 4  # inside the payload
    a.path.write_bytes(raw)
    assert main(["kv", "inspect", str(a.path)]) == 1
    out = capsys.readouterr().out
    assert "INVALID: file checksum mismatch" in out and "(mismatch)" in out
    raw[13] ^= 1  # hit count: caught by the header crc
    a.path.write_bytes(raw)
    assert main(["kv", "inspect", str(a.path), "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert not rep["valid"] and "header checksum mismatch" in rep["problems"][0]
    assert rep["header"]["header_crc_ok"] is False


def test_inspect_missing_file_is_an_error(tmp_path, capsys):
    assert main(["kv", "inspect", str(tmp_path / "nope.kv")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["kv", "ls", str(tmp_path / "nodir")]) == 2


@pytest.mark.parametrize("ds4_head", [True, False])
def test_prune_to_budget(cache, capsys, ds4_head):
    d, a, b, _ = cache
    # a: cold, 700 tokens / ~8 KB; b: continued, 2048 tokens / ~17 KB, its 2023 hit long decayed.
    # ds4 HEAD: a has the lower density and goes; ds4-mlx: a is an anchor (x2), so b goes.
    assert 700 / a.file_size < 2048 / b.file_size < 2 * 700 / a.file_size
    victim, kept = (a, b) if ds4_head else (b, a)
    flag = ["--ds4-head"] if ds4_head else []
    budget_mb = (b.file_size + 100) / 2**20
    assert main(["kv", "prune", str(d), "--budget-mb", str(budget_mb), *flag]) == 0
    out = capsys.readouterr().out
    assert f"removed {victim.name} tokens={victim.tokens}" in out and "1 removed, 1 kept" in out
    assert not victim.path.exists() and kept.path.exists()
    assert main(["kv", "prune", str(d), "--budget-mb", "0", "--json", *flag]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["file"] for r in rep["removed"]] == [kept.name] and rep["total_bytes"] == 0
    assert rep["removed"][0]["score_note"] == ("anchor x2" if kept is a and not ds4_head else "")
    assert [n for n in os.listdir(d) if n != LOCK_NAME] == []
    assert main(["kv", "prune", str(d), "--budget-mb", "-1"]) == 2


def test_prune_waits_the_plans_lock_timeout(tmp_path, capsys, monkeypatch):
    """``kv prune`` loads no model: it takes DS4_MLX_KV_LOCK_TIMEOUT through the load plan's reader
    (``load_plan.kv_lock_timeout``), and a bad value is one line naming the variable."""
    from ds4_mlx.engine import kvstore_admin

    seen = []
    real = kvstore_admin.prune
    monkeypatch.setattr(kvstore_admin, "prune", lambda *a, **kw: seen.append(kw["lock_timeout"]) or real(*a, **kw))
    monkeypatch.setenv("DS4_MLX_KV_LOCK_TIMEOUT", "0.3")
    assert main(["kv", "prune", str(tmp_path), "--budget-mb", "0"]) == 0
    assert seen == [0.3]
    capsys.readouterr()
    monkeypatch.setenv("DS4_MLX_KV_LOCK_TIMEOUT", "later")
    assert main(["kv", "prune", str(tmp_path), "--budget-mb", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ds4-mlx kv: error: DS4_MLX_KV_LOCK_TIMEOUT='later' is not a number of seconds"]
