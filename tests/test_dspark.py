"""Flash 0731's DSpark drafter (issue #25): the generated DSpark file loads for a 0731 target with its
own parameters, proposes deterministically from the target's layer taps, keeps only committed rows
(a rejected proposal changes nothing), and generate with it equals plain decoding (ds4-cpu: every
logits row the loop chose from, bit for bit)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import ds4_mlx
from ds4_mlx.engine.dspark_drafter import DSparkDrafter, load_dspark_drafter
from ds4_mlx.engine.mtp_drafter import load_mtp_drafter
from ds4_mlx.errors import DraftError, DrafterError, InferenceError
from ds4_mlx.formats.gguf import ValueType
from ds4_mlx.model.loader import load
from ds4_mlx.synth import preset_config, write_tiny_model
from ds4_mlx.synth_drafter import dspark_plan, write_drafter_file, write_tiny_drafter

# tests/small_model.py's dims (4 layers, a window of 8 raw rows), as tests/test_drafter.py
SMALL = dict(n_vocab=512, n_layer=4, n_embd=256, n_head=2, head_dim=192, n_out_group=1, q_lora=64, o_lora=32,
             n_expert=4, n_expert_used=2, n_ff_exp=256, n_indexer_head=2, indexer_top_k=4, swa=8,
             tokenizer=False)
PROMPT = [5, 77, 301, 12, 450, 9, 33, 101, 7, 260, 18, 499]  # longer than the 8-row window


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dspark")
    cfg = preset_config("tiny", **SMALL, name="ds4-dspark-small 0731")
    out = {"target": d / "small-0731.gguf", "preview": d / "small.gguf", "dspark": d / "small-dspark.gguf"}
    write_tiny_model(cfg, out["target"], compute_sha256=False)
    write_tiny_model(preset_config("tiny", **SMALL, name="ds4-dspark-small"), out["preview"], compute_sha256=False)
    write_tiny_drafter(cfg, out["dspark"], "dspark")
    return out


@pytest.fixture(scope="module")
def target(files):
    return load(files["target"], numerics="ds4-cpu")


def taps_of(model, tokens, taps) -> mx.array:
    """The target's tap rows [T, n_taps, n_embd] for ``tokens`` from position 0 (a verify forward)."""
    _, rows, _ = model.forward_verify(np.asarray(tokens, dtype=np.int64), model.empty_cache(), taps)
    return rows


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def same_rings(a: DSparkDrafter, b: DSparkDrafter) -> bool:
    return a.end == b.end and all(np.array_equal(bits(x), bits(y)) for x, y in zip(a.rings, b.rings))


def one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg, msg
    return msg


# -- loading ------------------------------------------------------------------------------------------


def test_loads_with_the_files_parameters(files, target):
    d = load_dspark_drafter(files["dspark"], target)
    p = d.head.params
    # a 4-layer model has no layers 40-42 and a 512-token vocabulary no token 128799: the generator
    # names the last three layers and the last token
    assert d.taps == p.target_layers == (1, 2, 3)
    assert p.block_size == 5 and p.noise_token_id == 511
    assert len(d.head.stages) == 3 and d.head.markov_w1.shape == (512, 256)
    d.close()


def test_taps_are_the_layers_hc_means(target):
    """``forward_verify(taps=...)`` returns the listed layers' outputs averaged over the HC streams,
    from the same forward: its logits are the plain verify's, bit for bit."""
    toks = np.array(PROMPT[:5])
    logits, H, _ = target.forward_verify(toks, target.empty_cache())
    logits_t, T, _ = target.forward_verify(toks, target.empty_cache(), (3, 1))
    assert np.array_equal(bits(logits), bits(logits_t))
    assert T.shape == (5, 2, target.config.n_embd)
    # the last layer's output is the H the head reads: its tap is that H's stream mean
    np.testing.assert_allclose(np.asarray(T[:, 0]), np.asarray(H).mean(axis=1), rtol=1e-6, atol=1e-6)
    with pytest.raises(InferenceError) as e:
        target.forward_verify(toks, target.empty_cache(), (1, 4))
    assert "0..3" in one_line(e.value)


# -- proposing ------------------------------------------------------------------------------------------


def test_proposals_are_deterministic_and_leave_the_state(files, target):
    d = load_dspark_drafter(files["dspark"], target, confidence=0)
    rows = taps_of(target, PROMPT, d.taps)
    d.start(PROMPT, rows[:-1])  # the rows that chose PROMPT[1:]: up to the anchor's position - 1
    assert d.end == len(PROMPT) - 1 and all(r.shape[0] == 8 for r in d.rings)  # n_swa rows kept
    before = [np.array(r) for r in d.rings]
    first = d.propose(5)
    assert len(first) == 5 and all(0 <= t < 512 for t in first)
    assert d.propose(5) == first and d.propose(2) == first[:2]
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(before, d.rings))

    other_target = load(files["target"], numerics="ds4-cpu")  # a second load: the same bits
    e = load_dspark_drafter(files["dspark"], other_target, confidence=0)
    e.start(PROMPT, taps_of(other_target, PROMPT, e.taps)[:-1])
    assert e.propose(5) == first and same_rings(d, e)
    d.close()
    e.close()


def test_confidence_cuts_the_proposal(files, target):
    d = load_dspark_drafter(files["dspark"], target, confidence=0)
    d.start(PROMPT, taps_of(target, PROMPT, d.taps)[:-1])
    # the slots' confidence logits, recomputed from the head's own outputs
    x, _ = d.head.block_outputs(target, d.rings, PROMPT[-1], len(PROMPT) - 1)
    full = d.propose(5)
    prev, sig = [PROMPT[-1]] + full[:-1], []
    E = target.config.n_embd
    for j, p in enumerate(prev):
        c = float(d.head.confidence[:E].astype(np.float64) @ x[j] + d.head.confidence[E:].astype(np.float64)
                  @ d.head.markov_w1[p])
        sig.append(1 / (1 + np.exp(-c)))
    for j in range(5):
        d.confidence = sig[j] * (1 + 1e-9)  # just above slot j's: the prefix before the first slot below it
        assert d.propose(5) == full[:next(i for i in range(5) if sig[i] < d.confidence)]
    d.confidence = min(sig) / 2  # below every slot: all kept
    assert d.propose(5) == full
    with pytest.raises(DraftError):
        DSparkDrafter(d.head, target, confidence=1.5)
    d.close()


def test_rejections_leave_a_fresh_drafters_state(files, target):
    """Propose, reject, accept the target's tokens with their rows: the rings equal a fresh drafter's
    started on the whole committed history (bit for bit), and so do the next proposals."""
    toks = PROMPT + [40, 41, 42, 43]
    rows = taps_of(target, toks, (1, 2, 3))
    d = load_dspark_drafter(files["dspark"], target, confidence=0)
    d.start(PROMPT, rows[:len(PROMPT) - 1])
    d.propose(4)  # drafts the target rejects
    d.accept([40, 41], rows[len(PROMPT) - 1: len(PROMPT) + 1])
    d.propose(3)
    d.accept([42, 43], rows[len(PROMPT) + 1: len(PROMPT) + 3])
    fresh = load_dspark_drafter(files["dspark"], target, confidence=0)
    fresh.start(toks, rows[:len(toks) - 1])
    assert same_rings(d, fresh)
    assert d.propose(5) == fresh.propose(5)
    d.close()
    fresh.close()


def test_positions_without_rows_restart_the_rings(files, target):
    toks = PROMPT + [40, 41, 42]
    rows = taps_of(target, toks, (1, 2, 3))
    d = load_dspark_drafter(files["dspark"], target, confidence=0)
    d.start(PROMPT, None)  # a prefill passes no rows
    assert d.propose(3) == []  # no row up to the anchor's position - 1
    d.accept([40], None)  # a plain decode step: no rows either
    d.accept([41], rows[len(PROMPT): len(PROMPT) + 1])  # the row at position len(PROMPT) only
    assert d.end == len(PROMPT) + 1 and all(r.shape[0] == 1 for r in d.rings)
    assert len(d.propose(3)) == 3
    d.accept([42], None)
    assert d.propose(3) == []  # the anchor's row is missing again
    with pytest.raises(InferenceError) as e:
        d.accept([7], rows[:2])
    assert "2 rows for 1 tokens" in one_line(e.value)
    with pytest.raises(InferenceError) as e:
        d.accept([7], mx.zeros((1, 4, 256)))  # last-block rows are not taps
    assert "[n, 3, 256]" in one_line(e.value)
    d.close()


# -- refusals ------------------------------------------------------------------------------------------


def test_dspark_refused_for_a_preview_target(files):
    preview = load(files["preview"], numerics="ds4-cpu")
    with pytest.raises(DrafterError) as e:
        load_dspark_drafter(files["dspark"], preview)
    assert "0731" in one_line(e.value) and "preview-mtp" in str(e.value)
    target = load(files["target"], numerics="ds4-cpu")
    with pytest.raises(DrafterError) as e:
        load_mtp_drafter(files["dspark"], target)  # the MTP loader names what the file is
    assert "DSpark" in one_line(e.value)


def _write_with_meta(out, cfg, meta):
    write_drafter_file(out, dspark_plan(cfg), [("general.architecture", ValueType.STRING, "deepseek4"), *meta])


@pytest.mark.parametrize("meta,what", [
    ([], "noise token 128799"),  # ds4's defaults do not fit a 512-token, 4-layer model
    ([("deepseek4.dspark.noise_token_id", ValueType.UINT32, 3)], "target layers [40, 41, 42]"),
    ([("deepseek4.dspark.target_layers", ValueType.ARRAY, [1, 2, 9], ValueType.UINT32),
      ("deepseek4.dspark.noise_token_id", ValueType.UINT32, 3)], "[1, 2, 9]"),
    ([("deepseek4.dspark.target_layers", ValueType.ARRAY, [1, 2, 3], ValueType.UINT32),
      ("deepseek4.dspark.noise_token_id", ValueType.UINT32, 128799)], "noise token 128799"),
    ([("deepseek4.dspark.target_layers", ValueType.ARRAY, [1, 2, 3], ValueType.UINT32),
      ("deepseek4.dspark.noise_token_id", ValueType.UINT32, 3),
      ("deepseek4.dspark.block_size", ValueType.UINT32, 40)], "block size 40"),
])
def test_parameters_that_do_not_fit_the_target_refused(files, target, tmp_path, meta, what):
    cfg = preset_config("tiny", **SMALL, name="ds4-dspark-small 0731")
    out = tmp_path / "bad-dspark.gguf"
    _write_with_meta(out, cfg, meta)
    with pytest.raises(DrafterError) as e:
        load_dspark_drafter(out, target)
    assert what in one_line(e.value)


# -- through the product: generate with the DSpark file ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_dspark(tmp_path_factory):
    """A DSpark file for the oracle's tiny model (real tokenizer), written by the generator."""
    out = tmp_path_factory.mktemp("tiny-dspark") / "tiny-dspark.gguf"
    write_tiny_drafter(preset_config("tiny"), out, "dspark")
    return out


def _run(eng, prompt, n, draft):
    rows = []

    def record(generated, logits):
        rows.append(np.array(logits, copy=True))
        return logits

    res = ds4_mlx.generate(eng, prompt, max_tokens=n, temperature=0, raw=True, draft=draft,
                           logits_processors=[record])
    return res, rows


@pytest.mark.parametrize("numerics", ["ds4-cpu", "default"])
def test_generate_with_the_dspark_file_equals_plain_decoding(tiny_model_path, tiny_dspark, numerics):
    """The tiny model as a 0731 target (``checkpoint="0731"``) with its DSpark file: at temperature 0
    the tokens are plain decoding's; in ds4-cpu numerics every logits row the loop chose from too."""
    from ds4_mlx.engine.speculative import load_drafter

    eng = ds4_mlx.load(tiny_model_path, numerics=numerics, checkpoint="0731")
    d = load_drafter(tiny_dspark, eng)
    assert isinstance(d, DSparkDrafter)
    d.confidence = 0.0  # random weights: keep every draft, so the verifier sees full blocks
    prompt = "Speculate about the weather"
    want, want_rows = _run(eng, prompt, 16, False)
    got, got_rows = _run(eng, prompt, 16, d)
    assert got.tokens == want.tokens
    assert got.stats.drafted_tokens > 0 and got.stats.verify_steps > 0
    if numerics == "ds4-cpu":
        assert len(got_rows) == len(want_rows)
        assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(got_rows, want_rows))
    spec = ds4_mlx.load(tiny_model_path, numerics=numerics, checkpoint="0731", draft=str(tiny_dspark), draft_k=4)
    assert isinstance(spec.drafter, DSparkDrafter)
    assert ds4_mlx.generate(spec, prompt, max_tokens=16, temperature=0, raw=True).tokens == want.tokens
