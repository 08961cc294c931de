"""`ds4-mlx bench` and ``ds4_mlx.engine.bench``: ds4-bench's context-frontier sweep on the tiny model.

Small frontiers (tens of tokens) keep each run to seconds on the CPU backend.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4_mlx.engine import bench
from ds4_mlx.engine.bench import CSV_COLUMNS, BenchError, BenchRow, frontiers, run_sweep
from ds4_mlx.frontends.cli import main

REPO = Path(__file__).resolve().parents[1]
DS4_BENCH_COLUMNS = ["ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kvcache_bytes"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """A few thousand tokens of real text from the repository (README and sources)."""
    parts = [(REPO / "README.md").read_text(encoding="utf-8")]
    parts += [p.read_text(encoding="utf-8") for p in sorted((REPO / "ds4_mlx" / "engine").glob("*.py"))]
    path = tmp_path_factory.mktemp("bench") / "text.txt"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def engine_cpu(tiny_model_path):
    from ds4_mlx.engine.engine import Engine

    return Engine.open(tiny_model_path, numerics="ds4-cpu")


@pytest.fixture(scope="module")
def engine_default(tiny_model_path):
    from ds4_mlx.engine.engine import Engine

    return Engine.open(tiny_model_path)


def test_frontiers_step_then_always_the_max():
    assert frontiers(2048, 2048, 32768) == list(range(2048, 32769, 2048))
    assert frontiers(64, 100, 200) == [64, 164, 200]
    assert frontiers(5, 1, 5) == [5]
    assert frontiers(1, 7, 3) == [1, 3]


@pytest.mark.parametrize("kwargs, what", [
    (dict(ctx_start=0), "ctx_start must be >= 1"),
    (dict(ctx_step=0), "ctx_step must be >= 1"),
    (dict(ctx_start=10, ctx_max=9), "ctx_max (9) must be >= ctx_start (10)"),
    (dict(gen_tokens=-1), "gen_tokens must be >= 0"),
    (dict(ctx_start=2.5), "ctx_start must be an integer"),
    (dict(ctx_max=True), "ctx_max must be an integer"),
    (dict(ctx_max=1_048_576, gen_tokens=1), "exceeds the model's context of 1048576 tokens"),
])
def test_sweep_refuses_bad_parameters(engine_default, kwargs, what):
    args = dict(ctx_start=4, ctx_step=4, ctx_max=8, gen_tokens=1) | kwargs
    with pytest.raises(BenchError) as exc:
        run_sweep(engine_default, list(range(100, 110)), **args)
    assert what in str(exc.value)


def test_sweep_refuses_too_few_tokens(engine_default):
    with pytest.raises(BenchError, match="has 7 tokens; the sweep needs at least ctx_max=8"):
        run_sweep(engine_default, list(range(100, 107)), ctx_start=4, ctx_step=4, ctx_max=8, gen_tokens=1)


def test_generation_after_restore_equals_a_cold_prefill(engine_cpu, text_file):
    """The last frontier's greedy tokens, generated on a session restored and extended twice, are those
    of a fresh session prefilling the same prefix (ds4-cpu numerics: every chunking gives the same
    bits). Guards the snapshot against decode steps writing into state it shares."""
    tokens = engine_cpu.tokenizer.encode(text_file.read_text(encoding="utf-8"))
    seen = []
    rows = run_sweep(engine_cpu, tokens, ctx_start=5, ctx_step=5, ctx_max=15, gen_tokens=2, on_row=seen.append)
    assert seen == rows and [r.ctx_tokens for r in rows] == [5, 10, 15]
    last = rows[-1]  # reached through two generate-then-restore rounds
    cold = engine_cpu.new_session(ctx=32)
    cold.sync(tokens[:last.ctx_tokens])
    want = []
    for _ in range(2):
        want.append(cold.argmax())
        cold.eval(want[-1])
    assert list(last.generated) == want


def test_sweep_detects_a_restore_that_does_not_restore(engine_default, text_file, monkeypatch):
    """Without a working restore the next prefill window would silently time a rebuild."""
    from ds4_mlx.engine.session import Session

    monkeypatch.setattr(Session, "restore", lambda self, snap: None)
    tokens = engine_default.tokenizer.encode(text_file.read_text(encoding="utf-8"))
    with pytest.raises(BenchError, match="restore is broken"):
        run_sweep(engine_default, tokens, ctx_start=8, ctx_step=8, ctx_max=16, gen_tokens=2)


class _FakeSession:
    def __init__(self, logits):
        self._logits = np.asarray(logits, dtype=np.float32)

    def logits(self):
        return self._logits


def test_greedy_skips_eos_like_ds4_bench():
    assert bench._greedy_no_eos(_FakeSession([0.0, 5.0, 3.0, 3.0]), eos_id=1) == 2  # next best, first on ties
    assert bench._greedy_no_eos(_FakeSession([0.0, 5.0, 3.0]), eos_id=0) == 1
    assert bench._greedy_no_eos(_FakeSession([0.0, 5.0, 3.0]), eos_id=None) == 1


def test_cli_writes_csv_table_and_png(capsys, tiny_model_path, text_file, tmp_path):
    out_csv, out_png = tmp_path / "out.csv", tmp_path / "out.png"
    rc = main(["bench", "-m", str(tiny_model_path), "--prompt-file", str(text_file), "--ctx-start", "64",
               "--ctx-step", "64", "--ctx-max", "192", "--gen", "4", "--csv", str(out_csv), "--plot", str(out_png)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    with out_csv.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        rows = list(reader)
    assert header == list(CSV_COLUMNS) and header[:6] == DS4_BENCH_COLUMNS
    assert [int(r[0]) for r in rows] == [64, 128, 192]
    assert all(int(r[1]) == 64 and int(r[3]) == 4 for r in rows)
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows)
    kv = [int(r[5]) for r in rows]
    assert kv[0] > 0 and kv == sorted(set(kv))  # strictly growing with the context
    assert all(int(r[6]) > 0 and int(r[7]) > 0 for r in rows)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = out.splitlines()
    assert table[0].split()[:2] == ["ctx", "prefill"] and len(table) == 4
    assert [int(line.split()[0]) for line in table[1:]] == [64, 128, 192]


def test_plot_svg(tmp_path):
    from ds4_mlx.frontends.cmd_bench import plot_rows

    rows = [BenchRow(c, 64, 300.0 - c / 10, 4, 25.0 - c / 100, 1000 * c, 1 << 30, 1 << 29) for c in (64, 128, 192)]
    path = tmp_path / "out.svg"
    plot_rows(rows, str(path), title="tiny.gguf - mlx cpu")
    svg = path.read_text(encoding="utf-8")
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and svg.rstrip().endswith("</svg>")


def test_missing_matplotlib_is_one_line(capsys, tiny_model_path, text_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    rc = main(["bench", "-m", str(tiny_model_path), "--prompt-file", str(text_file), "--ctx-start", "8",
               "--ctx-max", "8", "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "pip install 'ds4-mlx[plot]'" in err
    assert not (tmp_path / "p.png").exists()


def _hostile_cases(tmp: Path, model: Path, text: Path):
    (tmp / "latin1.txt").write_bytes(b"caf\xe9 " * 10)
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "notgguf.gguf").write_bytes(b"not a gguf file at all" * 10)
    base = ["bench", "-m", str(model), "--prompt-file", str(text), "--ctx-start", "8", "--ctx-max", "16"]
    return [
        (base + ["--ctx-start", "0"], "--ctx-start must be >= 1, got 0"),
        (base + ["--ctx-start", "-5"], "--ctx-start must be >= 1"),
        (base + ["--ctx-start", "abc"], "--ctx-start must be an integer, got 'abc'"),
        (base + ["--ctx-max", "1e3"], "--ctx-max must be an integer"),
        (base + ["--ctx-max", ""], "--ctx-max must be an integer"),
        (base + ["--ctx-step", "0"], "--ctx-step must be >= 1"),
        (base + ["--ctx-max", "4"], "--ctx-max (4) must be >= --ctx-start (8)"),
        (base + ["--gen", "-1"], "--gen must be >= 0"),
        (base + ["--gen", "2.5"], "--gen must be an integer"),
        (base + ["--plot", str(tmp / "out.jpg")], "must end in .png or .svg"),
        (base + ["--plot", str(tmp / "nodir" / "out.png")], "is not a directory"),
        (base + ["--csv", str(tmp / "nodir" / "out.csv")], "cannot write --csv"),
        (base + ["--csv", str(tmp)], "cannot write --csv"),
        (base[:4] + [str(tmp / "missing.txt")] + base[5:], "cannot read --prompt-file"),
        (base[:4] + [str(tmp)] + base[5:], "it is a directory"),
        (base[:4] + [str(tmp / "latin1.txt")] + base[5:], "is not UTF-8 (byte 3)"),
        (base[:4] + [str(tmp / "empty.txt")] + base[5:], "is empty"),
        (["bench", "-m", str(tmp / "missing.gguf")] + base[3:], "no such model file"),
        (["bench", "-m", str(tmp / "notgguf.gguf")] + base[3:], "notgguf.gguf"),
        (base + ["--ctx-max", "1048576", "--gen", "128"], "exceeds the model's context of 1048576 tokens"),
        (base + ["--ctx-max", "999999"], "--ctx-max needs at least 999999: use a longer text"),
    ]


def test_hostile_arguments_get_one_line_and_status_2(capsys, tiny_model_path, text_file, tmp_path):
    for argv, what in _hostile_cases(tmp_path, tiny_model_path, text_file):
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2, (argv, err)
        assert err.startswith("ds4-mlx bench: error: ") and err.count("\n") == 1, (argv, err)
        assert what in err, (argv, err)
