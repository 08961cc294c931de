"""The README's examples run as written.

Every fenced block whose info string says ``runnable`` (```bash runnable, ```python runnable) is
executed here on the oracle's tiny model: ``MODEL.gguf`` in a block stands for the reader's model
file and is replaced by the tiny model's path. Shell blocks run under ``bash -euo pipefail`` with
the venv's ``ds4-mlx`` first on PATH; Python blocks in a fresh interpreter. Each runs in its own
empty directory, so a block cannot lean on files another one left.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.S | re.M)


def runnable_blocks(text: str | None = None) -> list[tuple[str, str, int]]:
    """(language, code, line number) of the runnable blocks of ``text`` (default: the README)."""
    if text is None:
        text = (REPO / "README.md").read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        lang, info, code = m.group(1), m.group(2), m.group(3)
        if "runnable" in info.split():
            out.append((lang, code, text.count("\n", 0, m.start()) + 1))
    return out


def test_readme_has_runnable_shell_and_python_blocks():
    langs = {lang for lang, _, _ in runnable_blocks()}
    assert {"bash", "python"} <= langs, langs


def test_fence_parser_finds_marked_blocks_only():
    """The extraction itself: a marked block is found, an unmarked one is not."""
    sample = "x\n```bash runnable\necho hi\n```\n```bash\necho no\n```\n"
    assert runnable_blocks(sample) == [("bash", "echo hi\n", 2)]


_BLOCKS = runnable_blocks()


@pytest.mark.parametrize("lang, code, line", _BLOCKS, ids=[f"{lang}-line{line}" for lang, _, line in _BLOCKS])
def test_readme_block_runs(lang, code, line, tiny_model_path, tmp_path):
    code = code.replace("MODEL.gguf", str(tiny_model_path))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    elif lang == "python":
        cmd = [sys.executable, "-c", code]
    else:
        pytest.fail(f"README.md:{line}: runnable block in unsupported language {lang!r}")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, (f"README.md:{line} ({lang}) exited {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
    assert "Traceback" not in proc.stderr, f"README.md:{line}:\n{proc.stderr[-3000:]}"
