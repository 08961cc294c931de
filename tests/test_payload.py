"""Session payload format: exact round trip, the documented layout, and every refusal.

States here are synthetic (shaped by the tiny model's config, canonical frontiers, f16-exact rows
as the model makes them), so no forward pass is needed; ``test_session.py`` round-trips real ones.
The layout is re-parsed from the offsets written in ``payload.py``'s docstring, not with its code.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import struct
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from ds4_mlx.engine import payload as P
from ds4_mlx.engine.payload import PayloadError
from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.formats.gguf import GGUFFile

MODEL_ID = hashlib.sha256(b"test model").digest()
EMPTY = np.float32(-1.0e30)


@pytest.fixture(scope="module")
def cfg(tiny_model_path) -> ModelConfig:
    with GGUFFile(tiny_model_path) as f:
        return ModelConfig.from_gguf(f)


def synthetic_arrays(cfg: ModelConfig, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A state of n tokens as spec §9.2 / §6.3 describe it: f16-exact rows, canonical frontiers."""
    rng = np.random.default_rng(seed)

    def rows(k: int, d: int) -> np.ndarray:
        return rng.standard_normal((k, d)).astype(np.float16).astype(np.float32)

    out = {}
    for il in range(cfg.n_layer):
        r = cfg.compress_ratio(il)
        out[f"layer.{il}.raw"] = rows(min(n, cfg.n_swa), cfg.head_dim)
        lanes = ([("attn", cfg.head_dim)] if r else []) + ([("index", cfg.indexer_head_dim)] if r == 4 else [])
        for lane, d in lanes:
            coff = 2 if r == 4 else 1
            live = (4 if n >= 4 else 0) + n % 4 if r == 4 else n % r
            k = np.zeros((coff * r, coff * d), np.float32)
            g = np.full((coff * r, coff * d), EMPTY, np.float32)
            k[:live] = rng.standard_normal((live, coff * d))
            g[:live] = rng.standard_normal((live, coff * d))
            out[f"layer.{il}.{lane}.rows"] = rows(n // r, d)
            out[f"layer.{il}.{lane}.kst"] = k
            out[f"layer.{il}.{lane}.gst"] = g
    return out


def make(cfg, n=140, *, ctx=1024, chunk=2048, seed=0, arrays=None, tokens=None):
    rng = np.random.default_rng(seed + 1)
    tokens = list(rng.integers(0, cfg.n_vocab, n)) if tokens is None else tokens
    logits = rng.standard_normal(cfg.n_vocab).astype(np.float32)
    arrays = synthetic_arrays(cfg, n, seed) if arrays is None else arrays
    pieces = P.encode(cfg, model_id=MODEL_ID, ctx=ctx, chunk=chunk, numerics="default",
                      tokens=tokens, logits=logits, arrays=arrays)
    return b"".join(bytes(p) for p in pieces), tokens, logits, arrays


def load(cfg, data, *, ctx=1024, chunk=2048, model_id=MODEL_ID, **kw):
    return P.decode(data, cfg, model_id=model_id, ctx=ctx, chunk=chunk, **kw)


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def walk(cfg, data: bytes):
    """Independent parse of the documented layout: header fields, then the record headers."""
    n_layer = cfg.n_layer
    h = struct.unpack_from("<8sII32s12I", data, 0)
    n = h[12]
    H = 96 + 4 * n_layer
    off = H + 4 * n + 4 * cfg.n_vocab
    records = []
    while off < len(data) - 4:
        layer, lane, field, dtype, rows, cols, stored = struct.unpack_from("<HBBB3xIII", data, off)
        records.append(dict(off=off, layer=layer, lane=lane, field=field, dtype=dtype, rows=rows, cols=cols,
                            stored=stored))
        off += 20 + stored * cols * (2 if dtype == 2 else 4)
    return h, H, records, off


def with_crc(data: bytes) -> bytes:
    body = data[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def patch(data: bytes, off: int, fmt: str, *values) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, off, *values)
    return with_crc(bytes(b))


# -- round trip and layout -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 4, 31, 127, 128, 129, 140, 300])
def test_round_trip_is_exact(cfg, n):
    data, tokens, logits, arrays = make(cfg, n, seed=n)
    got = load(cfg, data)
    assert got.tokens == [int(t) for t in tokens] and got.ctx == 1024 and got.chunk == 2048
    assert got.numerics == "default" and got.model_id == MODEL_ID
    assert np.array_equal(bits(got.logits), bits(logits))
    assert got.arrays.keys() == arrays.keys()
    for k, a in arrays.items():
        assert got.arrays[k].shape == a.shape and np.array_equal(bits(got.arrays[k]), bits(a)), k
    # the same bytes through a file object
    again = P.decode(io.BytesIO(data), cfg, model_id=MODEL_ID, ctx=1024, chunk=2048)
    assert again.tokens == got.tokens


def test_layout_matches_documentation(cfg):
    n = 140
    data, tokens, logits, arrays = make(cfg, n)
    h, H, records, end = walk(cfg, data)
    assert h[0] == b"DS4MLXSP" and h[1] == 1 and h[2] == H and h[3] == MODEL_ID
    assert h[4:10] == (cfg.n_layer, cfg.n_embd, cfg.n_vocab, cfg.head_dim, cfg.indexer_head_dim, cfg.n_swa)
    assert h[10:16] == (1024, 2048, n, 0, 0, len(records))
    assert list(np.frombuffer(data, "<u4", cfg.n_layer, 96)) == list(cfg.compress_ratios)
    assert list(np.frombuffer(data, "<u4", n, H)) == [int(t) for t in tokens]
    assert np.array_equal(np.frombuffer(data, "<f4", cfg.n_vocab, H + 4 * n), logits)
    assert end == len(data) - 4
    assert struct.unpack_from("<I", data, end)[0] == zlib.crc32(data[:end])
    for rec in records:
        r = cfg.compress_ratio(rec["layer"])
        if rec["field"] == 0:  # raw / rows arrays: whole, and f16 since they are f16-exact
            assert rec["stored"] == rec["rows"] and (rec["dtype"] == 2 or rec["rows"] == 0)
        else:  # frontiers: the partial window only (spec §6.3), f32
            live = 4 + n % 4 if r == 4 else n % r
            assert (rec["rows"], rec["stored"], rec["dtype"]) == (2 * r if r == 4 else r, live, 1)
    assert len(records) == len(P.expected_arrays(cfg, n))


def test_growth_per_token_is_half_the_f32_state_plus_the_token_id(cfg):
    """Between n and n + 128·4 tokens (same window phases) the payload grows by the compressed and
    indexer rows at 2 bytes per element and 4 bytes per token id; spec §9.2 counts 4 bytes per
    element."""
    a = len(make(cfg, 140)[0])
    b = len(make(cfg, 140 + 512)[0])
    per_token = (b - a) / 512
    assert per_token == 4 + P.compressed_bytes_per_token(cfg) / 2
    f32 = sum((cfg.head_dim * 4 / r if r else 0) + (cfg.indexer_head_dim if r == 4 else 0)
              for r in cfg.compress_ratios[:cfg.n_layer])
    assert P.compressed_bytes_per_token(cfg) == f32


def test_non_f16_values_fall_back_to_f32_exactly(cfg):
    arrays = synthetic_arrays(cfg, 140)
    arrays["layer.3.attn.rows"][0, 5] = np.float32(1 / 3)  # not representable in f16
    arrays["layer.0.raw"][1, 1] = np.float32(-0.0)  # f16 keeps the sign of zero
    arrays["layer.2.attn.kst"][7, 3] = np.float32(2.5)  # a stray value after the live rows
    data, _, _, _ = make(cfg, 140, arrays=arrays)
    recs = {(r["layer"], r["lane"], r["field"]): r for r in walk(cfg, data)[2]}
    assert recs[(3, 1, 0)]["dtype"] == 1 and recs[(0, 0, 0)]["dtype"] == 2
    assert recs[(2, 1, 1)]["stored"] == 8  # no longer a canonical tail: stored whole
    got = load(cfg, data)
    for k, a in arrays.items():
        assert np.array_equal(bits(got.arrays[k]), bits(a)), k


def test_ctx_rules(cfg):
    data = make(cfg, 140, ctx=1024)[0]
    assert load(cfg, data, ctx=4096).ctx == 1024  # a smaller ctx's state fits a larger session
    with pytest.raises(PayloadError, match=r"saved for ctx 1024.*byte offset 72"):
        load(cfg, data, ctx=512)
    full = make(cfg, 141, ctx=141)[0]  # a session filled to its ctx saves, but cannot continue
    with pytest.raises(PayloadError, match=r"token count 141.*byte offset 80"):
        load(cfg, full, ctx=141)
    assert len(load(cfg, full, ctx=142).tokens) == 141


# -- refusals ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(cfg) -> bytes:
    return make(cfg, 140)[0]


@pytest.mark.parametrize("off,fmt,value,pattern", [
    (0, "<8s", b"DS4MLXSQ", r"bad magic.*byte offset 0\)"),
    (8, "<I", 2, r"version 2 .*byte offset 8\)"),
    (12, "<I", 97, r"header size 97.*byte offset 12\)"),
    (16, "<32s", hashlib.sha256(b"other").digest(), r"another model.*byte offset 16\)"),
    (48, "<I", 7, r"n_layer is 7.*byte offset 48\)"),
    (52, "<I", 1024, r"n_embd is 1024.*byte offset 52\)"),
    (56, "<I", 1000, r"n_vocab is 1000.*byte offset 56\)"),
    (60, "<I", 512, r"head_dim is 512.*byte offset 60\)"),
    (64, "<I", 64, r"indexer_head_dim is 64.*byte offset 64\)"),
    (68, "<I", 128, r"n_swa is 128.*byte offset 68\)"),
    (76, "<I", 4096, r"prefill chunk 4096.*byte offset 76\)"),
    (84, "<I", 9, r"numerics code 9.*byte offset 84\)"),
    (92, "<I", 5, r"5 array records.*byte offset 92\)"),
    (96 + 4 * 3, "<I", 4, r"layer 3 compress ratio 4.*byte offset 108\)"),
])
def test_header_mismatch_refused(cfg, good, off, fmt, value, pattern):
    with pytest.raises(PayloadError, match=pattern):
        load(cfg, patch(good, off, fmt, value))


def test_token_out_of_vocabulary_refused(cfg, good):
    H = 96 + 4 * cfg.n_layer
    with pytest.raises(PayloadError, match=rf"token id {cfg.n_vocab} at index 7.*byte offset {H + 28}\)"):
        load(cfg, patch(good, H + 28, "<I", cfg.n_vocab))


def test_record_mismatch_refused(cfg, good):
    recs = walk(cfg, good)[2]
    first_attn = next(r for r in recs if r["lane"] == 1)
    o = first_attn["off"]
    with pytest.raises(PayloadError, match=rf"layer.2.index.rows where layer.2.attn.rows was expected.*offset {o}\)"):
        load(cfg, patch(good, o + 2, "<B", 2))
    with pytest.raises(PayloadError, match=rf"unknown dtype code 7.*offset {o + 4}\)"):
        load(cfg, patch(good, o + 4, "<B", 7))
    rows = first_attn["rows"]
    msg = rf"shape \({rows + 1}, 256\), 140 tokens imply \({rows}, 256\).*offset {o + 8}\)"
    with pytest.raises(PayloadError, match=msg):
        load(cfg, patch(good, o + 8, "<I", rows + 1))
    with pytest.raises(PayloadError, match=rf"stores {rows - 1} of its {rows} rows.*offset {o + 16}\)"):
        load(cfg, patch(good, o + 16, "<I", rows - 1))
    kst = next(r for r in recs if r["lane"] == 1 and r["field"] == 1)
    with pytest.raises(PayloadError, match=r"stores 9 of its 8 rows"):
        load(cfg, patch(good, kst["off"] + 16, "<I", 9))


def test_truncation_refused_everywhere(cfg, good):
    H = 96 + 4 * cfg.n_layer
    recs = walk(cfg, good)[2]
    cuts = [0, 5, 95, H - 1, H + 3, H + 4 * 140 + 10, recs[0]["off"] + 3, recs[0]["off"] + 21,
            recs[len(recs) // 2]["off"] + 30, len(good) - 4, len(good) - 1]
    for cut in cuts:
        with pytest.raises(PayloadError, match=r"truncated payload: .* at byte offset \d+ needs \d+ bytes"):
            load(cfg, good[:cut])
        with pytest.raises(PayloadError, match=r"truncated payload: .* the file ends after"):
            P.decode(io.BytesIO(good[:cut]), cfg, model_id=MODEL_ID, ctx=1024, chunk=2048)
    with pytest.raises(PayloadError, match=rf"record header at byte offset {recs[0]['off']} "):
        load(cfg, good[:recs[0]["off"] + 3])


def test_trailing_bytes_and_size_bound(cfg, good):
    with pytest.raises(PayloadError, match=rf"trailing bytes.*byte offset {len(good)}\)"):
        load(cfg, good + b"\0")
    with pytest.raises(PayloadError, match=r"trailing bytes"):
        P.decode(io.BytesIO(good + b"KTM"), cfg, model_id=MODEL_ID, ctx=1024, chunk=2048)
    # a payload followed by someone else's trailer reads fine when its size is given
    fp = io.BytesIO(good + b"KTM-trailer")
    assert len(P.decode(fp, cfg, model_id=MODEL_ID, ctx=1024, chunk=2048, size=len(good)).tokens) == 140
    assert fp.read() == b"KTM-trailer"
    assert len(load(cfg, good + b"xyz", size=len(good)).tokens) == 140
    with pytest.raises(PayloadError, match=r"truncated"):
        load(cfg, good, size=len(good) - 1)


def test_corruption_refused_by_checksum(cfg, good):
    H = 96 + 4 * cfg.n_layer
    b = bytearray(good)
    b[H + 4 * 140 + 1000] ^= 0x10  # one bit of one logit
    with pytest.raises(PayloadError, match=rf"checksum .* does not match.*byte offset {len(good) - 4}\)"):
        load(cfg, bytes(b))


def test_encode_refuses_inconsistent_state(cfg):
    arrays = synthetic_arrays(cfg, 140)
    arrays["layer.2.attn.rows"] = arrays["layer.2.attn.rows"][:-1]
    with pytest.raises(PayloadError, match=r"layer.2.attn.rows has shape \(34, 256\), 140 tokens imply \(35, 256\)"):
        make(cfg, 140, arrays=arrays)
    with pytest.raises(PayloadError, match="token ids"):
        make(cfg, 3, tokens=[1, 2, cfg.n_vocab])


def test_model_fingerprint_covers_header_and_a_sample_of_every_tensor(tmp_path):
    blob = bytes(range(256)) * 400  # 102400 bytes
    path = tmp_path / "m.gguf"
    path.write_bytes(blob)
    small = SimpleNamespace(offset=5000, nbytes=1000)  # hashed whole
    big = SimpleNamespace(offset=6000, nbytes=96000)  # sampled: 16 blocks of 4 KiB
    f = SimpleNamespace(path=str(path), info_end=5000, tensors={"b": big, "a": small})
    spans = P.fingerprint_spans(6000, 96000)
    assert len(spans) == 16 and spans[0] == (6000, 4096) and spans[-1] == (102000 - 4096, 4096)
    want = hashlib.sha256(blob[:5000] + blob[5000:6000]
                          + b"".join(blob[o:o + n] for o, n in spans)).digest()
    fid = P.model_fingerprint(f)
    assert fid == want and len(fid) == 32

    def flipped(at: int) -> bytes:
        changed = bytearray(blob)
        changed[at] ^= 1
        path.write_bytes(bytes(changed))
        try:
            return P.model_fingerprint(f)
        finally:
            path.write_bytes(blob)

    assert flipped(4999) != fid  # tensor table / metadata
    assert flipped(5500) != fid  # a small tensor, anywhere in it
    for o, n in (spans[0], spans[7], spans[-1]):  # any sampled block of a large tensor
        assert flipped(o) != fid and flipped(o + n - 1) != fid
    assert flipped(spans[1][0] - 1) == fid  # between samples: documented blind spot
    path.write_bytes(blob[:100])
    with pytest.raises(PayloadError, match="before the GGUF header"):
        P.model_fingerprint(f)
    path.write_bytes(blob[:50000])
    with pytest.raises(PayloadError, match="before the tensor data"):
        P.model_fingerprint(f)


def test_model_fingerprint_tells_apart_models_that_differ_only_in_weights(tmp_path, tiny_model_path):
    from ds4_mlx.formats.gguf import GGUFFile

    copy = tmp_path / "retrained.gguf"
    shutil.copyfile(tiny_model_path, copy)
    with GGUFFile(tiny_model_path) as g:
        original = P.model_fingerprint(g)
        t = max(g.tensors.values(), key=lambda t: t.nbytes)
        header = open(tiny_model_path, "rb").read(g.info_end)
    with open(copy, "r+b") as fh:  # "retrain" the largest tensor: rewrite one of its blocks
        fh.seek(t.offset)
        block = bytes(b ^ 0x5A for b in fh.read(4096))
        fh.seek(t.offset)
        fh.write(block)
    with GGUFFile(copy) as g:
        assert open(copy, "rb").read(g.info_end) == header  # same header, same layout
        assert P.model_fingerprint(g) != original


def test_non_finite_state_is_never_encoded(cfg):
    arrays = synthetic_arrays(cfg, 140)
    arrays["layer.2.attn.rows"][3, 5] = np.nan
    with pytest.raises(P.NonFiniteStateError, match=r"state array layer.2.attn.rows holds a non-finite"):
        make(cfg, 140, arrays=arrays)
    arrays = synthetic_arrays(cfg, 140)
    arrays["layer.0.raw"][0, 0] = np.inf
    with pytest.raises(P.NonFiniteStateError, match=r"layer.0.raw"):
        make(cfg, 140, arrays=arrays)


def test_non_finite_payload_is_refused_on_load(cfg, good):
    # A payload written by a writer that did not check (crc recomputed, so only the values are bad).
    rec = walk(cfg, good)[2][0]  # layer 0's raw rows
    assert (rec["layer"], rec["lane"], rec["field"]) == (0, 0, 0)
    nan = np.array([np.nan], dtype=np.float16 if rec["dtype"] == 2 else np.float32).tobytes()
    bad = bytearray(good)
    bad[rec["off"] + 20:rec["off"] + 20 + len(nan)] = nan
    with pytest.raises(P.NonFiniteStateError, match=r"state array layer.0.raw holds a non-finite value"):
        load(cfg, with_crc(bytes(bad)))


def test_buffer_shorter_than_its_declared_size_is_truncated_not_trailing(cfg, good):
    for cut in (1, 2, 10, 4000):
        with pytest.raises(PayloadError, match=rf"truncated: {len(good) - cut} of {len(good)} bytes"):
            load(cfg, good[:-cut], size=len(good))
