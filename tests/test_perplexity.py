"""`ds4-mlx perplexity` and ``ds4_mlx.perplexity``: ds4's ``--perplexity-file`` on the tiny model.

What is checked, and against what:
* the result is the sum over the scored tokens of -log softmax(logits)[token], the logits taken
  from a session fed the text token by token and the log-softmax computed here in float64
  (``np.logaddexp.reduce``), to the float32 rounding of each term (ds4 rounds every logprob to a
  float before summing);
* the token counts: 32 prefix tokens, the ``-n`` and ``ctx - 32`` caps, ds4's two refusals;
* the output line against the C library's own ``printf`` of ds4's format string;
* chunked scoring (``--chunk N``, ``Model.forward_chunk(want_logits="all")``) against ds4's
  token-by-token decode: in ds4-cpu numerics every logits row is bit-identical and so is the
  result (that mode fixes the order of every sum, whatever the chunk). In the default numerics a
  decode step is the compiled one-token graph, a chunk runs batched products with other float32
  summation orders, and the difference compounds through FP8 and routing decisions as the other
  chunkings' does (tests/test_compiled_decode.py). Measured on these texts, 64 scored tokens:
  |Δ avg_nll| <= 1.6e-4 nats (chunk 8 and 64; 300 tokens: Δ nll <= 0.25 of 3660, per-step logit rms
  median 1.5e-3, worst 0.17). Bound 2e-3: a misaligned row (scoring a token from the wrong
  position) moves avg_nll by ~0.2 here;
* errors: one line, exit 2, no traceback.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import json
import math
import re

import numpy as np
import pytest

import ds4_mlx
from ds4_mlx.engine import perplexity as ppl_mod
from ds4_mlx.engine.perplexity import PREFIX_TOKENS, PerplexityResult, perplexity, scored_count
from ds4_mlx.errors import InferenceError
from ds4_mlx.frontends import cmd_perplexity
from ds4_mlx.frontends.cli import main
from ds4_mlx.model.host import to_host

TEXT = ("Ada Lovelace wrote the first published algorithm for Babbage's Analytical Engine in 1843. "
        "Her notes describe how the engine could compute Bernoulli numbers, and they suggest that "
        "such a machine might act on things other than numbers, such as music. She is often called "
        "the first computer programmer. Rispondi in italiano con una frase: chi era Ada Lovelace?")


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return ds4_mlx.load(tiny_model_path)


@pytest.fixture(scope="module")
def cpu_model(tiny_model_path):
    return ds4_mlx.load(tiny_model_path, numerics="ds4-cpu")


def decode_logits(model, ids: list[int], scored: int, ctx: int) -> np.ndarray:
    """[scored, n_vocab]: the logits before each scored token, the text fed one token at a time."""
    s = model.new_session(ctx=ctx)
    s.sync(ids[:PREFIX_TOKENS])
    rows = [s.logits()]
    for t in ids[PREFIX_TOKENS:PREFIX_TOKENS + scored - 1]:
        s.eval(t)
        rows.append(s.logits())
    return np.stack(rows)


def test_result_is_the_teacher_forced_sum(model):
    ids = model.tokenizer.encode(TEXT)
    assert len(ids) > PREFIX_TOKENS + 40
    r = ds4_mlx.perplexity(model, TEXT, ctx=512, n=40)
    assert (r.tokens, r.scored) == (len(ids), 40)
    rows = decode_logits(model, ids, 40, 512).astype(np.float64)
    lp = np.array([row[t] - np.logaddexp.reduce(row) for row, t in zip(rows, ids[PREFIX_TOKENS:PREFIX_TOKENS + 40])])
    direct = -float(lp.sum())
    # each term is rounded to float32 (half an ulp: |lp| * 2^-24) before the float64 sum...
    assert abs(r.nll - direct) <= float(np.abs(lp).sum()) * 2.0 ** -24 + 1e-9, (r.nll, direct)
    # ...and exactly so: this float64 log-softmax differs from ds4's max + log(sum) by ~1e-15, far
    # inside a float32 ulp, so the rounded terms are the same floats and their running sum the same
    nll = 0.0
    for x in lp:
        nll -= float(np.float32(x))
    assert r.nll == nll
    assert r.avg_nll == r.nll / 40 and r.ppl == math.exp(r.avg_nll)
    assert isinstance(r, PerplexityResult) and ds4_mlx.PerplexityResult is PerplexityResult


def test_token_counts_and_refusals(model):
    n_tok = len(model.tokenizer.encode(TEXT))
    assert scored_count(n_tok, 0, 32768) == n_tok - 32
    assert scored_count(n_tok, 5, 32768) == 5
    assert scored_count(n_tok, 50000, 40) == 8  # ctx - 32
    assert scored_count(33, 0, 33) == 1
    with pytest.raises(InferenceError, match="the text has 32 tokens: perplexity needs more than 32"):
        scored_count(32, 0, 32768)
    with pytest.raises(InferenceError, match="ctx 32 is too small"):
        scored_count(n_tok, 0, 32)
    # the ctx cap holds on a real run: 32 + 7 fed tokens fit a ctx of 40, the last scored is not fed
    r = perplexity(model, TEXT, ctx=40)
    assert (r.tokens, r.scored) == (n_tok, 8)
    for kwargs, msg in [({"chunk": 0}, "chunk must be an integer in 1..2048"),
                        ({"chunk": 4096}, "chunk must be"), ({"n": -1}, "n must be an integer >= 0"),
                        ({"ctx": 1 << 30}, "larger than the model's context length")]:
        with pytest.raises(InferenceError, match=re.escape(msg)):
            perplexity(model, TEXT, **kwargs)
    with pytest.raises(InferenceError, match="text must be a str"):
        perplexity(model, TEXT.encode())


def test_line_is_ds4s_printf():
    """The C library's printf of ds4's format string is the oracle (ds4 prints with printf)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    for r in (PerplexityResult(617, 40, 491.103733063, 12.277593326575, 214828.07296195),
              PerplexityResult(33, 1, 0.0, 0.0, 1.0), ppl_mod.result_of(100, 3, 2.0 / 3.0),
              ppl_mod.result_of(100, 1, 1e6)):  # exp overflows: inf, as C's exp gives
        buf = ctypes.create_string_buffer(256)
        libc.snprintf(buf, 256, b"tokens=%d scored=%d nll=%.9f avg_nll=%.9f ppl=%.9f",
                      ctypes.c_int(r.tokens), ctypes.c_int(r.scored), ctypes.c_double(r.nll),
                      ctypes.c_double(r.avg_nll), ctypes.c_double(r.ppl))
        assert r.line() == buf.value.decode()


def test_chunked_equals_decode_bit_for_bit_in_ds4_cpu(cpu_model):
    """ds4-cpu: forward_chunk's rows of every position are the decode steps' logits, bit for bit."""
    ids = cpu_model.tokenizer.encode(TEXT)
    scored = 12
    dec = decode_logits(cpu_model, ids, scored, 256)
    net = cpu_model.network
    arr = np.asarray(ids, dtype=np.int64)
    first, cache = net.forward_chunk(arr[:PREFIX_TOKENS], net.empty_cache(), want_logits=True)
    rows, _ = net.forward_chunk(arr[PREFIX_TOKENS:PREFIX_TOKENS + scored - 1], cache, want_logits="all")
    got = np.concatenate([to_host(first, np.float32)[None], to_host(rows, np.float32)])
    assert got.shape == dec.shape
    assert [i for i in range(scored) if not np.array_equal(got[i], dec[i])] == []
    r1 = perplexity(cpu_model, TEXT, ctx=256, n=scored)
    assert perplexity(cpu_model, TEXT, ctx=256, n=scored, chunk=5) == r1  # 1 + 5 + 5 + 1: chunks cut mid-way
    assert perplexity(cpu_model, TEXT, ctx=256, n=scored, chunk=64) == r1  # one chunk holds them all


def test_chunked_within_rounding_of_decode_in_default_numerics(model):
    r1 = perplexity(model, TEXT, ctx=512, n=64)
    for chunk in (8, 64):
        r = perplexity(model, TEXT, ctx=512, n=64, chunk=chunk)
        assert (r.tokens, r.scored) == (r1.tokens, r1.scored)
        assert abs(r.avg_nll - r1.avg_nll) <= 2e-3, (chunk, r.avg_nll, r1.avg_nll)


# -- the command -----------------------------------------------------------------------------------


LINE = re.compile(r"tokens=\d+ scored=\d+ nll=\d+\.\d{9} avg_nll=\d+\.\d{9} ppl=\d+\.\d{9}\n")


def run_cli(capsys, *argv):
    rc = main(["perplexity", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_prints_ds4s_line_and_nothing_on_a_pipe(capsys, model, tiny_model_path, tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(TEXT, encoding="utf-8")
    rc, out, err = run_cli(capsys, "-m", str(tiny_model_path), "--file", str(f), "--ctx", "512", "-n", "20")
    assert (rc, err) == (0, "")
    assert LINE.fullmatch(out), out
    assert out == perplexity(model, TEXT, ctx=512, n=20).line() + "\n"
    rc, out, err = run_cli(capsys, "-m", str(tiny_model_path), "--file", str(f), "--ctx", "512", "-n", "20",
                           "--chunk", "7", "--json")
    doc = json.loads(out)
    assert (rc, err) == (0, "") and set(doc) == {"tokens", "scored", "nll", "avg_nll", "ppl"}
    assert doc == perplexity(model, TEXT, ctx=512, n=20, chunk=7).to_json()


def test_progress_bar_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = cmd_perplexity.ScoreBar(stream)
        for i in range(1, 11):
            bar.update(i, 10)
        bar.close()
    assert "scoring" in tty.getvalue() and pipe.getvalue() == ""


def test_cli_defaults_are_the_engines():
    assert cmd_perplexity.DEFAULT_MAX_SCORED == ppl_mod.DEFAULT_MAX_SCORED == 50000
    assert cmd_perplexity.MAX_SCORE_CHUNK == ppl_mod.MAX_SCORE_CHUNK


@pytest.mark.parametrize("content, argv, message", [
    ("A short text.".encode(), [], "the text has 4 tokens: perplexity needs more than 32"),
    (TEXT.encode(), ["--ctx", "32"], "ctx 32 is too small for perplexity scoring"),
    (None, [], "cannot read --file"),
    (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)), [], "is not UTF-8 (byte"),
    (b"text\x00with a NUL" * 10, [], "holds a NUL character (index 4): a binary file"),
])
def test_cli_errors_one_line_exit_2(capsys, tiny_model_path, tmp_path, content, argv, message):
    f = tmp_path / "in.txt"
    if content is not None:
        f.write_bytes(content)
    rc, out, err = run_cli(capsys, "-m", str(tiny_model_path), "--file", str(f), *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("ds4-mlx perplexity: error: ") and message in err, err
    assert "Traceback" not in err
