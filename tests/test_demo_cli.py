"""`ds4-mlx demo` builds its model once into the cache folder and runs the generate path on it."""

from __future__ import annotations

import re

from ds4_mlx.frontends.cli import main


def test_demo_builds_once_then_reuses(tmp_path, capsys):
    cache = tmp_path / "cache"
    assert main(["demo", "--cache-dir", str(cache), "-n", "3"]) == 0
    first = capsys.readouterr()
    model = cache / "ds4-tiny-demo.gguf"
    assert model.is_file()
    assert "writing a tiny random-weight model" in first.err
    stats = re.search(r"prompt: (\d+) tokens .*generation: [\d.]+ t/s \((\d+) tokens\)", first.err)
    assert stats and int(stats.group(1)) > 5 and int(stats.group(2)) <= 3
    mtime = model.stat().st_mtime_ns

    assert main(["demo", "--cache-dir", str(cache), "-n", "3"]) == 0
    second = capsys.readouterr()
    assert "writing a tiny" not in second.err
    assert model.stat().st_mtime_ns == mtime
    # same seed, same model, same prompt: the same text
    assert second.out == first.out


def test_demo_with_missing_model_is_one_line_error(tmp_path, capsys):
    assert main(["demo", "--model", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("ds4-mlx demo: error:") and "nope.gguf" in last and "No such file" in last
