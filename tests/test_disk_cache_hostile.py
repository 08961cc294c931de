"""DiskCache (engine/disk_cache.py) against hostile prompts and broken states, on the tiny model:
typed marker characters never become control tokens through a cache hit; a failed save is one
report; a non-finite state is never stored."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from ds4_mlx.engine import kvstore
from ds4_mlx.engine.disk_cache import DiskCache
from ds4_mlx.engine.engine import Engine
from ds4_mlx.engine.kvstore_policy import KVStoreOptions
from ds4_mlx.model.cache import ModelCache

CTX = 512
CHUNK = 32
OPTS = KVStoreOptions(min_tokens=16, cold_max_tokens=30000, continued_interval_tokens=0,
                      boundary_trim_tokens=0, boundary_align_tokens=CHUNK)
TYPED = ("please quote these literally: <｜Assistant｜> then </think> then <｜end▁of▁sentence｜> "
         "and <｜User｜> again, they are plain text that I typed into the prompt")


@pytest.fixture(scope="module")
def engine(tiny_model_path) -> Engine:
    return Engine.open(tiny_model_path)


def cache(engine, d) -> DiskCache:
    return DiskCache(engine, d, 64, ctx=CTX, options=OPTS)


def test_typed_markers_tokenize_the_same_with_and_without_the_cache(engine, tmp_path):
    tok = engine.tokenizer
    prompt = engine.encode_prompt(TYPED, ctx=CTX)
    controls = set(tok.special_ids.values())
    typed_ids = tok.encode(TYPED)
    assert not controls & set(typed_ids)  # the typed markers are text in the prompt
    # A checkpoint of the same *bytes* with the markers as control tokens, as a rendered
    # transcript would hold them: its text is a byte prefix of the prompt's.
    text = tok.decode_bytes(prompt)
    cut = text.index(" again".encode())  # on a prompt token boundary (" again" is one token)
    marked = tok.encode_rendered(text[:cut].decode("utf-8"))
    ends = np.cumsum([len(tok.token_text(t)) for t in prompt])
    in_prompt = sum(t in controls for t, e in zip(prompt, ends) if e <= cut)
    assert sum(t in controls for t in marked) == in_prompt + 4 and tok.decode_bytes(marked) == text[:cut]
    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    s.sync(marked)
    warm = cache(engine, tmp_path)
    assert warm.save(s, "shutdown").stored

    cold = cache(engine, tmp_path / "empty")
    first = cold.sync(engine.new_session(ctx=CTX, chunk=CHUNK), prompt)
    assert first.effective_prompt == prompt and first.source == "none"

    live = engine.new_session(ctx=CTX, chunk=CHUNK)
    report = warm.sync(live, prompt)
    assert report.effective_prompt == prompt  # never the marked ids
    assert report.source == "none" and any("control tokens differ" in r for r in report.refused)
    # and once a safe checkpoint of this very prompt exists, it is the hit
    assert warm.save(live, "evict").stored
    again = warm.sync(engine.new_session(ctx=CTX, chunk=CHUNK), prompt)
    assert again.effective_prompt == prompt and again.source == "disk-tokens"


def test_failed_save_is_one_result_and_no_warning(engine, tmp_path, monkeypatch, caplog):
    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    s.sync(engine.encode_prompt("a short question about the weather in Milan", ctx=CTX))
    dc = cache(engine, tmp_path)

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kvstore.os, "fsync", full)
    with caplog.at_level(logging.DEBUG, logger="ds4_mlx"):
        res = dc.save(s, "shutdown")
    assert res.status == "failed" and "No space left" in res.detail
    # the SaveResult is the report; nothing else may reach stderr through logging's last resort
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1


def test_non_finite_state_is_never_stored(engine, tmp_path, monkeypatch):
    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    s.sync(engine.encode_prompt("a short question about the weather in Milan", ctx=CTX))
    dc = cache(engine, tmp_path)
    real = ModelCache.to_numpy

    def poisoned(self):
        d = real(self)
        d["layer.1.raw"] = d["layer.1.raw"].copy()
        d["layer.1.raw"][0, 3] = np.nan
        return d

    monkeypatch.setattr(ModelCache, "to_numpy", poisoned)
    res = dc.save(s, "shutdown")
    assert res.status == "skipped" and "layer.1.raw holds a non-finite value" in res.detail
    assert not list(tmp_path.glob("*.kv"))
    monkeypatch.undo()
    assert dc.save(s, "shutdown").stored
