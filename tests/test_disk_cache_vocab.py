"""DiskCache (engine/disk_cache.py) against a ``.kv`` file whose stored token list holds a token id
outside the vocabulary while every checksum is valid (#26 item 8): the request that finds it is
served (next-best entry or a cold prefill), the file is logged once and never offered again, and
nothing stored is lost. On the tiny model."""

from __future__ import annotations

import logging

import pytest

from ds4_mlx.engine.disk_cache import DiskCache
from ds4_mlx.engine.engine import Engine
from ds4_mlx.engine.kvstore_policy import KVStoreOptions

CTX = 512
CHUNK = 32
OPTS = KVStoreOptions(min_tokens=16, cold_max_tokens=30000, continued_interval_tokens=0,
                      boundary_trim_tokens=0, boundary_align_tokens=CHUNK)
TEXT = ("a fairly long question about the weather in Milan and in Turin during the winter, "
        "with a few more words so that the prompt holds enough tokens for the cache")


@pytest.fixture(scope="module")
def engine(tiny_model_path) -> Engine:
    return Engine.open(tiny_model_path)


def cache(engine, d) -> DiskCache:
    return DiskCache(engine, d, 64, ctx=CTX, options=OPTS)


def plant_oov(engine, dc: DiskCache, prefix: list[int], index: int) -> tuple:
    """A checkpoint of ``prefix`` whose text and payload are right, but whose stored token list
    has an out-of-vocabulary id at ``index``: written through the store, so every crc is valid."""
    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    s.sync(prefix)
    bad = list(prefix)
    bad_id = engine.config.n_vocab + 7
    bad[index] = bad_id
    text = engine.tokenizer.decode_bytes(prefix)
    entry = dc.store.store(bad, text, s.payload_chunks(), "cold")
    assert entry is not None
    return entry, bad_id


def test_out_of_vocab_token_in_a_valid_file_is_skipped_logged_once_and_kept(engine, tmp_path, caplog):
    prompt = engine.encode_prompt(TEXT, ctx=CTX)
    dc = cache(engine, tmp_path)
    # a valid, shorter checkpoint: the next-best entry the lookup must fall back to
    good = engine.new_session(ctx=CTX, chunk=CHUNK)
    good.sync(prompt[:20])
    assert dc.save(good, "cold").stored
    entry, bad_id = plant_oov(engine, dc, prompt[:len(prompt) - 4], index=5)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.kv")}

    with caplog.at_level(logging.INFO, logger="ds4_mlx"):
        report = dc.sync(engine.new_session(ctx=CTX, chunk=CHUNK), prompt)
    assert report.source == "disk-tokens" and report.cached_tokens == 20
    assert report.effective_prompt == prompt
    assert any(entry.path.name in r and str(bad_id) in r for r in report.refused)
    named = [r for r in caplog.records if entry.path.name in r.getMessage() and str(bad_id) in r.getMessage()]
    assert len(named) == 1 and named[0].levelno == logging.WARNING

    # the next request: the file is not offered again and not logged again
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds4_mlx"):
        again = dc.sync(engine.new_session(ctx=CTX, chunk=CHUNK), prompt)
    assert again.source == "disk-tokens" and again.cached_tokens == 20
    assert not again.refused
    assert not [r for r in caplog.records if entry.path.name in r.getMessage()]
    # nothing stored was lost or changed (the good file's hit count aside)
    assert entry.path.read_bytes() == before[entry.path.name]
    assert {p.name for p in tmp_path.glob("*.kv")} == set(before)


def test_out_of_vocab_token_alone_means_a_cold_prefill(engine, tmp_path):
    prompt = engine.encode_prompt(TEXT, ctx=CTX)
    dc = cache(engine, tmp_path)
    entry, bad_id = plant_oov(engine, dc, prompt[:len(prompt) - 4], index=len(prompt) - 5)
    report = dc.sync(engine.new_session(ctx=CTX, chunk=CHUNK), prompt)
    assert report.source == "none" and report.effective_prompt == prompt
    assert any(str(bad_id) in r for r in report.refused)
    assert entry.path.exists()
    # a fresh process (new DiskCache) skips it the same way, with no error
    again = cache(engine, tmp_path).sync(engine.new_session(ctx=CTX, chunk=CHUNK), prompt)
    assert again.source in ("none", "disk-tokens") and again.effective_prompt == prompt
