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


def test_two_demos_at_once_both_succeed(tmp_path):
    """Two first runs at the same moment: one writes the model, the other waits for it and reuses it
    (before, both wrote the same ``.partial`` file and one died with a traceback in the writer)."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "cache"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "ds4_mlx.frontends.cli", "demo", "--cache-dir", str(cache), "-n", "2"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert "Traceback" not in err, err
    assert sum("writing a tiny random-weight model" in err for _, err in results) == 1, [e for _, e in results]
    assert results[0][0] == results[1][0]  # the same model, prompt and seed: the same text
    assert sorted(x.name for x in cache.iterdir()) == ["ds4-tiny-demo.gguf", "ds4-tiny-demo.gguf.lock"]
