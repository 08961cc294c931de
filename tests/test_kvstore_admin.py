"""The store's maintenance surface (kvstore_admin): list, inspect, prune, as ``ds4-mlx kv`` uses them."""

from __future__ import annotations

import os

import pytest

from ds4_mlx.engine.kvstore import KVStore
from ds4_mlx.engine.kvstore_admin import inspect_file, list_entries, prune
from ds4_mlx.errors import KVStoreError

T0 = 1_700_000_000


def _store(d):
    return KVStore(d, 64, model_id=b"m", quant_bits=4, ctx=4096, clock=lambda: T0)


def test_list_inspect_prune(tmp_path):
    store = _store(tmp_path)
    a = store.store(list(range(600)), "first \xe9 text", bytes(5000), "cold")
    b = store.store(list(range(700)), b"second \xff", bytes(9000), "continued")
    (tmp_path / ("0" * 40 + ".kv")).write_bytes(b"KVC garbage")  # damaged: listed, invalid
    os.mkfifo(tmp_path / ("1" * 40 + ".kv"))  # never listed, never opened
    listing = list_entries(tmp_path, now=T0)
    assert (listing.valid, listing.invalid) == (2, 1)
    by_name = {f.name: f for f in listing.files}
    assert set(by_name) == {a.name, b.name, "0" * 40 + ".kv"}
    assert by_name[a.name].entry.tokens == 600 and by_name[a.name].text_head == "first \xe9 text"
    assert by_name[b.name].text_head == b"second \xff".decode("utf-8", "surrogateescape")
    bad = by_name["0" * 40 + ".kv"]
    assert bad.entry is None and bad.problem and bad.score.score == 0
    assert listing.total_bytes == a.file_size + b.file_size + bad.size

    report = inspect_file(a.path)
    assert report["problems"] == [] and report["file_crc"] == "ok"
    assert report["header"]["tokens"] == 600 and report["header"]["reason"] == "cold"
    assert inspect_file(bad.path)["problems"]

    pruned = prune(tmp_path, a.file_size + b.file_size, now=T0)
    assert [ev.path.name for ev in pruned.removed] == [bad.name]  # damaged goes first
    assert pruned.within_budget and pruned.kept_files == 2
    pruned = prune(tmp_path, 0, now=T0)
    assert pruned.kept_files == 0 and pruned.total_bytes == 0 and len(pruned.removed) == 2
    assert (tmp_path / ("1" * 40 + ".kv")).exists()  # the FIFO is not the store's to delete


def test_hostile_arguments(tmp_path):
    with pytest.raises(KVStoreError, match="does not exist"):
        list_entries(tmp_path / "missing")
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(KVStoreError, match="not a directory"):
        prune(tmp_path / "f", 0)
    with pytest.raises(KVStoreError, match="must be >= 0"):
        prune(tmp_path, -1)
    with pytest.raises(KVStoreError, match="bad magic"):
        inspect_file(tmp_path / "f")
    with pytest.raises(KVStoreError, match="not a regular file"):
        inspect_file(tmp_path)
