"""The speculative-decoding drafters (issue #25, drafter side): the generated MTP / DSpark files load and
validate like the main file, the MTP drafter proposes deterministically, rolls back to the committed
history exactly, and every file that does not belong to the target is refused in one line."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.engine.mtp_drafter import MAX_RECURSE, MTPDrafter, load_mtp_drafter
from ds4_mlx.errors import Ds4Error, DrafterError, GGUFError, InferenceError
from ds4_mlx.formats.drafter_layout import DrafterKind, drafter_kind, mtp_tensors
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.formats.gguf_writer import GGUFWriter
from ds4_mlx.model.drafter_loader import open_drafter
from ds4_mlx.model.loader import load
from ds4_mlx.synth import preset_config, write_tiny_model
from ds4_mlx.synth_drafter import mtp_plan, write_tiny_drafter

# tests/small_model.py's dims (4 layers: dense, dense, ratio 4, ratio 128; a window of 8 raw rows)
SMALL = dict(n_vocab=512, n_layer=4, n_embd=256, n_head=2, head_dim=192, n_out_group=1, q_lora=64, o_lora=32,
             n_expert=4, n_expert_used=2, n_ff_exp=256, n_indexer_head=2, indexer_top_k=4, swa=8,
             tokenizer=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter")
    cfg = preset_config("tiny", **SMALL, name="ds4-drafter-small")
    out = {"preview": d / "small.gguf", "f0731": d / "small-0731.gguf", "mtp": d / "small-mtp.gguf",
           "dspark": d / "small-dspark.gguf", "other_mtp": d / "other-mtp.gguf"}
    write_tiny_model(cfg, out["preview"], compute_sha256=False)
    write_tiny_model(preset_config("tiny", **SMALL, name="ds4-drafter-small 0731"), out["f0731"], compute_sha256=False)
    write_tiny_drafter(cfg, out["mtp"], "mtp")
    write_tiny_drafter(cfg, out["dspark"], "dspark")
    write_tiny_drafter(preset_config("tiny", **{**SMALL, "n_expert": 8}), out["other_mtp"], "mtp")
    return out


@pytest.fixture(scope="module")
def cpu_target(files):
    return load(files["preview"], numerics="ds4-cpu")


def target_rows(model, tokens) -> mx.array:
    """The target's last-block HC-stream rows [T, n_hc, n_embd] for ``tokens`` from position 0: what
    its forward computes before the output head (``Model.run_blocks``)."""
    toks = np.asarray(tokens, dtype=np.int64)
    return model.run_blocks(model.embed(toks), toks, model.empty_cache())


PROMPT = [5, 77, 301, 12, 450, 9, 33, 101, 7, 260, 18, 499]  # longer than the 8-row window


def one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg, msg
    return msg


# -- loading and proposing ---------------------------------------------------------------------


def test_generated_files_have_the_real_layouts(files, cpu_target):
    with GGUFFile(files["mtp"]) as f:
        assert drafter_kind(f) is DrafterKind.MTP
        assert list(f.tensors)[:3] == ["mtp.0.hc_head_base.weight", "mtp.0.hc_head_fn.weight",
                                       "mtp.0.hc_head_scale.weight"]  # ds4's binding order
        assert set(f.tensors) == {e.name for e in mtp_tensors(cpu_target.config)}
    for kind in ("mtp", "dspark"):
        f, k = open_drafter(files[kind], cpu_target, checkpoint="preview" if kind == "mtp" else "0731")
        with f:
            assert k.value == kind


def test_mtp_proposes_and_propose_leaves_the_state(files, cpu_target):
    d = load_mtp_drafter(files["mtp"], cpu_target)
    rows = target_rows(cpu_target, PROMPT)
    n = len(PROMPT)
    d.start(PROMPT, rows[n - 4: n - 1])  # the rows that chose the last 3 tokens
    a = d.propose(4)
    assert len(a) == 4 and all(0 <= t < 512 for t in a)
    assert d.propose(4) == a and d.propose(2) == a[:2]  # proposing never moves the committed state
    assert d.propose(0) == []


def test_drafts_recurse_over_the_committed_tokens_first(files, cpu_target):
    """Draft i + 1 comes from the step on draft i: the same tokens a drafter proposes once draft 0 is
    committed without a row (it then runs recursively, as a draft did)."""
    n = len(PROMPT)
    rows = target_rows(cpu_target, PROMPT)
    d = load_mtp_drafter(files["mtp"], cpu_target)
    d.start(PROMPT, rows[n - 5: n - 1])
    drafts = d.propose(3)
    e = load_mtp_drafter(files["mtp"], cpu_target)
    e.start(PROMPT, rows[n - 5: n - 1])
    e.accept([drafts[0]], None)
    assert e.n_pending == 2 and e.propose(2) == drafts[1:]


def _state(d: MTPDrafter):
    return (list(d.tokens), d.end, d.window.end, np.asarray(d.window.rows).tobytes(),
            np.asarray(d.state_hc).tobytes())


def test_ds4_cpu_proposals_are_deterministic(files):
    n = len(PROMPT)
    props = []
    for _ in range(2):
        model = load(files["preview"], numerics="ds4-cpu")
        d = load_mtp_drafter(files["mtp"], model)
        d.start(PROMPT, target_rows(model, PROMPT)[n - 3: n - 1])
        props.append((d.propose(5), _state(d)))
    assert props[0] == props[1]


def test_default_numerics_propose(files):
    model = load(files["preview"])
    d = load_mtp_drafter(files["mtp"], model)
    d.start(PROMPT, target_rows(model, PROMPT)[-3:-1])
    assert len(d.propose(3)) == 3


# -- rollback -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n_rows", [2, 10])  # 10 > the window: the anchored chunk restarts it
def test_rollback_equals_a_fresh_drafter(files, cpu_target, n_rows):
    """propose k, accept j < k drafts + a correction token: the drafter's state and its next proposal
    are bit for bit those of a fresh drafter given the same committed history (ds4-cpu numerics)."""
    n = len(PROMPT)
    d = load_mtp_drafter(files["mtp"], cpu_target)
    d.start(PROMPT, target_rows(cpu_target, PROMPT)[n - 1 - n_rows: n - 1])
    drafts = d.propose(4)
    bonus = (drafts[2] + 1) % 512  # the target rejected draft 2
    committed = PROMPT + drafts[:2] + [bonus]
    rows = target_rows(cpu_target, committed)  # the verify's rows: those that chose d0, d1, bonus
    d.accept(drafts[:2] + [bonus], rows[n - 1: n + 2])
    assert d.n_pending == 1  # the bonus token's own row comes with the next token
    again = d.propose(3)

    fresh = load_mtp_drafter(files["mtp"], cpu_target)
    fresh.start(committed, rows[n - 1 - n_rows: n + 2])
    assert fresh.propose(3) == again
    assert _state(fresh) == _state(d)

    # the next verify: the target chose y after the bonus token (with the bonus token's row)
    y = again[0]
    rows = target_rows(cpu_target, committed + [y])
    d.accept([y], rows[n + 2: n + 3])
    fresh2 = load_mtp_drafter(files["mtp"], cpu_target)
    fresh2.start(committed + [y], rows[n - 1 - n_rows: n + 3])
    assert fresh2.propose(4) == d.propose(4)
    assert _state(fresh2) == _state(d)


def test_the_verifiers_flow_from_a_prefill(files, cpu_target):
    """ds4-mlx's speculator starts with no rows (a prefill keeps none) and a first token chosen by the
    prompt's logits; the first verify's row anchors the drafter there (ds4's window starts empty after
    a prefill too)."""
    n = len(PROMPT)
    d = load_mtp_drafter(files["mtp"], cpu_target)
    d.start(PROMPT, None)
    assert d.propose(2) == []  # nothing to draft from yet
    d.accept([41], None)  # chosen from the prefill's logits, no row
    assert d.propose(2) == []
    rows = target_rows(cpu_target, PROMPT + [41, 42])
    d.accept([42], rows[n: n + 1])  # the one-token verify of 41 gave its row, which chose 42
    fresh = load_mtp_drafter(files["mtp"], cpu_target)
    fresh.start(PROMPT + [41, 42], rows[n: n + 1])
    assert d.window.n_rows == 1 and d.propose(3) == fresh.propose(3) and _state(d) == _state(fresh)


def test_positions_without_rows(files, cpu_target):
    """A plain decode step gives no row: a short gap runs recursively (the window stays contiguous), a
    gap past MAX_RECURSE restarts the window, and too many tokens past the last row give no proposal."""
    n = len(PROMPT)
    rows_p = target_rows(cpu_target, PROMPT)
    d = load_mtp_drafter(files["mtp"], cpu_target)
    d.start(PROMPT, rows_p[n - 3: n - 1])  # positions n-3, n-2 run
    d.accept([41], None)
    rows = target_rows(cpu_target, PROMPT + [41, 42])
    d.accept([42], rows[n: n + 1])  # position n-1 had no row: recursion; then n anchored
    assert (d.window.n_rows, d.window.end, d.n_pending) == (4, n + 1, 1)
    assert len(d.propose(2)) == 2

    far = [7] * (MAX_RECURSE + 1)
    d.accept(far, None)
    assert d.n_pending == MAX_RECURSE + 2 and d.propose(2) == []  # too far from the last row
    ctx = PROMPT + [41, 42] + far + [43]
    rows = target_rows(cpu_target, ctx)
    d.accept([43], rows[len(ctx) - 2: len(ctx) - 1])
    assert (d.window.n_rows, d.n_pending) == (1, 1) and len(d.propose(1)) == 1


def test_hidden_rows_are_checked(files, cpu_target):
    d = load_mtp_drafter(files["mtp"], cpu_target)
    rows = target_rows(cpu_target, PROMPT)
    assert d.propose(1) == []  # no context yet
    with pytest.raises(InferenceError, match="shape"):
        d.start(PROMPT, rows[:, 0])
    with pytest.raises(InferenceError, match="at most 1"):
        d.start(PROMPT[:2], rows[:2])
    with pytest.raises(InferenceError, match="vocabulary"):
        d.start([1, 9999], rows[:1])
    with pytest.raises(InferenceError, match="before any context"):
        d.accept([3], rows[:1])
    d.start(PROMPT, rows[-2:-1])
    with pytest.raises(InferenceError, match="one row per token"):
        d.accept([3], rows[:2])
    assert d.tokens == PROMPT  # a refused accept changes nothing
    with pytest.raises(InferenceError, match="vocabulary"):
        d.accept([-1], None)


# -- refusals ----------------------------------------------------------------------------------


def test_preview_mtp_refused_for_a_0731_target(files):
    target = load(files["f0731"], numerics="ds4-cpu")
    with pytest.raises(DrafterError) as e:
        load_mtp_drafter(files["mtp"], target)
    assert "preview" in one_line(e.value) and "ds4f-dspark" in str(e.value)


def test_dspark_refused_for_a_preview_target(files, cpu_target):
    with pytest.raises(DrafterError) as e:
        load_mtp_drafter(files["dspark"], cpu_target)
    assert "0731" in one_line(e.value) and "preview-mtp" in str(e.value)


def test_dspark_file_is_not_an_mtp_head(files):
    """A 0731 target loads the DSpark file (tests/test_dspark.py runs it); the MTP loader names it."""
    target = load(files["f0731"], numerics="ds4-cpu")
    with pytest.raises(DrafterError) as e:
        load_mtp_drafter(files["dspark"], target)
    assert "a DSpark drafter, not an MTP head" in one_line(e.value)


def test_other_dims_refused(files, cpu_target):
    with pytest.raises(DrafterError) as e:
        load_mtp_drafter(files["other_mtp"], cpu_target)
    assert "expert_count" in one_line(e.value)


def test_dims_refused_by_the_tensors_without_metadata(files, cpu_target, tmp_path):
    """A drafter that declares no dims is still checked tensor by tensor against the target."""
    cfg = preset_config("tiny", **{**SMALL, "n_expert": 8})
    path = tmp_path / "bare-mtp.gguf"
    _write_plan(path, mtp_plan(cfg))
    with pytest.raises(DrafterError) as e:
        load_mtp_drafter(path, cpu_target)
    assert "other dims" in one_line(e.value)


def test_main_file_refused_as_drafter(files, cpu_target):
    with pytest.raises(DrafterError) as e:
        load_mtp_drafter(files["preview"], cpu_target)
    assert "DS4 Flash model file, not a drafter" in one_line(e.value)


def test_truncated_drafter_refused(files, cpu_target, tmp_path):
    cut = tmp_path / "cut-mtp.gguf"
    data = files["mtp"].read_bytes()
    cut.write_bytes(data[: len(data) - 4096])
    with pytest.raises(GGUFError) as e:
        load_mtp_drafter(cut, cpu_target)
    one_line(e.value)


def _write_plan(path, plan):
    with GGUFWriter(path) as w:
        for s in plan:
            w.add_tensor(s.name, s.ggml_type, s.ne)
        w.write_header()
        for s in plan:
            w.write_tensor(s.name, s.chunks())


def test_missing_tensor_refused(cpu_target, tmp_path):
    cfg = preset_config("tiny", **SMALL)
    path = tmp_path / "holey-mtp.gguf"
    _write_plan(path, [s for s in mtp_plan(cfg) if s.name != "mtp.0.attn_sinks.weight"])
    with pytest.raises(DrafterError) as e:
        load_mtp_drafter(path, cpu_target)
    assert "'mtp.0.attn_sinks.weight' is missing" in one_line(e.value)


def test_not_a_gguf_refused(cpu_target, tmp_path):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(Ds4Error) as e:
        load_mtp_drafter(p, cpu_target)
    one_line(e.value)


# -- inspect and the download check --------------------------------------------------------------


def test_inspect_says_what_a_drafter_is(files, capsys):
    from ds4_mlx.frontends import cli

    assert cli.main(["inspect", str(files["mtp"]), "--no-tensors"]) == 0
    out = capsys.readouterr().out
    assert "drafter: the preview's MTP drafter head (for a preview target; n_embd=256" in out
    assert "layout: OK (32 tensors checked" in out
    assert cli.main(["inspect", str(files["dspark"]), "--json"]) == 0
    import json
    info = json.loads(capsys.readouterr().out)
    assert info["drafter"]["kind"] == "dspark" and info["drafter"]["belongs_to"] == "0731"
    assert info["drafter"]["n_checked"] == 81 and info["config"] is None  # ds4's 81 DSpark tensors
    assert cli.main(["inspect", str(files["preview"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["drafter"] is None  # a model is no drafter


def test_inspect_reports_a_damaged_drafter(cpu_target, tmp_path, capsys):
    from ds4_mlx.frontends import cli

    cfg = preset_config("tiny", **SMALL)
    path = tmp_path / "holey-mtp.gguf"
    _write_plan(path, [s for s in mtp_plan(cfg) if s.name != "mtp.0.ffn_norm.weight"])
    assert cli.main(["inspect", str(path), "--no-tensors"]) == 1
    assert "layout: INVALID: " in capsys.readouterr().out


def test_download_check_of_drafters(files):
    from ds4_mlx import hub

    assert hub.verify(files["mtp"], hub.TARGETS["preview-mtp"]).startswith("DS4 MTP GGUF, layout OK (32")
    assert hub.verify(files["dspark"], hub.TARGETS["ds4f-dspark"]).startswith("DSpark drafter GGUF, layout OK (81")
    with pytest.raises(hub.HubError, match="not a DSpark drafter .it is the preview's MTP"):
        hub.verify(files["mtp"], hub.TARGETS["ds4f-dspark"])


def test_make_tiny_model_writes_the_drafters(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_model.py"
    spec = importlib.util.spec_from_file_location("make_tiny_model_for_drafters", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dims = ["--n-vocab", "512", "--n-layer", "4", "--n-embd", "256", "--n-head", "2", "--head-dim", "192",
            "--n-out-group", "1", "--q-lora", "64", "--o-lora", "32", "--n-expert", "4", "--n-expert-used", "2",
            "--n-ff-exp", "256", "--n-indexer-head", "2", "--indexer-top-k", "4", "--swa", "8"]
    m, mtp, dspark = tmp_path / "m.gguf", tmp_path / "m-mtp.gguf", tmp_path / "m-dspark.gguf"
    assert mod.main(["--out", str(m), *dims, "--no-tokenizer", "--no-sha256", "--quiet",
                     "--mtp-out", str(mtp), "--dspark-out", str(dspark)]) == 0
    assert "wrote mtp drafter" in capsys.readouterr().out
    target = load(m, numerics="ds4-cpu")
    for path, ckpt in ((mtp, "preview"), (dspark, "0731")):
        f, kind = open_drafter(path, target, ckpt)
        f.close()
    d = load_mtp_drafter(mtp, target)
    d.start(PROMPT, target_rows(target, PROMPT)[-2:-1])
    assert len(d.propose(2)) == 2
    d.close()


# -- the step against the target's own modules -------------------------------------------------------


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    """A target whose layer 1 routes by scores (hash_layer_count 1) and an MTP file whose block is a copy
    of that layer's tensors and whose head mix / norm are the target's output mix / norm: the drafter's
    block and head must then compute exactly what the target's layer 1 and head do."""
    from ds4_mlx.synth import TensorSpec

    d = tmp_path_factory.mktemp("mirror")
    cfg = preset_config("tiny", **SMALL, n_hash_layer=1, name="ds4-drafter-mirror")
    path, mtp = d / "target.gguf", d / "mirror-mtp.gguf"
    write_tiny_model(cfg, path, compute_sha256=False)
    src = GGUFFile(path)

    def source_of(name: str) -> str | None:
        suffix = name.removeprefix("mtp.0.")
        if suffix.startswith("hc_head_"):
            return "output_hc_" + suffix.removeprefix("hc_head_")
        if suffix == "norm.weight":
            return "output_norm.weight"
        return "blk.1." + suffix if f"blk.1.{suffix}" in src.tensors else None

    plan = []
    for s in mtp_plan(cfg):
        other = source_of(s.name)
        if other is None:
            plan.append(s)
            continue
        t = src.tensors[other]
        plan.append(TensorSpec(s.name, t.ggml_type, t.ne, lambda o=other: iter([np.array(src.tensor_data(o))])))
    _write_plan(mtp, plan)
    src.close()
    target = load(path, numerics="ds4-cpu")
    return target, load_mtp_drafter(mtp, target), path, mtp


def test_mtp_inputs_are_the_projected_embedding_plus_the_projected_state(mirror):
    from ds4_mlx.formats.quants import dequantize

    _, _, path, mtp = mirror
    target = load(path)  # default numerics: float32 products of the dequantized weights
    d = load_mtp_drafter(mtp, target)
    head, cfg = d.head, target.config
    toks = np.array([3, 250, 77])
    h = target_rows(target, toks)
    f = head.source

    def mat(name):
        t = f.tensors[name]
        return dequantize(f.tensor_data(name), t.ggml_type, t.n_elements).reshape(t.shape).astype(np.float64)

    def rms(x, w):
        x = x.astype(np.float64)
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_eps) * w

    emb = np.asarray(target.embedding[toks], dtype=np.float64)
    e = rms(emb, np.asarray(f.tensor_array("mtp.0.enorm.weight"))) @ mat("mtp.0.e_proj.weight").T
    hp = rms(np.asarray(h), np.asarray(f.tensor_array("mtp.0.hnorm.weight"))) @ mat("mtp.0.h_proj.weight").T
    np.testing.assert_allclose(np.asarray(head.inputs(target, toks, h)), e[:, None, :] + hp, rtol=2e-4, atol=2e-4)


def test_mtp_block_and_head_compute_the_targets_layer_1_and_head(mirror):
    """Bound by name under mtp.0., run as the dense score-routed layer 1 over its own window: the same
    bits as the target's layer 1 over its raw ring, and the target's head (ds4-cpu numerics)."""
    from ds4_mlx.model.cache import ChunkAt, LayerCache, capacity_for

    target, d, _, _ = mirror
    head, cfg = d.head, target.config
    toks = np.array([3, 250, 77, 401, 9])
    H = target.embed(toks) * 0.5 + target_rows(target, toks)  # any HC state

    lc = LayerCache.empty(cfg, 1, capacity_for(len(toks)))
    lc.bind(ChunkAt(0, len(toks), target.ops))
    want = target.blocks[1](H, toks, lc)
    window = head.empty_window()
    window.bind(ChunkAt(0, len(toks), target.ops))
    got = head.block(H, toks, window)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    lc.offset = len(toks)  # what ModelCache.advance does after a chunk
    assert np.array_equal(np.asarray(window.rows), np.asarray(lc.raw_rows()))

    # the whole step: the inputs, the block over the window, the head
    h = target_rows(target, toks)
    H_last, logits = head.run(target, toks, h, head.empty_window(), 0)
    lc = LayerCache.empty(cfg, 1, capacity_for(len(toks)))
    lc.bind(ChunkAt(0, len(toks), target.ops))
    ref = target.blocks[1](head.inputs(target, toks, h), toks, lc)[-1:]
    assert np.array_equal(np.asarray(H_last), np.asarray(ref[0]))
    assert np.array_equal(logits, np.asarray(target.head(ref)[0]))


# -- the real drafter file through the product (load(draft=PATH), generate, the CLI) -------------------


@pytest.fixture(scope="module")
def tiny_mtp(tiny_model_path, tmp_path_factory):
    """An MTP drafter file for the oracle's tiny model (real tokenizer), written by the generator."""
    out = tmp_path_factory.mktemp("tiny-mtp") / "tiny-mtp.gguf"
    write_tiny_drafter(preset_config("tiny"), out, "mtp")  # the oracle model's dims (its bytes mode has no Q4_K)
    return out


@pytest.mark.parametrize("numerics", ["ds4-cpu", "default"])
def test_generate_with_the_mtp_file_equals_plain_decoding(tiny_model_path, tiny_mtp, numerics):
    """``ds4_mlx.load(..., draft=PATH)``: the MTP head drafts, the target verifies; at temperature 0
    the tokens are plain decoding's (ds4-cpu: also every logits row the loop chose from)."""
    import ds4_mlx

    plain = ds4_mlx.load(tiny_model_path, numerics=numerics)
    spec = ds4_mlx.load(tiny_model_path, numerics=numerics, draft=str(tiny_mtp), draft_k=3)
    assert isinstance(spec.drafter, MTPDrafter)
    want = ds4_mlx.generate(plain, "Speculate about the weather", max_tokens=12, temperature=0, raw=True)
    got = ds4_mlx.generate(spec, "Speculate about the weather", max_tokens=12, temperature=0, raw=True)
    assert got.tokens == want.tokens
    assert got.stats.drafted_tokens > 0  # the drafter ran: random weights, so few are accepted


def test_cli_generate_with_mtp_and_its_refusals(tiny_model_path, tiny_mtp, files, capsys):
    from ds4_mlx.frontends.cli import main

    args = ["generate", "-m", str(tiny_model_path), "--raw", "-n", "6", "--temp", "0", "-p", "Hello"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--mtp", str(tiny_mtp), "--draft-k", "2"]) == 0
    cap = capsys.readouterr()
    assert cap.out == plain and "draft:" in cap.err
    # a drafter of other dims, a main model file, a DSpark file: one line each, no traceback
    for bad, why in ((files["other_mtp"], "belongs to a model of other dims"), (tiny_model_path, "not a drafter"),
                     (files["dspark"], "belongs to Flash 0731, but the loaded model is DeepSeek V4 Flash preview")):
        assert main(args + ["--mtp", str(bad)]) != 0
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and why in err, err
