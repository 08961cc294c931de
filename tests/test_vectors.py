"""`ds4-mlx vectors` and ``ds4_mlx.engine.vectors``: ds4's official-vector check.

The tiny model cannot pass the DeepSeek API's vectors (random weights), so the passing side is
checked on vectors the tiny model writes itself: its greedy continuation and top-20 logprobs through
``stream_generate`` (the generation loop, a path independent of the checker's own session loop), in
the official JSON schema. Those pass; each perturbation (another selected token, a logprob moved by
4.5, a top token we do not rank) fails with its reason at its step. The shipped preview set is
checked to load as ds4's fixture has it, and to run (and fail) on the tiny model.
"""

from __future__ import annotations

import copy
import json
import lzma
from pathlib import Path

import numpy as np
import pytest

import ds4_mlx
from ds4_mlx.engine.vectors import (CTX_BY_ID, DS4_SKIPPED, SKIPPED_BY_SET, TOP_K, OfficialStep, OfficialTop, VectorError,
                                    check_step, load_vector_dir, load_vector_set, official_logprob, official_steps,
                                    run_vectors)
from ds4_mlx.frontends.cli import main

# Short prompts and contexts keep the self-made set to a second on the CPU.
SELF_CASES = [
    {"id": "tiny_italian", "prompt": "Rispondi in italiano con una frase: chi era Ada Lovelace?", "ctx": 256, "steps": 3},
    {"id": "tiny_code", "prompt": "Complete the C statement:\nreturn snprintf(buf, sizeof(buf), \"%d\", value",
     "ctx": 128, "steps": 2},
]


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return ds4_mlx.load(tiny_model_path)


def _token(tb: bytes) -> dict:
    return {"text": tb.decode("utf-8", "replace"), "bytes": list(tb)}


@pytest.fixture(scope="module")
def records(engine) -> dict[str, dict]:
    """The tiny model's own answers, as ds4's fetch_official_vectors.py stores the API's."""
    out = {}
    for spec in SELF_CASES:
        steps = []
        for ev in ds4_mlx.stream_generate(engine, spec["prompt"], system="", think=False, temperature=0,
                                          max_tokens=spec["steps"], logprobs=TOP_K, ctx=spec["ctx"]):
            if ev.kind in ("reasoning", "content", "tool_call") and ev.token is not None:
                chosen = engine.tokenizer.token_text(ev.token)
                steps.append({"step": len(steps), "token": _token(chosen),
                              "logprob": next(t.logprob for t in ev.top_logprobs if t.id == ev.token),
                              "top_logprobs": [{"token": _token(t.bytes), "logprob": t.logprob}
                                               for t in ev.top_logprobs]})
        assert len(steps) == spec["steps"], "the tiny model stopped early: pick other prompts"
        out[spec["id"]] = {"schema": "ds4-official-logprobs-v1", "id": spec["id"], "prompt": spec["prompt"],
                           "usage": {"prompt_tokens": None}, "steps": steps}
    return out


def write_set(root: Path, records: dict[str, dict], *, ctx: dict[str, int] | None = None,
              xz: tuple[str, ...] = ()) -> Path:
    """A vector folder in ds4's layout; the records in ``xz`` stored compressed, as the package does."""
    (root / "prompts").mkdir(parents=True, exist_ok=True)
    (root / "official").mkdir(exist_ok=True)
    ctx = ctx or {s["id"]: s["ctx"] for s in SELF_CASES}
    entries = []
    for cid, rec in records.items():
        (root / "prompts" / f"{cid}.txt").write_text(rec["prompt"], encoding="utf-8")
        data = json.dumps(rec, ensure_ascii=False).encode()
        name = f"{cid}.official.json"
        if cid in xz:
            (root / "official" / f"{name}.xz").write_bytes(lzma.compress(data))
        else:
            (root / "official" / name).write_bytes(data)
        entries.append({"id": cid, "kind": "short", "prompt_file": f"prompts/{cid}.txt",
                        "official_file": f"official/{name}", "steps": len(rec["steps"]),
                        **({"ctx": ctx[cid]} if cid in ctx else {})})
    manifest = {"schema": "ds4-test-vector-manifest-v1", "model": "tiny", "prompts": entries}
    (root / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def self_dir(records, tmp_path_factory) -> Path:
    return write_set(tmp_path_factory.mktemp("vectors") / "self", records, xz=("tiny_code",))


def perturbed(records, tmp_path, edit) -> Path:
    recs = copy.deepcopy(records)
    edit(recs)
    return write_set(tmp_path / "perturbed", recs)


def top_ids(engine, prompt: str, ctx: int) -> set[bytes]:
    from ds4_mlx.engine.vectors import VectorCase, prompt_tokens

    s = engine.new_session(ctx=ctx)
    s.sync(prompt_tokens(engine, VectorCase("x", ctx, prompt, ())))
    return {engine.tokenizer.token_text(t.id) for t in s.top_logprobs(TOP_K)}


# -- the model's own vectors pass, perturbed ones fail with their reason -----------------------------------


def test_self_made_vectors_pass(engine, self_dir, records):
    results = run_vectors(engine, load_vector_dir(self_dir))
    assert [r.id for r in results] == [s["id"] for s in SELF_CASES]
    for r in results:
        assert r.status == "pass" and r.failures == (), [f.message for f in r.failures]
        assert r.steps == len(records[r.id]["steps"])
        assert list(r.chosen) == [bytes(s["token"]["bytes"]) for s in records[r.id]["steps"]]
        assert r.prompt_tokens == len(engine.encode_prompt(records[r.id]["prompt"], system="", think=False))


def test_another_selected_token_fails_at_its_step(engine, records, tmp_path):
    def edit(recs):
        recs["tiny_italian"]["steps"][1]["token"]["bytes"] = list(b" Lovelace")

    (r, ok) = run_vectors(engine, load_vector_dir(perturbed(records, tmp_path, edit)))
    assert ok.passed and r.status == "fail"
    (f,) = r.failures
    assert (f.step, f.kind, f.token, f.local_token) == (1, "selected", b" Lovelace", r.chosen[1])
    assert f.message.startswith("step 1: selected token mismatch: local ")


def test_logprob_moved_by_4_5_fails_3_9_passes(engine, records, tmp_path):
    step = records["tiny_code"]["steps"][0]
    third = step["top_logprobs"][2]

    def shift(by):
        def edit(recs):
            recs["tiny_code"]["steps"][0]["top_logprobs"][2]["logprob"] = third["logprob"] + by
        return edit

    (_, r) = run_vectors(engine, load_vector_dir(perturbed(records, tmp_path / "a", shift(4.5))))
    (f,) = r.failures
    assert (f.step, f.kind, f.token) == (0, "logprob", bytes(third["token"]["bytes"]))
    assert f.local_logprob == pytest.approx(third["logprob"], abs=1e-6)
    assert f.official_logprob == pytest.approx(third["logprob"] + 4.5, abs=1e-5)
    assert "logprob delta too high" in f.message and "local=" in f.message and "official=" in f.message
    (_, r) = run_vectors(engine, load_vector_dir(perturbed(records, tmp_path / "b", shift(-3.9))))
    assert r.passed, [f.message for f in r.failures]


def test_top_token_we_do_not_rank_is_missing(engine, records, tmp_path):
    spec = SELF_CASES[0]
    ours = top_ids(engine, spec["prompt"], spec["ctx"])
    foreign = next(engine.tokenizer.token_text(i) for i in range(1000, 2000)
                   if engine.tokenizer.token_text(i) not in ours)

    def edit(recs):
        recs["tiny_italian"]["steps"][0]["top_logprobs"][5]["token"]["bytes"] = list(foreign)

    (r, _) = run_vectors(engine, load_vector_dir(perturbed(records, tmp_path, edit)))
    (f,) = r.failures
    assert (f.step, f.kind, f.token) == (0, "missing", foreign)
    assert f"missing from the local top-{TOP_K}" in f.message


def test_entries_the_fixture_drops_are_not_checked(engine, records, tmp_path):
    """The API's -9999 placeholders, empty-bytes and null entries: ds4's official.vec leaves them out."""
    def edit(recs):
        top = recs["tiny_italian"]["steps"][0]["top_logprobs"]
        top += [{"token": _token(b"\xff\xfe not a token"), "logprob": -9999.0},
                {"token": _token(b"\xff\xfe nor this"), "logprob": -1000.0},
                {"token": {"text": "", "bytes": []}, "logprob": -0.5},
                {"token": _token(b"\xff\xfe null"), "logprob": None}]

    (r, _) = run_vectors(engine, load_vector_dir(perturbed(records, tmp_path, edit)))
    assert r.passed, [f.message for f in r.failures]


def test_ds4s_skipped_case_is_reported_not_run(engine, records, tmp_path):
    recs = {"long_memory_archive": dict(records["tiny_code"], id="long_memory_archive")}
    vset = load_vector_dir(write_set(tmp_path / "s", recs, ctx={"long_memory_archive": 128}))
    (r,) = run_vectors(engine, vset)
    assert (r.status, r.reason, r.failures) == ("skipped", "ds4 skips it: API/official graph mismatch", ())
    (r,) = run_vectors(engine, vset, skip={})
    assert r.status == "pass"


# -- the comparisons and the files ---------------------------------------------------------------------


def test_check_step_is_ds4s_float32_comparison():
    step = OfficialStep(b"a", (OfficialTop(b"b", -5.0),))
    local = [(b"a", -0.1), (b"b", -1.0)]
    assert check_step(0, step, b"a", local) == []  # |-1 - -5| = 4: allowed
    below = float(np.nextafter(np.float32(-5.0), np.float32(-np.inf)))
    (f,) = check_step(3, OfficialStep(b"a", (OfficialTop(b"b", below),)), b"a", local)
    assert (f.step, f.kind) == (3, "logprob")
    # the first local entry with those bytes is the one compared (ds4 breaks at the first match)
    assert check_step(0, step, b"a", [(b"b", -5.0), (b"b", -100.0)]) == []
    kinds = [f.kind for f in check_step(1, step, b"x", [(b"x", 0.0)])]
    assert kinds == ["selected", "missing"]


def test_official_steps_filter_and_values():
    rec = {"steps": [{"token": {"bytes": [65]}, "top_logprobs": [
        {"token": {"bytes": [65]}, "logprob": -0.1234567890123},
        {"token": {"bytes": [66]}, "logprob": -999.5},
        {"token": {"bytes": [67]}, "logprob": -1000.0},
        {"token": {"bytes": []}, "logprob": -1.0}]}]}
    (step,) = official_steps(rec)
    assert step.selected == b"A"
    assert [t.token for t in step.top] == [b"A", b"B"]
    assert step.top[0].logprob == float(np.float32(-0.123456789)) == official_logprob(-0.1234567890123)
    for bad in ({"steps": []}, {"steps": [{"token": {"bytes": [300]}}]},
                {"steps": [{"token": {"bytes": [1]}, "top_logprobs": [{"token": {"bytes": [1]}, "logprob": "x"}]}]}):
        with pytest.raises(VectorError):
            official_steps(bad)


def test_preview_set_is_ds4s_fixture():
    """The shipped set reads back as ds4's official.vec: ids, contexts, steps, selected bytes."""
    vset = load_vector_set("preview")
    assert (vset.name, vset.model) == ("preview", "deepseek-v4-flash")
    assert vset.ids == ["short_italian_fact", "short_code_completion", "short_reasoning_plain",
                        "long_memory_archive", "long_code_audit"]
    assert [c.ctx for c in vset.cases] == [CTX_BY_ID[i] for i in vset.ids] == [16384, 4096, 4096, 16384, 16384]
    assert [len(c.steps) for c in vset.cases] == [4, 4, 1, 4, 4]
    assert [s.selected for s in vset.cases[0].steps] == [b"Ada", b" Lov", b"el", b"ace"]
    assert [s.selected for s in vset.cases[1].steps] == [b"```", b"c", b"\n", b"return"]
    assert [s.selected for s in vset.cases[2].steps] == [b"16"]
    # the API returned one real entry per step (its choice, logprob 0), the others are -9999
    for c in vset.cases:
        assert all(s.top == (OfficialTop(s.selected, 0.0),) for s in c.steps), c.id
    assert [c.api_prompt_tokens for c in vset.cases] == [21, 27, 18, 3353, 3844]
    assert set(DS4_SKIPPED) == {"long_memory_archive"}


def test_0731_set_is_ds4s_flash_0731_fixture():
    """ds4's flash-0731/official.vec (Aug 2026), read back: selected bytes per step; nothing skipped."""
    vset = load_vector_set("0731")
    assert vset.ids == ["short_italian_fact", "short_code_completion", "short_reasoning_plain",
                        "long_memory_archive", "long_code_audit"]
    assert [c.ctx for c in vset.cases] == [16384, 4096, 4096, 16384, 16384]
    assert [[s.selected for s in c.steps] for c in vset.cases] == [
        [b"Ada", b" Lov", b"el", b"ace"], [b"return"], [b"16"],
        [b"Component", b" gamma", b" reports", b" anomalies"], [b"The", b" most", b" important", b" code"]]
    for c in vset.cases:
        assert all(s.top == (OfficialTop(s.selected, 0.0),) for s in c.steps), c.id
    assert SKIPPED_BY_SET.get("0731", {}) == {} and SKIPPED_BY_SET["preview"] == DS4_SKIPPED


def test_cli_default_set_is_the_files_checkpoint(capsys, tiny_model_path, tmp_path):
    link = tmp_path / "DeepSeek-V4-Flash-tiny-0731.gguf"
    link.symlink_to(tiny_model_path)
    rc, out, err = run_cli(capsys, "-m", str(link), "--only", "short_reasoning_plain", "long_memory_archive", "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["set"] == "0731"
    assert [c["result"] for c in doc["cases"]] == ["fail", "fail"]  # the 0731 fixture skips nothing
    rc, out, _ = run_cli(capsys, "-m", str(link), "--set", "preview", "--only", "long_memory_archive", "--json")
    assert json.loads(out)["set"] == "preview" and json.loads(out)["cases"][0]["result"] == "skipped"


def test_set_and_dir_errors(tmp_path, records):
    with pytest.raises(VectorError, match=r"no vector set '0732' ships with this ds4-mlx \(shipped: 0731, preview\)"):
        load_vector_set("0732")
    with pytest.raises(VectorError, match="named by its checkpoint"):
        load_vector_set("../preview")
    with pytest.raises(VectorError, match="does not exist"):
        load_vector_dir(tmp_path / "none")
    root = write_set(tmp_path / "d", {"unknown_id": dict(records["tiny_code"], id="unknown_id")}, ctx={})
    with pytest.raises(VectorError, match="'unknown_id' has no ctx"):
        load_vector_dir(root)
    root = write_set(tmp_path / "e", {"tiny_code": records["tiny_code"]})
    (root / "prompts" / "tiny_code.txt").write_text("another prompt", encoding="utf-8")
    with pytest.raises(VectorError, match="its prompt differs"):
        load_vector_dir(root)
    m = json.loads((root / "manifest.json").read_text())
    m["prompts"][0]["prompt_file"] = "../../etc/passwd"
    (root / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(VectorError, match="outside"):
        load_vector_dir(root)
    (root / "manifest.json").write_text("{not json")
    with pytest.raises(VectorError, match="cannot read"):
        load_vector_dir(root)


# -- the command -----------------------------------------------------------------------------------


def run_cli(capsys, *argv):
    rc = main(["vectors", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_passing_set_exit_0_and_table(capsys, tiny_model_path, self_dir):
    rc, out, err = run_cli(capsys, "-m", str(tiny_model_path), "--dir", str(self_dir))
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == ["case", "steps", "result", "first", "failure"]
    assert lines[1].split() == ["tiny_italian", "3", "pass"] and lines[2].split() == ["tiny_code", "2", "pass"]
    assert lines[-1] == "2 passed, 0 failed, 0 skipped"


def test_cli_failing_set_exit_1_table_and_json(capsys, tiny_model_path, records, tmp_path):
    def edit(recs):
        recs["tiny_code"]["steps"][1]["token"]["bytes"] = list(b"zz")

    d = perturbed(records, tmp_path, edit)
    rc, out, err = run_cli(capsys, "-m", str(tiny_model_path), "--dir", str(d))
    assert (rc, err) == (1, "")
    row = next(line for line in out.splitlines() if line.startswith("tiny_code"))
    assert row.split()[:3] == ["tiny_code", "2", "FAIL"] and "step 1: selected token mismatch" in row
    assert out.splitlines()[-1] == "1 passed, 1 failed, 0 skipped"
    rc, out, _ = run_cli(capsys, "-m", str(tiny_model_path), "--dir", str(d), "--json", "--only", "tiny_code")
    doc = json.loads(out)
    assert rc == 1 and doc["passed"] is False and [c["id"] for c in doc["cases"]] == ["tiny_code"]
    (case,) = doc["cases"]
    assert case["result"] == "fail" and [(f["step"], f["kind"]) for f in case["failures"]] == [(1, "selected")]
    assert case["failures"][0]["official_bytes"] == list(b"zz")


def test_cli_preview_set_on_the_tiny_model_fails_and_skips(capsys, tiny_model_path):
    rc, out, err = run_cli(capsys, "-m", str(tiny_model_path), "--only", "short_reasoning_plain", "long_memory_archive")
    assert (rc, err) == (1, "")
    rows = {line.split()[0]: line for line in out.splitlines()[1:-1]}
    assert rows["short_reasoning_plain"].split()[1:3] == ["1", "FAIL"]
    assert "step 0: selected token mismatch" in rows["short_reasoning_plain"]
    assert rows["long_memory_archive"].split()[1:3] == ["4", "skipped"]
    assert "(ds4 skips it: API/official graph mismatch)" in rows["long_memory_archive"]
    assert out.splitlines()[-1] == "0 passed, 1 failed, 1 skipped"


@pytest.mark.parametrize("argv, message", [
    (["--set", "0732"], "no vector set '0732' ships with this ds4-mlx (shipped: 0731, preview)"),
    (["--only", "nope"], "no case 'nope' in vector set 'preview'"),
    (["--dir", "/nonexistent/vectors"], "vector directory /nonexistent/vectors does not exist"),
])
def test_cli_errors_one_line_exit_2(capsys, tiny_model_path, argv, message):
    rc, out, err = run_cli(capsys, "-m", str(tiny_model_path), *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("ds4-mlx vectors: error: ") and message in err
