"""A model file truncated while mapped (issue #8, 6i): the process never dies by a bare SIGBUS.

Truncation between weight reads is caught by ``GGUFFile.check_intact`` (an fstat at load and before
each layer) as a GGUFError naming the file; truncation during a read kills the process with SIGBUS,
and ``mapping_guard``'s watcher then prints one line naming the file instead of a stack dump. Both
run in subprocesses: a SIGBUS cannot be survived.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ds4_mlx.errors import GGUFError
from ds4_mlx.formats.gguf import GGUFFile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("PYTHONFAULTHANDLER", None)  # a faulthandler already on is left to its owner
    return env


def _child(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())


def _assert_one_clear_line(err: str, path) -> None:
    assert "Traceback" not in err and "Fatal Python error" not in err and "most recent call" not in err, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert 1 <= len(lines) <= 2, err
    assert any(str(path) in l and "shrank from" in l for l in lines), err


def test_check_intact_names_a_file_that_shrank(tmp_path, small_model_path):
    p = tmp_path / "m.gguf"
    shutil.copy(small_model_path, p)
    with GGUFFile(p) as f:
        f.check_intact()
        size = f.file_size
        with open(p, "r+b") as fh:
            fh.truncate(size // 2)
        with pytest.raises(GGUFError, match=rf"{p}: the file shrank from {size:,} to {size // 2:,} bytes while"):
            f.check_intact()


def test_sigbus_reading_a_truncated_mapping_names_the_file(tmp_path, small_model_path):
    """The race the fstat checks cannot close: the file is cut just before a read of its mapping."""
    p = tmp_path / "m.gguf"
    shutil.copy(small_model_path, p)
    proc = _child(f"""
        import os
        import numpy as np
        from ds4_mlx.formats.layout import load_model_file
        f, cfg, _ = load_model_file({str(p)!r})
        os.truncate({str(p)!r}, 100_000)
        print(np.asarray(f.tensor_data("output.weight")).sum())  # pages past the new end: SIGBUS
    """)
    out, err = proc.communicate(timeout=120)  # returns once the watcher, which holds stderr, is done too
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, err)
    _assert_one_clear_line(err, p)
    assert "SIGBUS" in err


def test_prefills_while_the_file_is_truncated_end_in_one_line(tmp_path, small_model_path):
    p = tmp_path / "m.gguf"
    shutil.copy(small_model_path, p)
    proc = _child(f"""
        import sys
        from ds4_mlx.engine.session import Session
        from ds4_mlx.errors import Ds4Error
        from ds4_mlx.model.loader import load
        try:
            model = load({str(p)!r})
            n = 0
            while True:
                s = Session(model, 256)
                s.append(list(range(1, 65)))
                n += 1
                if n == 1:
                    print("ready", flush=True)
        except Ds4Error as exc:
            print(f"error: {{exc}}", file=sys.stderr)
            sys.exit(2)
    """)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
    time.sleep(0.2)
    os.truncate(p, os.path.getsize(p) // 3)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the process did not end after its model file was truncated")
    assert proc.returncode in (2, -signal.SIGBUS), (proc.returncode, err)
    _assert_one_clear_line(err, p)


@pytest.mark.parametrize("dump", [b"Fatal Python error: Bus error\n\nThread 0x1 (most recent call first):\n",
                                  b"Fatal Python error: "])
def test_the_watcher_names_a_shrunk_file_even_from_a_cut_dump(tmp_path, dump):
    """Two native threads can fault on the truncated mapping at once: faulthandler hands the signal back
    after the first, the second kills the process mid-dump (CI saw only "Fatal Python error: "). The
    watcher decides by the file, which shrank: one line either way; an unrelated crash's dump (no
    watched file changed) passes through."""
    from ds4_mlx.formats import mapping_guard

    p = tmp_path / "m.gguf"
    p.write_bytes(b"\0" * 4096)

    def watcher(records: bytes) -> str:
        proc = subprocess.run([sys.executable, "-I", "-S", "-c", mapping_guard._WATCHER], input=records,
                              capture_output=True, timeout=60)
        return proc.stderr.decode()

    register = mapping_guard._WATCH + json.dumps({"path": str(p), "size": 4096}).encode() + b"\n"
    intact = watcher(register + dump)
    assert intact.startswith(dump.decode()) or "bus error (SIGBUS)" in intact  # nothing shrank: the dump
    os.truncate(p, 1000)
    err = watcher(register + dump)
    assert "Fatal Python error" not in err, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and str(p) in lines[0] and "shrank from 4096 to 1000 bytes" in lines[0], err
